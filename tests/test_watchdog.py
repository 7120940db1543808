"""The hang watchdog: a worker stuck on a batch becomes a WorkerHangError
naming the worker, its pid, the batch and sample indices, with its stack."""

from __future__ import annotations

import logging
import re
import time

import pytest

from fastload import FastLoader, WorkerHangError
from fastload.debug import debug_view
from support.faults import Misbehave
from support.processes import wait_pids_gone


@pytest.mark.heavy
def test_stuck_worker_raises_with_its_stack(caplog: pytest.LogCaptureFixture) -> None:
    loader = FastLoader(Misbehave(8, {5: "sleep"}, seconds=60), batch_size=2, num_workers=2,
                        hang_timeout=2.0, reuse_workers=False)
    it = iter(loader)
    got = [next(it).tolist(), next(it).tolist()]  # batches 0 and 1 arrive
    assert got == [[0, 1], [2, 3]]
    pids = debug_view(it).worker_pids
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastload"):
        with pytest.raises(WorkerHangError) as exc:
            next(it)  # batch 2 = indices [4, 5] on worker 0 sleeps
    took = time.monotonic() - t0
    msg = str(exc.value)
    assert isinstance(exc.value, RuntimeError)
    assert re.search(rf"DataLoader worker 0 \(pid {pids[0]}\) made no progress", msg), msg
    assert "batch 2 of this epoch" in msg and "[4, 5]" in msg, msg
    assert "hang_timeout=2.0" in msg
    # faulthandler's dump: the frame the worker is stuck in.
    assert "support/faults.py" in msg and "__getitem__" in msg, msg
    assert any("has been on batch 2" in r.getMessage() for r in caplog.records)
    assert took < 30, f"hang reported after {took:.1f}s"  # generous: only catches a real hang
    # The epoch is over: workers stopped, and later next() repeats the error.
    assert wait_pids_gone(pids) == []
    with pytest.raises(RuntimeError, match="made no progress"):
        next(it)


def test_slow_but_progressing_workers_are_not_hangs() -> None:
    # Each batch takes ~0.3 s, the epoch 2+ s: longer than hang_timeout overall,
    # never on one batch.
    loader = FastLoader(Misbehave(8, {3: "sleep"}, seconds=0.3), batch_size=1, num_workers=2,
                        hang_timeout=1.0)
    assert [int(b) for b in loader] == list(range(8))


@pytest.mark.heavy
def test_none_turns_the_watchdog_off() -> None:
    loader = FastLoader(Misbehave(4, {1: "sleep"}, seconds=1.5), batch_size=1, num_workers=1,
                        hang_timeout=None)
    assert [int(b) for b in loader] == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [0, -1, "300", True])
def test_bad_hang_timeout_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="hang_timeout"):
        FastLoader(Misbehave(4, {1: "sleep"}, seconds=0), num_workers=1, hang_timeout=bad)  # type: ignore[arg-type]
