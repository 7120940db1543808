"""Worker restart: a worker that dies or hangs is replaced, its unfinished
batches are made again, and the epoch delivers every index once, in order."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.utils.data import DataLoader

from fastload import FastLoader
from support.faults import Misbehave


def _reference(ds, **kw):
    return [b.clone() for b in DataLoader(ds, num_workers=0, **kw)]


@pytest.mark.parametrize("how", ["kill", "sleep"], ids=["kill", "hang"])
@pytest.mark.heavy
def test_epoch_survives_a_dead_or_hung_worker(tmp_path, caplog, how: str) -> None:
    # The first worker to reach index 13 dies or hangs (sleeps a minute);
    # its replacement gets through.
    ds = Misbehave(40, {13: how}, once=os.fspath(tmp_path / "failed"), width=3,
                   dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    loader = FastLoader(ds, batch_size=4, shuffle=True, generator=g, num_workers=2,
                        max_worker_restarts=1, hang_timeout=1.5 if how == "sleep" else 300)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        got = [b.clone() for b in loader]
    expected = _reference(ds, batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(7))
    assert len(got) == len(expected) == 10
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    seen = sorted(int(x) for b in got for x in b[:, 0])
    assert seen == list(range(40))  # every index exactly once
    assert (tmp_path / "failed").exists()  # the fault did happen
    assert any("restarting worker" in r.getMessage() for r in caplog.records)
    # The loader is still good for another epoch.
    assert len(list(loader)) == 10


@pytest.mark.heavy
def test_restarts_are_limited(tmp_path) -> None:
    ds = Misbehave(16, {5: "kill"}, once=os.fspath(tmp_path / "failed"))
    loader = FastLoader(ds, batch_size=2, num_workers=2, max_worker_restarts=0)
    with pytest.raises(RuntimeError, match=r"is killed by signal: Killed"):
        list(loader)


@pytest.mark.heavy
def test_dataset_exceptions_are_not_retried() -> None:
    loader = FastLoader(Misbehave(8, {3: "raise"}), batch_size=2, num_workers=2,
                        max_worker_restarts=3)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError):
        next(it)
    assert len(list(it)) == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_bad_max_worker_restarts_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="max_worker_restarts"):
        FastLoader(Misbehave(4, {}), num_workers=1, max_worker_restarts=bad)  # type: ignore[arg-type]
