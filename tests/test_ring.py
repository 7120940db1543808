"""The C++ ring through its bindings, in one process: states, leases, backends."""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from fastload import _core
from fastload._core import CommitResult, Ring, SlotState, WaitResult


def _roundtrip(ring: Ring, worker: int = 0) -> int:
    slot = ring.pop_free_slot()
    assert slot is not None
    ring.assign(slot, 5, worker, b"task")
    assert ring.state(slot) == SlotState.ASSIGNED
    st, got, seq, n = ring.next_task(worker, 0.1)
    assert (st, got, seq, n) == (WaitResult.READY, slot, 5, 4)
    assert ring.state(slot) == SlotState.WRITING
    region = ring.payload_region()
    mv = memoryview(region)
    start = slot * ring.slot_bytes
    assert bytes(mv[start : start + 4]) == b"task"
    mv[start : start + 3] = b"abc"
    del mv
    ring.commit(slot, 0, 3, 0, 0, 1234)
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
    st, *_ = ring.next_task(0, 0.05)
    assert st == WaitResult.TIMED_OUT
    ring.shutdown()
    st, *_ = ring.next_task(0, 5.0)
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
        Ring.attach(fd)  # takes ownership of fd and closes it


def test_late_commit_after_reclaim_is_refused() -> None:
    """A worker believed dead commits after main reclaimed its slot and gave
    it to another task: the commit is refused and the new task untouched."""
    ring = Ring.create(2, 1, 1 << 16)
    worker = Ring.attach(os.dup(ring.fd))
    slot = ring.pop_free_slot()
    ring.assign(slot, 1, 0, b"old")
    assert worker.next_task(0, 1.0)[:3] == (WaitResult.READY, slot, 1)
    assert ring.reclaim(slot) is True
    assert ring.state(slot) == SlotState.FREE
    assert ring.reclaim(slot) is False
    ring.assign(slot, 2, 0, b"new")  # reassigned at once, as loader._restart does
    assert worker.commit(slot, 7, 0, 0, 0) == CommitResult.RECLAIMED
    assert ring.state(slot) == SlotState.ASSIGNED
    assert not ring.is_ready(slot, 1) and not ring.is_ready(slot, 2)
    assert worker.next_task(0, 1.0)[:3] == (WaitResult.READY, slot, 2)
    assert worker.commit(slot, 8, 0, 0, 0) == CommitResult.COMMITTED
    assert ring.wait_ready(slot, 2, 1.0) == WaitResult.READY
    assert ring.result(slot)[0] == 8
    with pytest.raises(RuntimeError, match="did not take"):
        worker.commit(slot, 9, 0, 0, 0)  # a second commit is a bug, not a race


def test_reset_worker_retires_a_worker_still_running() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    old = Ring.attach(os.dup(ring.fd))
    old.worker_started(0, os.getpid())
    result = []
    sleeper = threading.Thread(target=lambda: result.append(old.next_task(0, 60.0)[0]))
    sleeper.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    ring.reset_worker(0)
    sleeper.join(10.0)
    assert result == [WaitResult.SHUTDOWN] and time.monotonic() - t0 < 5.0
    assert not ring.is_shutdown()
    new = Ring.attach(os.dup(ring.fd))
    new.worker_started(0, os.getpid())
    slot = ring.pop_free_slot()
    ring.assign(slot, 3, 0, b"x")
    assert old.next_task(0, 0.0)[0] == WaitResult.SHUTDOWN
    assert new.next_task(0, 1.0)[:3] == (WaitResult.READY, slot, 3)


def test_push_free_slot_refuses_a_double_free() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    slot = ring.pop_free_slot()
    ring.push_free_slot(slot)
    with pytest.raises(RuntimeError, match="already free"):
        ring.push_free_slot(slot)
    assert ring.free_slot_count() == 2


def test_timeouts_accept_infinity_and_huge_values() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    slot = ring.pop_free_slot()
    threading.Timer(0.05, lambda: ring.assign(slot, 4, 0, b"t")).start()
    assert ring.next_task(0, float("inf"))[:2] == (WaitResult.READY, slot)
    threading.Timer(0.05, lambda: ring.commit(slot, 0, 0, 0, 0)).start()
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
        Ring.attach(fd)


def test_attach_checks_the_segment_size() -> None:
    ring = Ring.create(2, 1, 1 << 16)
    size = os.fstat(ring.fd).st_size
    fd = os.memfd_create("grown-ring")
    os.write(fd, os.pread(ring.fd, size, 0))
    os.ftruncate(fd, size + 4096)
    with pytest.raises(RuntimeError, match="segment has"):
        Ring.attach(fd)


def test_attach_maps_the_same_memory() -> None:
    ring = Ring.create(1, 1, 1 << 16)
    other = Ring.attach(os.dup(ring.fd))
    slot = ring.pop_free_slot()
    ring.assign(slot, 9, 0, b"xyz")
    st, got, seq, n = other.next_task(0, 1.0)
    assert (st, got, seq, n) == (WaitResult.READY, slot, 9, 3)
    other.commit(slot, 2, 0, 0, 0)
    assert ring.wait_ready(slot, 9, 1.0) == WaitResult.READY
    assert ring.result(slot)[0] == 2


def _fastload_shm_entries() -> set:
    # fastload's own names only: other processes on the machine (a test run
    # beside this one, its multiprocessing semaphores) come and go in /dev/shm.
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"fastload-{os.getpid()}-")}


def test_posix_shm_fallback_leaves_nothing_in_dev_shm() -> None:
    before = _fastload_shm_entries()
    ring = Ring.create(2, 1, 1 << 16, force_shm=True)
    assert ring.backend == "posix_shm"
    assert _fastload_shm_entries() == before  # unlinked at creation
    _roundtrip(ring)


def _can_mount_small_shm() -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _can_mount_small_shm(), reason="needs root and unshare -m to mount a small /dev/shm")
def test_full_dev_shm_is_an_exception_not_a_sigbus() -> None:
    code = (
        "from fastload._core import Ring\n"
        "try:\n"
        "    Ring.create(4, 1, 32 << 20, force_shm=True)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
        "r = Ring.create(4, 1, 32 << 20)\n"  # memfd: not limited by the mount
        "print('MEMFD', r.backend)\n"
    )
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {sys.executable} -c \"$0\"", code],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "ERR fastload: cannot reserve 128.0 MiB in /dev/shm" in r.stdout
    assert "--shm-size" in r.stdout
    assert "MEMFD memfd" in r.stdout
