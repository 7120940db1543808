"""The hang watchdog: a worker stuck on a batch becomes a WorkerHangError
naming the worker, its pid, the batch and sample indices, with its stack."""

from __future__ import annotations

import logging
import os
import pathlib
import re
import signal
import time
from typing import Any, Iterator, Tuple

import pytest

from fastload import FastLoader, WorkerHangError
from fastload.debug import debug_view
from support import HANG_S
from support.faults import Misbehave
from support.processes import wait_pids_gone
from support.slow_start import slow_start, started


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


@pytest.mark.parametrize("restarts", [0, pytest.param(1, marks=pytest.mark.heavy)])
def test_a_worker_stopped_before_it_joins_the_ring_is_a_hang(restarts: int) -> None:
    # A spawned worker takes a second or more to import torch: stopped right
    # after iter(), it has not joined the ring, so it holds no task the ring
    # knows of. It still owes its session and batches.
    loader = FastLoader(Misbehave(6, {}, seconds=0), batch_size=2, num_workers=1,
                        hang_timeout=1.5, max_worker_restarts=restarts,
                        multiprocessing_context="spawn")
    it = iter(loader)
    pid = debug_view(it).worker_pids[0]
    os.kill(pid, signal.SIGSTOP)
    assert debug_view(it).ring.worker_pid(0) == 0, "the worker joined before it was stopped"
    if restarts:
        assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5]]
        assert wait_pids_gone([pid]) == []
        return
    with pytest.raises(WorkerHangError, match=r"made no progress for \d+ s on its start-up"):
        next(it)
    assert wait_pids_gone([pid]) == []


def _slow_starting(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                   **start: float) -> Tuple[Iterator[Any], int]:
    """An iterator over one spawned worker whose start-up, before it joins
    the ring, is slowed as ``start`` says (see support.slow_start), with
    hang_timeout=0.5; and the worker's pid."""
    slow_start(monkeypatch, str(tmp_path), **start)
    loader = FastLoader(Misbehave(4, {}, seconds=0), batch_size=2, num_workers=1,
                        hang_timeout=0.5, multiprocessing_context="spawn")
    it = iter(loader)
    return it, debug_view(it).worker_pids[0]


def test_a_worker_busy_starting_for_longer_than_hang_timeout_is_not_a_hang(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Until a worker joins the ring, the CPU time it uses is its progress: a
    # spawned worker busy for longer than hang_timeout before it joins (as
    # one importing torch on a slow machine is) is starting, not hung. Its
    # start-up here burns twice hang_timeout of CPU time first.
    it, pid = _slow_starting(monkeypatch, tmp_path, busy_s=1.0)
    assert [b.tolist() for b in it] == [[0, 1], [2, 3]]
    # The slow part of the start-up did run, in that worker (a spawned
    # worker that skipped it would test nothing).
    assert list(started(str(tmp_path))) == [pid]
    assert started(str(tmp_path))[pid] >= 1.0


def test_a_worker_blocked_starting_for_hang_timeout_is_a_hang(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The other side: a worker that uses no CPU time before it has joined
    # (blocked on a lock or a file system that does not answer; here asleep)
    # is hung, as a stopped one is.
    it, pid = _slow_starting(monkeypatch, tmp_path, sleep_s=60)
    t0 = time.monotonic()
    with pytest.raises(WorkerHangError, match=rf"worker 0 \(pid {pid}\) made no progress for "
                                              r"\d+ s on its start-up"):
        next(it)
    assert time.monotonic() - t0 < HANG_S  # generous: only catches a real hang
    assert started(str(tmp_path)) == {}
    assert wait_pids_gone([pid]) == []
