"""Hugging Face ``datasets`` as the dataset of a loader with 2 workers."""

from __future__ import annotations

import sys

import pytest

from .helpers import json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("datasets")]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    where = tmp_path_factory.mktemp("hf_datasets")
    return json_result(run([sys.executable, str(script("hf_datasets.py", where))],
                           cwd=where, timeout=300))


def test_hf_map_style(report: dict) -> None:
    """A user feeds ``Dataset.from_dict({...}).with_format("torch")`` to a
    shuffling loader: dicts of tensors, batch for batch as DataLoader's."""
    assert report["fastload"]["map_style"] == report["dataloader"]["map_style"]


def test_hf_iterable_set_epoch(report: dict) -> None:
    """A user streams ``to_iterable_dataset(num_shards=4).shuffle(seed=0, ...)``
    with ``persistent_workers=True`` and calls ``set_epoch(e)`` before each
    epoch: each epoch is reshuffled, in DataLoader's order."""
    expected, got = report["dataloader"]["epochs"], report["fastload"]["epochs"]
    assert len({tuple(order) for order in expected}) == 3, "DataLoader's epochs should all differ"
    for epoch in range(3):
        assert sorted(got[epoch]) == list(range(64)), f"epoch {epoch} is not one pass over the data"
        assert got[epoch] == expected[epoch], f"epoch {epoch}: order differs from DataLoader's"
