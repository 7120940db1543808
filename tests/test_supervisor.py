"""The supervisor's decisions on their own: a fake pool (its workers' deaths
and stacks made up by the test), a ring in this process with its workers
played by the test, and a clock the test moves."""

from __future__ import annotations

import logging
import math
import signal
import types
from typing import Any, List

import pytest

from fastload import WorkerHangError
from fastload.pool import supervisor
from fastload.pool.ledger import Record, Role
from fastload.pool.supervisor import Supervisor, WorkerLost
from support.fake_pool import FakePool
from support.ring_driver import FakeWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(supervisor, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def _batch(pool: FakePool, worker: int, idx: int) -> Record:
    return pool.ledger.assign(Role.BATCH, worker, b"t", idx=idx, index=[2 * idx, 2 * idx + 1])


def _sup(pool: FakePool, **kw: Any) -> Supervisor:
    started: List[int] = []
    sup = Supervisor(pool, pool.ledger, hang_timeout=kw.pop("hang_timeout", 10.0),  # type: ignore[arg-type]
                     max_restarts=kw.pop("max_restarts", 0), restartable=kw.pop("restartable", True),
                     start_session=lambda w: started.append(w) or pool.ledger.assign(  # type: ignore[func-returns-value]
                         Role.SESSION, w, b"s"),
                     **kw)
    sup.started = started  # type: ignore[attr-defined]
    return sup


def test_a_death_ends_the_epoch_naming_the_batches_it_did_not_make(clock: Clock) -> None:
    pool = FakePool()
    sup = _sup(pool)
    sup.check()  # all well
    made, lost = _batch(pool, 1, 1), _batch(pool, 1, 3)
    w1 = FakeWorker(pool.ring, 1)
    w1.take()
    w1.commit(made.slot)
    pool.dead = [(1, 1001, -signal.SIGKILL)]
    with pytest.raises(WorkerLost) as e:
        sup.check()
    msg = str(e.value.error)
    assert msg.startswith("DataLoader worker (pid 1001) is killed by signal: Killed.")
    assert "It was making batch(es) 3 of this epoch (indices [[6, 7]])" in msg
    assert "1 of this epoch" not in msg  # batch 1 was made: it is not lost


def test_a_death_waits_while_the_batch_due_next_is_made(clock: Clock) -> None:
    pool = FakePool()
    sup = _sup(pool)
    due, lost = _batch(pool, 0, 0), _batch(pool, 1, 1)
    w0 = FakeWorker(pool.ring, 0)
    w0.take()
    w0.commit(due.slot)
    pool.dead = [(1, 1001, 1)]
    sup.check(needed=due)  # batch 0 is made: it is delivered first
    assert sup.deaths_deferred
    with pytest.raises(WorkerLost, match="exited unexpectedly with exit code 1"):
        sup.check(needed=lost)  # the next one is not made: now


def test_a_dead_worker_is_restarted_and_its_batches_queued_again(clock: Clock) -> None:
    pool = FakePool()
    restarts: List[int] = []
    sup = _sup(pool, max_restarts=1, on_restart=lambda: restarts.append(1))
    a, b = _batch(pool, 1, 1), _batch(pool, 1, 3)
    FakeWorker(pool.ring, 1).take()
    pool.dead = [(1, 1001, -signal.SIGKILL)]
    sup.check()
    assert pool.replaced == [1] and sup.started == [1] and restarts == [1]  # type: ignore[attr-defined]
    assert sup.restarts_left == 0
    w1 = FakeWorker(pool.ring, 1)  # the new process: its session first, then batches 1 and 3
    got = [w1.take() for _ in range(3)]
    session = [r for r in pool.ledger.of_worker(1) if r.role is Role.SESSION][0]
    assert got == [(session.slot, session.seq), (a.slot, a.seq), (b.slot, b.seq)]


def test_an_iterable_dataset_s_dead_worker_is_not_restarted(clock: Clock) -> None:
    pool = FakePool()
    sup = _sup(pool, max_restarts=3, restartable=False)
    _batch(pool, 0, 0)
    pool.dead = [(0, 1000, -signal.SIGKILL)]
    with pytest.raises(WorkerLost):
        sup.check()
    assert pool.replaced == []


def test_a_worker_without_progress_is_warned_of_then_reported_with_its_stack(
        clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    pool = FakePool()
    sup = _sup(pool, hang_timeout=10.0)
    rec = _batch(pool, 0, 5)
    w0 = FakeWorker(pool.ring, 0)
    w0.join(1000)
    assert w0.take() == (rec.slot, rec.seq)  # it holds batch 5, and stops there
    sup.check()  # the watch starts
    clock.now += 4.9
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sup.check()
        assert not caplog.records
        clock.now += 0.2  # half of hang_timeout
        sup.check()
    assert "has been on batch 5 of this epoch (indices [10, 11]) for 5 s" in caplog.text
    clock.now += 5.0
    with pytest.raises(WorkerLost) as e:
        sup.check()
    err = e.value.error
    assert isinstance(err, WorkerHangError) and pool.procs[0].killed
    assert "DataLoader worker 0 (pid 1000) made no progress for 10 s on batch 5" in str(err)
    assert 'File "ds.py", line 7' in str(err)


def test_progress_restarts_the_watch_and_an_idle_worker_is_never_late(clock: Clock) -> None:
    pool = FakePool()
    sup = _sup(pool, hang_timeout=10.0)
    a, b = _batch(pool, 0, 0), _batch(pool, 0, 2)
    w0 = FakeWorker(pool.ring, 0)
    w0.join(1000)
    w0.take()
    sup.check()
    clock.now += 9.0
    w0.commit(a.slot)  # progress
    w0.take()
    sup.check()
    clock.now += 9.0
    sup.check()  # 9 s on batch 2: not yet
    w0.commit(b.slot)
    clock.now += 60.0
    sup.check()  # nothing in hand: not late however long


def test_how_often_the_workers_are_checked() -> None:
    pool = FakePool()
    assert _sup(pool, hang_timeout=10.0).check_every == 0.5
    assert _sup(pool, hang_timeout=None).check_every == math.inf
    pool.deaths_watched = False  # no pidfds: poll
    assert _sup(pool, hang_timeout=None).check_every == supervisor._POLL_S
