"""The C++ ring through its bindings, in one process: states, leases, backends,
and the two sides (the main process's Ring, a worker's WorkerRing)."""

from __future__ import annotations

import gc
import os
import pickle
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from fastload import _core
from fastload._core import CommitResult, Ring, SlotState, WaitResult, WorkerRing
from fastload.common.ring_handles import RingHandle


def _worker_side(ring: Ring, worker: int = 0) -> WorkerRing:
    """Worker ``worker``'s side of ``ring``, mapped again from its fd as a
    worker process maps it, and started."""
    side = WorkerRing.attach(os.dup(ring.fd))
    side.worker_started(worker, os.getpid())
    return side


def _roundtrip(ring: Ring, worker: int = 0) -> int:
    side = _worker_side(ring, worker)
    slot = ring.pop_free_slot()
    assert slot is not None
    ring.assign(slot, 5, worker, b"task")
    assert ring.state(slot) == SlotState.ASSIGNED
    st, got, seq, n = side.next_task(0.1)
    assert (st, got, seq, n) == (WaitResult.READY, slot, 5, 4)
    assert ring.state(slot) == SlotState.WRITING
    region = ring.payload_region()
    mv = memoryview(region)
    start = slot * ring.slot_bytes
    assert bytes(mv[start : start + 4]) == b"task"
    mv[start : start + 3] = b"abc"
    del mv
    side.commit(slot, 0, 3, 0, 0, 1234)
    assert ring.wait_ready(slot, 5, 0.1) == WaitResult.READY
    assert ring.result(slot) == (0, 3, 0, 0, 1234)  # make_ns comes back as given
    return slot


def test_slot_cycle_and_lease_frees_on_last_view() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    assert ring.backend == "memfd"
    slot = _roundtrip(ring)
    lease = ring.lease(slot, 3)
    t = torch.frombuffer(lease, dtype=torch.uint8)
    view = t[1:]
    del lease, t
    gc.collect()
    assert ring.state(slot) == SlotState.LEASED  # a view is still alive
    assert bytes(view.numpy()) == b"bc"
    del view
    gc.collect()
    assert ring.state(slot) == SlotState.FREE
    assert ring.free_slot_count() == 2


def test_free_slots_lowest_first_sessions_highest() -> None:
    """Batches take the lowest free slot, whatever the order slots were freed
    in; tasks that write no batch take the highest."""
    ring = Ring.create(6, 1, 1 << 16)
    assert [ring.pop_free_slot() for _ in range(3)] == [0, 1, 2]
    assert ring.pop_free_slot(highest=True) == 5
    for s in (2, 0, 1):
        ring.push_free_slot(s)
    assert ring.pop_free_slot() == 0
    assert ring.pop_free_slot(highest=True) == 4
    assert [ring.pop_free_slot() for _ in range(3)] == [1, 2, 3]
    assert ring.pop_free_slot() is None
    assert ring.pop_free_slot(highest=True) is None


def test_stale_stamp_never_looks_ready() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    slot = _roundtrip(ring)
    assert not ring.is_ready(slot, 4)
    assert ring.wait_ready(slot, 6, 0.05) == WaitResult.TIMED_OUT
    ring.release(slot)


def test_waits_time_out_and_see_shutdown() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    worker = _worker_side(ring)
    st, *_ = worker.next_task(0.05)
    assert st == WaitResult.TIMED_OUT
    ring.shutdown()
    st, *_ = worker.next_task(5.0)
    assert st == WaitResult.SHUTDOWN


def test_bad_geometry_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        Ring.create(0, 1, 4096)
    with pytest.raises(ValueError, match="num_slots"):
        Ring.create(_core.MAX_SLOTS + 1, 1, 4096)
    with pytest.raises(ValueError, match="num_workers"):
        Ring.create(1, 0, 4096)


def test_attach_checks_magic() -> None:
    fd = os.memfd_create("not-a-ring")
    os.ftruncate(fd, 1 << 16)
    with pytest.raises(RuntimeError, match="magic"):
        WorkerRing.attach(fd)  # takes ownership of fd and closes it


def test_late_commit_after_reclaim_is_refused() -> None:
    """A worker believed dead commits after main reclaimed its slot and gave
    it to another task: the commit is refused and the new task untouched."""
    ring = Ring.create(2, 1, 1 << 16)
    worker = _worker_side(ring)
    slot = ring.pop_free_slot()
    ring.assign(slot, 1, 0, b"old")
    assert worker.next_task(1.0)[:3] == (WaitResult.READY, slot, 1)
    assert ring.reclaim(slot) is True
    assert ring.state(slot) == SlotState.FREE
    assert ring.reclaim(slot) is False
    ring.assign(slot, 2, 0, b"new")  # reassigned at once, as loader._restart does
    assert worker.commit(slot, 7, 0, 0, 0) == CommitResult.RECLAIMED
    assert ring.state(slot) == SlotState.ASSIGNED
    assert not ring.is_ready(slot, 1) and not ring.is_ready(slot, 2)
    assert worker.next_task(1.0)[:3] == (WaitResult.READY, slot, 2)
    assert worker.commit(slot, 8, 0, 0, 0) == CommitResult.COMMITTED
    assert ring.wait_ready(slot, 2, 1.0) == WaitResult.READY
    assert ring.result(slot)[0] == 8
    with pytest.raises(RuntimeError, match="did not take"):
        worker.commit(slot, 9, 0, 0, 0)  # a second commit is a bug, not a race


def test_reset_worker_retires_a_worker_still_running() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    old = _worker_side(ring)
    result = []
    sleeper = threading.Thread(target=lambda: result.append(old.next_task(60.0)[0]))
    sleeper.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    ring.reset_worker(0)
    sleeper.join(10.0)
    assert result == [WaitResult.SHUTDOWN] and time.monotonic() - t0 < 5.0
    assert not ring.is_shutdown()
    new = _worker_side(ring)
    slot = ring.pop_free_slot()
    ring.assign(slot, 3, 0, b"x")
    assert old.next_task(0.0)[0] == WaitResult.SHUTDOWN
    assert new.next_task(1.0)[:3] == (WaitResult.READY, slot, 3)


def test_push_free_slot_refuses_a_double_free() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    slot = ring.pop_free_slot()
    ring.push_free_slot(slot)
    with pytest.raises(RuntimeError, match="already free"):
        ring.push_free_slot(slot)
    assert ring.free_slot_count() == 2


def test_timeouts_accept_infinity_and_huge_values() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    worker = _worker_side(ring)
    slot = ring.pop_free_slot()
    threading.Timer(0.05, lambda: ring.assign(slot, 4, 0, b"t")).start()
    assert worker.next_task(float("inf"))[:2] == (WaitResult.READY, slot)
    threading.Timer(0.05, lambda: worker.commit(slot, 0, 0, 0, 0)).start()
    assert ring.wait_ready(slot, 4, 1e300) == WaitResult.READY
    assert ring.wait_any([slot], [5], -1.0) == (WaitResult.TIMED_OUT, -1)
    assert ring.wait_ready(slot, 5, -float("inf")) == WaitResult.TIMED_OUT
    with pytest.raises(ValueError, match="nan"):
        ring.wait_ready(slot, 4, float("nan"))


# (offset, struct format, value, message) of header fields to corrupt.
_HEADER_DAMAGE = [
    (8, "<I", 1, "version 1"),
    (16, "<I", 0, "num_slots 0"),
    (16, "<I", _core.MAX_SLOTS + 1, f"num_slots {_core.MAX_SLOTS + 1}"),
    (20, "<I", 0, "num_workers 0"),
    (24, "<Q", 4095, "slot_bytes 4095"),
    (32, "<Q", 1 << 20, "says 1048576 bytes"),
    (56, "<Q", 0, "offsets"),
]


@pytest.mark.parametrize("offset,fmt,value,message", _HEADER_DAMAGE)
def test_attach_validates_the_whole_header(offset: int, fmt: str, value: int, message: str) -> None:
    ring = Ring.create(2, 1, 1 << 16)
    size = os.fstat(ring.fd).st_size
    image = bytearray(os.pread(ring.fd, size, 0))
    struct.pack_into(fmt, image, offset, value)
    fd = os.memfd_create("damaged-ring")
    os.write(fd, image)
    with pytest.raises(RuntimeError, match=message):
        WorkerRing.attach(fd)


def test_attach_checks_the_segment_size() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    size = os.fstat(ring.fd).st_size
    fd = os.memfd_create("grown-ring")
    os.write(fd, os.pread(ring.fd, size, 0))
    os.ftruncate(fd, size + 4096)
    with pytest.raises(RuntimeError, match="segment has"):
        WorkerRing.attach(fd)


def test_attach_maps_the_same_memory() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    other = _worker_side(ring)
    assert (other.num_slots, other.num_workers, other.slot_bytes) == (1, 1, ring.slot_bytes)
    slot = ring.pop_free_slot()
    ring.assign(slot, 9, 0, b"xyz")
    st, got, seq, n = other.next_task(1.0)
    assert (st, got, seq, n) == (WaitResult.READY, slot, 9, 3)
    assert other.state(slot) == SlotState.WRITING and other.lap(slot) == ring.lap(slot) == 1
    other.commit(slot, 2, 0, 0, 0)
    assert ring.wait_ready(slot, 9, 1.0) == WaitResult.READY
    assert ring.result(slot)[0] == 2


# What only the main process does, and what only a worker does: each is
# missing from the other side's type, so a call from the wrong side fails
# where it is written, not deep in the ring.
_MAIN_ONLY = ["create", "fd", "backend", "close_fd", "pop_free_slot", "free_slot_count",
              "trim_free_slot", "push_free_slot", "assign", "wait_ready", "wait_any",
              "watch_worker", "unwatch_worker", "dead_workers", "rescan_count", "is_ready",
              "result", "lease", "release", "shutdown", "is_shutdown", "reset_worker", "reclaim",
              "worker_pid", "worker_progress", "worker_current_seq"]
_WORKER_ONLY = ["attach", "worker_started", "next_task", "commit"]
_BOTH = ["num_slots", "num_workers", "slot_bytes", "state", "lap", "payload_region"]


@pytest.mark.parametrize("name", _MAIN_ONLY)
def test_main_only_calls_are_not_on_the_worker_side(name: str) -> None:
    worker = _worker_side(Ring.create(1, 1, 1 << 16))
    assert hasattr(Ring, name)
    with pytest.raises(AttributeError):
        getattr(worker, name)


@pytest.mark.parametrize("name", _WORKER_ONLY)
def test_worker_only_calls_are_not_on_the_main_side(name: str) -> None:
    ring = Ring.create(1, 1, 1 << 16)
    assert hasattr(WorkerRing, name)
    with pytest.raises(AttributeError):
        getattr(ring, name)


@pytest.mark.parametrize("name", _BOTH)
def test_both_sides_read_the_segment(name: str) -> None:
    assert hasattr(Ring, name) and hasattr(WorkerRing, name)


def test_a_worker_side_is_not_made_from_python() -> None:
    with pytest.raises(TypeError):
        WorkerRing()


def test_a_worker_side_serves_one_worker_once_started() -> None:
    ring = Ring.create(2, 2, 1 << 16)
    worker = WorkerRing.attach(os.dup(ring.fd))
    with pytest.raises(RuntimeError, match="before worker_started"):
        worker.next_task(0.0)
    with pytest.raises(IndexError, match="worker 2 out of range"):
        worker.worker_started(2, os.getpid())
    worker.worker_started(1, os.getpid())
    assert ring.worker_pid(1) == os.getpid() and ring.worker_pid(0) == 0
    with pytest.raises(RuntimeError, match="twice"):
        worker.worker_started(0, os.getpid())
    slot = ring.pop_free_slot()
    ring.assign(slot, 1, 0, b"for worker 0")
    assert worker.next_task(0.0)[0] == WaitResult.TIMED_OUT  # worker 0's queue is not ours
    ring.reclaim(slot)
    ring.assign(slot, 2, 1, b"for worker 1")
    assert worker.next_task(0.0)[:3] == (WaitResult.READY, slot, 2)
    assert ring.worker_current_seq(1) == 2


def test_ring_handle_gives_a_forked_worker_its_side() -> None:
    """A RingHandle inherited through fork holds the main side; the worker
    gets its own side from it, over the same memory. (Pickled to a worker,
    the handle maps the ring as it is unpickled: every spawn and zygote
    worker of the suite goes that way.)"""
    ring = Ring.create(2, 1, 1 << 16)
    side = RingHandle(ring).get()
    assert isinstance(side, WorkerRing)
    side.worker_started(0, os.getpid())
    slot = ring.pop_free_slot()
    ring.assign(slot, 7, 0, b"task")
    assert side.next_task(1.0)[:3] == (WaitResult.READY, slot, 7)
    assert RingHandle(side).get() is side
    with pytest.raises(TypeError, match="only the main process"):
        pickle.dumps(RingHandle(side))
