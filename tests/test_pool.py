"""The worker pool's decisions on their own: a spawn pool whose workers are
fakes (the launch the test gives it starts no process), its ring in this
process and each worker played by the test (``support/ring_driver.py``):
which workers start, what replacing, growing, shrinking and stopping do to
their processes, channels and queues, and what a session sends them.

Zygote pools (workers forked afresh for each session) start real zygotes
through :class:`fastload.launching.fork_server.Lineage`; ``test_zygote.py``
covers them with real processes."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from fastload import _core
from fastload.launching import parcels as crossing
from fastload.pool.ledger import Role
from fastload.pool.worker_pool import WorkerPool
from fastload.common.protocol import SessionTask, decode_task, recv_session_fds
from fastload.common.protocol import WorkerSpec
from support.processes import open_fds
from support.ring_driver import FakeWorker


class FakeProcess:
    """A started worker as the pool sees it (it quacks like
    ``multiprocessing.Process``), played by the test: it attaches to the
    ring as it starts, lives until it is killed or, as a worker's loop does,
    until the ring answers SHUTDOWN when it next looks (here: when joined)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.pid = os.getpid()  # a live process: its pidfd never fires
        self.exitcode: Optional[int] = None
        self.killed = False
        self.spec = spec
        self.sock = spec.sock.dup()  # the pool closes its copy of the worker's end
        self.worker: Optional[FakeWorker] = FakeWorker(spec.ring.get(), spec.worker_id, self.sock)
        self.worker.join()

    def die(self, code: int) -> None:
        """The worker exits on its own (a crash, say)."""
        if self.exitcode is None:
            self.exitcode = code
            self.sock.close()
            self.worker = None  # its side of the ring goes with it

    def kill(self) -> None:
        self.killed = True
        self.die(-9)

    def terminate(self) -> None:
        self.die(-15)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        if self.worker is not None and \
                self.worker.ring.next_task(0.0)[0] == _core.WaitResult.SHUTDOWN:
            self.die(0)


class Launches:
    """The launch a pool is given: it records each start, by worker id."""

    def __init__(self) -> None:
        self.started: List[FakeProcess] = []

    def __call__(self, i: int, spec: WorkerSpec) -> FakeProcess:
        assert spec.worker_id == i
        p = FakeProcess(spec)
        self.started.append(p)
        return p

    def ids(self) -> List[int]:
        return [p.spec.worker_id for p in self.started]


def _pool(launches: Launches, workers: int, capacity: Optional[int] = None) -> WorkerPool:
    return WorkerPool(ctx=multiprocessing.get_context("spawn"), num_workers=workers, num_slots=8,
                      slot_bytes=1 << 16, hide_accelerators=True, capacity=capacity,
                      launch=launches)


@contextlib.contextmanager
def _running(workers: int, capacity: Optional[int] = None) -> Iterator[Tuple[WorkerPool, Launches]]:
    """A spawn pool of ``workers`` fakes, shut down when the block ends."""
    launches = Launches()
    pool = _pool(launches, workers, capacity)
    try:
        yield pool, launches
    finally:
        pool.shutdown()


def test_a_spawn_pool_starts_its_workers_with_it_each_with_a_channel_and_stack_file() -> None:
    with _running(2) as (pool, launches):
        assert launches.ids() == [0, 1]
        assert all(p.spec.num_workers == 2 and p.spec.hide_accelerators for p in launches.started)
        assert pool.procs == launches.started and pool.pids == (os.getpid(), os.getpid())
        channels = pool.workers.channels
        assert len(channels) == 2 and channels[0] is not channels[1]
        assert len(set(pool.workers.stack_fds)) == 2 and pool.deaths_watched
        assert pool.dead_workers() == []


def test_a_session_sends_each_worker_the_parcel_then_queues_its_session_task() -> None:
    with _running(2) as (pool, launches):
        parcel = crossing.pack(("a dataset", 3), "session")
        records = [pool.ledger.assign(Role.SESSION, w, task)
                   for w, task in pool.session_tasks(parcel, base_seed=7)]
        assert [(r.role, r.worker) for r in records] == [(Role.SESSION, 0), (Role.SESSION, 1)]
        for p in launches.started:
            fds = recv_session_fds(p.sock)
            assert crossing.read_memfd(fds[0]) == parcel.data and len(fds) == 1
            assert p.worker is not None
            slot, _seq = p.worker.take()  # type: ignore[misc]
            mv = memoryview(p.worker.ring.payload_region())
            start = slot * pool.ring.slot_bytes
            task = decode_task(bytes(mv[start : start + p.worker.task_len]))
            del mv
            assert task == SessionTask(base_seed=7, inherited=False, resume=None, preloaded=None)
            p.worker.commit(slot)
        for _ in records:
            assert pool.ledger.wait(1.0) is not None
        assert not pool.ledger.busy()  # session records are freed as they complete
        assert pool.ring.free_slot_count() == pool.ring.num_slots


def test_replacing_a_dead_worker_starts_one_with_its_id_and_keeps_what_it_sent() -> None:
    with _running(2) as (pool, launches):
        dead = launches.started[0]
        assert dead.worker is not None
        dead.worker.send_segment(5, b"a batch it committed")
        old_channel = pool.workers.channels[0]
        dead.die(1)
        assert pool.dead_workers() == [(0, os.getpid(), 1)]
        pool.replace_worker(0)
        assert launches.ids() == [0, 1, 0] and not dead.killed
        assert pool.procs[0] is launches.started[2] and pool.dead_workers() == []
        assert old_channel.fileno() == -1 and pool.workers.channels[0] is not old_channel
        assert len(pool.overflow) == 1  # collected before its channel was closed
        m = pool.overflow.open(0, 5)
        assert bytes(m[:]) == b"a batch it committed"
        m.close()
        hung = launches.started[1]
        pool.replace_worker(1)  # alive (hung): killed first
        assert hung.killed and launches.ids() == [0, 1, 0, 1]


def test_growing_starts_the_next_ids_and_each_new_worker_is_told_the_count() -> None:
    with _running(1, capacity=3) as (pool, launches):
        assert pool.grow(3) == [1, 2]
        assert launches.ids() == [0, 1, 2] and pool.num_workers == 3
        assert [p.spec.num_workers for p in launches.started] == [1, 3, 3]
        with pytest.raises(ValueError, match="a pool for 3 workers cannot grow to 4"):
            pool.grow(4)
        assert pool.num_workers == 3 and len(pool.procs) == 3


def test_shrinking_retires_the_last_workers_through_the_ring_and_forgets_them(
        caplog: pytest.LogCaptureFixture) -> None:
    with _running(3) as (pool, launches):
        last = launches.started[2]
        assert last.worker is not None
        last.worker.send_segment(9)
        with caplog.at_level(logging.WARNING, logger="fastload"):
            pool.shrink(1)
        assert not caplog.records  # each saw SHUTDOWN and exited: none was killed
        assert [p.exitcode for p in launches.started] == [None, 0, 0]
        assert not any(p.killed for p in launches.started)
        assert len(pool.procs) == len(pool.workers.channels) == len(pool.workers.stack_fds) == 1
        assert pool.num_workers == 1 and len(pool.overflow) == 1


def test_shutting_down_stops_every_worker_and_closes_the_pool_s_fds() -> None:
    before = open_fds()
    launches = Launches()
    pool = _pool(launches, 2)
    assert launches.started[0].worker is not None
    launches.started[0].worker.send_segment(1)
    pool.overflow.collect(0)
    pool.shutdown()
    pool.shutdown()  # idempotent
    assert [p.exitcode for p in launches.started] == [0, 0]  # both saw the ring's shutdown
    del pool, launches
    gc.collect()
    left: Dict[str, str] = {}
    for fd in open_fds() - before:
        try:
            left[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    assert not left
