"""A worker's death wakes the main process's wait on the ring.

The ring watches each worker's pidfd; when one fires, a wait on the ring
answers WORKER_DIED instead of sleeping to its timeout, and the iterator
runs its supervision check at once. The tests wait with timeouts far longer
than the test may take (or none at all) and assert on what the wait
answered, never on how long it took.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from fastload import FastLoader, _core
from fastload.debug import debug_view
from support import KILLED_RE
from support.faults import Gate, Misbehave

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs os.pidfd_open (Linux 5.3+)")

LONG = 600.0  # a timeout no passing test reaches


@pytest.fixture
def alarm() -> Iterator[None]:
    """Turn a wait that never ends into a failure: SIGALRM interrupts the
    ring's futex wait, and the handler's exception reaches the test."""

    def ring_never_woke(signum: int, frame: object) -> None:
        raise TimeoutError("the wait was not woken by the worker's death")

    old = signal.signal(signal.SIGALRM, ring_never_woke)
    signal.alarm(120)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _wait(ring: "_core.Ring", slot: int, seq: int) -> "_core.WaitResult":
    """wait_any with a timeout no passing test reaches. A signal (SIGCHLD,
    where a handler is installed) interrupts the wait, which then answers
    TIMED_OUT so that Python can run the handler: wait again, as the
    iterator does (the ``alarm`` fixture ends a wait that never ends)."""
    while True:
        status, which = ring.wait_any([slot], [seq], LONG)
        if status != _core.WaitResult.TIMED_OUT:
            assert which == (0 if status == _core.WaitResult.READY else -1)
            return status


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _kill_soon(proc: subprocess.Popen, after: float = 0.2) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(after), proc.kill()), daemon=True)
    t.start()
    return t


def _ring_with_a_task() -> "tuple[_core.Ring, int]":
    """A ring whose one task nobody will ever make."""
    ring = _core.Ring.create(2, 2, 4096)
    slot = ring.pop_free_slot()
    assert slot is not None
    ring.assign(slot, 11, 1, b"task")
    return ring, slot


def test_sigkill_wakes_wait_any(alarm: None) -> None:
    ring, slot = _ring_with_a_task()
    proc = _sleeper()
    try:
        pidfd = os.pidfd_open(proc.pid)
        ring.watch_worker(0, pidfd)
        os.close(pidfd)  # the ring keeps its own duplicate
        assert ring.wait_any([slot], [11], 0.01) == (_core.WaitResult.TIMED_OUT, -1)
        _kill_soon(proc)
        assert _wait(ring, slot, 11) == _core.WaitResult.WORKER_DIED
        assert ring.dead_workers() == [0]
        # Reported until acted on: the next wait answers the same at once.
        assert _wait(ring, slot, 11) == _core.WaitResult.WORKER_DIED
        ring.unwatch_worker(0)
        assert ring.dead_workers() == []
        assert ring.wait_any([slot], [11], 0.01) == (_core.WaitResult.TIMED_OUT, -1)
    finally:
        proc.kill()
        proc.wait()
        ring.shutdown()


def test_a_replacement_clears_the_death(alarm: None) -> None:
    ring, slot = _ring_with_a_task()
    dead, live = _sleeper(), _sleeper()
    try:
        for proc in (dead, live):
            pidfd = os.pidfd_open(proc.pid)
            ring.watch_worker(0 if proc is dead else 1, pidfd)
            os.close(pidfd)
        _kill_soon(dead)
        assert _wait(ring, slot, 11) == _core.WaitResult.WORKER_DIED
        pidfd = os.pidfd_open(live.pid)
        ring.watch_worker(0, pidfd)  # worker 0 replaced by a live process
        os.close(pidfd)
        assert ring.wait_any([slot], [11], 0.01)[0] == _core.WaitResult.TIMED_OUT
    finally:
        for proc in (dead, live):
            proc.kill()
            proc.wait()
        ring.shutdown()


def test_ready_comes_before_the_death(alarm: None) -> None:
    """A batch the dead worker committed is still delivered first."""
    ring = _core.Ring.create(2, 1, 4096)
    worker = _core.WorkerRing.attach(os.dup(ring.fd))
    worker.worker_started(0, os.getpid())
    slot = ring.pop_free_slot()
    assert slot is not None
    ring.assign(slot, 3, 0, b"task")
    status, got, seq, _ = worker.next_task(1.0)
    assert (status, got, seq) == (_core.WaitResult.READY, slot, 3)
    worker.commit(slot, 0, 0, 0, 0)
    proc = _sleeper()
    try:
        pidfd = os.pidfd_open(proc.pid)
        ring.watch_worker(0, pidfd)
        os.close(pidfd)
        proc.kill()
        proc.wait()
        assert _wait(ring, slot, 3) == _core.WaitResult.READY
        ring.release(slot)
        other = ring.pop_free_slot()
        assert other is not None
        ring.assign(other, 4, 0, b"task")
        assert _wait(ring, other, 4) == _core.WaitResult.WORKER_DIED
    finally:
        ring.shutdown()


def test_watch_worker_checks_its_arguments() -> None:
    ring = _core.Ring.create(1, 1, 4096)
    with pytest.raises(IndexError):
        ring.watch_worker(1, 0)
    with pytest.raises(RuntimeError, match="cannot watch worker 0"):
        ring.watch_worker(0, 1 << 20)  # not an open fd


@pytest.mark.parametrize("ctx", [None, "spawn", "fork"])
def test_a_killed_worker_ends_an_epoch_that_waits_forever(tmp_path, alarm: None, ctx) -> None:
    """No timeout and no hang watchdog: the iterator's waits have no end but
    a batch or a death, and a SIGKILLed worker is still reported."""
    ds = Misbehave(16, {5: "kill"})
    loader = FastLoader(ds, batch_size=2, num_workers=2, hang_timeout=None, timeout=0,
                        max_worker_restarts=0, multiprocessing_context=ctx)
    with pytest.raises(RuntimeError, match=KILLED_RE):
        list(loader)


@pytest.mark.parametrize("ctx", [None, "spawn"])
@pytest.mark.parametrize("on", [{5: "kill"}, {4: "kill", 2: "sleep"}])
def test_a_death_with_sigchld_ignored_is_reported(alarm: None, ctx, on) -> None:
    """With SIGCHLD ignored in the training process, the kernel reaps its
    children itself and their exit status is lost: a worker's death is still
    reported, also when it is deferred behind a batch a live worker owes. The
    zygote puts SIGCHLD back to the default and reaps its workers as usual,
    so the signal is named; a spawned worker reads as exit code 0
    (``subprocess``'s choice when the status is lost)."""
    old = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        ds = Misbehave(16, on, seconds=1.0)
        loader = FastLoader(ds, batch_size=2, num_workers=2, hang_timeout=None, timeout=0,
                            max_worker_restarts=0, multiprocessing_context=ctx)
        with pytest.raises(RuntimeError, match="DataLoader worker .* (is killed|exited)") as info:
            list(loader)
    finally:
        signal.signal(signal.SIGCHLD, old)
    expected = {None: "is killed by signal: Killed", "spawn": "exit code 0"}
    assert expected[ctx] in str(info.value)


_IGNORED_SIGCHLD_FORK = """
import signal, sys
sys.path.insert(0, {tests!r})
from fastload import FastLoader
from support.faults import Gate, Misbehave
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
for on in ({{5: "kill"}}, {{4: "kill", 2: "sleep"}}):
    loader = FastLoader(Misbehave(16, on, seconds=1.0), batch_size=2, num_workers=2,
                        hang_timeout=None, timeout=0, max_worker_restarts=0,
                        multiprocessing_context="fork")
    try:
        list(loader)
    except RuntimeError as e:
        print("ERROR:", e)
    else:
        print("NO ERROR")
"""


@pytest.mark.heavy
def test_a_forked_worker_s_death_with_sigchld_ignored_is_reported(tmp_path) -> None:
    """The same with ``multiprocessing_context="fork"``: multiprocessing never
    learns the exit code of a child the kernel reaped (its ``exitcode``
    stays None), so the ring's watch of the worker's pidfd is the only word
    of the death; the error says the status is unknown, and the loader stops
    without waiting out a grace period for the dead. Run as a script of its
    own: multiprocessing keeps such children in its records, with their
    pipes, for the life of the process."""
    script = tmp_path / "ignored.py"
    script.write_text(_IGNORED_SIGCHLD_FORK.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 2, out.stdout + out.stderr
    for line in lines:
        assert "its exit status is unknown because this process ignores SIGCHLD" in line, line
    assert "did not stop" not in out.stderr


def test_a_restart_under_waits_without_end(tmp_path, alarm: None) -> None:
    """The replacement is watched in place of the dead worker; the epoch and
    the next ones finish."""
    ds = Misbehave(16, {5: "kill"}, once=os.fspath(tmp_path / "failed"), width=3)
    loader = FastLoader(ds, batch_size=2, num_workers=2, hang_timeout=None,
                        max_worker_restarts=1)
    for _ in range(3):  # later epochs retire and fork workers: no death is reported
        got = sorted(int(x) for b in loader for x in b[:, 0])
        assert got == list(range(16))
        pool = debug_view(loader).idle_pool
        assert pool is not None and pool.ring.dead_workers() == []
    assert (tmp_path / "failed").exists()


def test_a_death_is_not_held_back_by_a_batch_a_live_worker_has_not_made(alarm: None) -> None:
    """Worker 0 dies on batch 2 while the loop waits for batch 1, which
    worker 1 is still making (slowly): the error comes at once, naming the
    dead worker's batch, rather than after batch 1. Batch 0, made before
    the death, is delivered first."""
    ds = Misbehave(16, {2: "sleep", 4: "kill"}, seconds=LONG)
    loader = FastLoader(ds, batch_size=2, num_workers=2, hang_timeout=None,
                        max_worker_restarts=0)
    it = iter(loader)
    got = [next(it).tolist()]
    with pytest.raises(RuntimeError, match=KILLED_RE) as info:
        next(it)
    assert got == [[0, 1]]
    assert "batch(es) 2" in str(info.value)


def _stuck_pair(tmp_path, ctx, restarts: int):
    """Two workers, batch size 1, samples 6 and later stuck behind a gate:
    worker 0 gets stuck on batch 6, worker 1 on batch 7. Three batches taken."""
    ds = Gate(40, os.fspath(tmp_path), from_index=6)
    loader = FastLoader(ds, batch_size=1, num_workers=2, multiprocessing_context=ctx,
                        hang_timeout=LONG / 4, max_worker_restarts=restarts)
    it = iter(loader)
    got = [int(next(it)) for _ in range(3)]
    return ds, it, got


# The default start in the default group; spawn and fork in the slow one.
_CTXS = [None, pytest.param("spawn", marks=pytest.mark.slow),
         pytest.param("fork", marks=pytest.mark.slow)]


@pytest.mark.parametrize("ctx", _CTXS)
@pytest.mark.parametrize("victim", [0, 1], ids=["stuck-behind", "stuck-ahead"])
def test_a_killed_worker_beside_a_stuck_one_is_reported_at_once(tmp_path, alarm: None,
                                                                ctx, victim: int) -> None:
    """A worker SIGKILLed while the other is stuck in a sample: the death
    is raised in DataLoader's words, naming its pid and the batches it held,
    without waiting for the stuck worker's batch (which only the hang
    watchdog, set far beyond the test's alarm, would end). Killing worker 1
    leaves the stuck worker 0 owing batch 6, ahead of the dead worker's 7;
    killing worker 0 leaves the dead worker owing batch 6, ahead of the
    stuck one's 7. Batches already made may still be delivered first."""
    ds, it, got = _stuck_pair(tmp_path, ctx, restarts=0)
    pid = debug_view(it).worker_pids[victim]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=KILLED_RE) as info:
        while True:
            got.append(int(next(it)))
    msg = str(info.value)
    assert int(re.search(KILLED_RE, msg).group(1)) == pid
    assert got == list(range(len(got))) and len(got) <= 6  # made before the gate, in order
    held = [int(b) for b in re.search(r"batch\(es\) ([\d, ]+) of this epoch", msg).group(1).split(", ")]
    # The dead worker's own batches, none of them delivered.
    assert held and all(b % 2 == victim and b >= len(got) for b in held), msg
    with pytest.raises(RuntimeError, match=KILLED_RE):
        next(it)  # the iterator stays failed, as DataLoader's does


@pytest.mark.parametrize("ctx", _CTXS)
@pytest.mark.parametrize("victim", [0, 1], ids=["stuck-behind", "stuck-ahead"])
def test_a_replacement_starts_while_the_other_worker_is_stuck(tmp_path, alarm: None,
                                                              ctx, victim: int) -> None:
    """With ``max_worker_restarts``, the dead worker's replacement starts
    and takes up its batches at once, while the other worker is still stuck
    (it does not queue behind the stuck batch); once the gate opens, every
    index arrives exactly once, in order."""
    ds, it, got = _stuck_pair(tmp_path, ctx, restarts=1)
    pids = debug_view(it).worker_pids
    os.kill(pids[victim], signal.SIGKILL)
    replacement_seen = threading.Event()

    def open_the_gate() -> None:
        # The replacement has entered the dead worker's first stuck sample
        # (6 or 7) while the other worker still sits in its own.
        deadline = time.monotonic() + LONG / 4
        while time.monotonic() < deadline:
            pids_in = ds.entered().get(6 + victim, [])
            if any(p not in pids for p in pids_in):
                replacement_seen.set()
                break
            time.sleep(0.02)
        ds.open()

    opener = threading.Thread(target=open_the_gate, daemon=True)
    opener.start()
    got += [int(b) for b in it]
    opener.join()
    assert replacement_seen.is_set()
    assert got == list(range(40))
