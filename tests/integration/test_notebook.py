"""A Jupyter notebook that defines its dataset and a namedtuple in its cells.

A notebook's classes live in the kernel's ``__main__``, which no spawned
process can import: DataLoader under spawn fails on them. FastLoader's
workers must make the same batches as DataLoader's (fork), of the
notebook's own class.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("nbclient", "nbformat", "ipykernel")]

CELLS = [
    """\
import collections
import json

import torch
from torch.utils.data import DataLoader, Dataset

from fastload import FastLoader""",
    """\
Pair = collections.namedtuple("Pair", ["index", "noise"])


class Noisy(Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return Pair(torch.tensor(i), torch.rand(3))


def epoch(loader):
    return [[type(b) is Pair, b.index.tolist(), b.noise.tolist()] for b in loader]""",
    """\
torch.manual_seed(0)
expected = epoch(DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2))""",
    """\
torch.manual_seed(0)
got = epoch(FastLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2))
print(json.dumps({"dataloader": expected, "fastload": got}))""",
]


def test_notebook(tmp_path: Path) -> None:
    """A user iterates a FastLoader over a Dataset class written in a notebook cell."""
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    path = tmp_path / "train.ipynb"
    nbformat.write(notebook, path)
    runner = script("run_notebook.py", tmp_path)
    report = json_result(run([sys.executable, str(runner), str(path)], cwd=tmp_path, timeout=240))
    got, expected = report["fastload"], report["dataloader"]
    assert [own for own, *_ in got] == [True] * len(got), "batches are not the notebook's Pair"
    assert got == expected
