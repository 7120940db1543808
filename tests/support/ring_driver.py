"""Driving a ring from one process, for tests of the main side's parts with
no worker process: :class:`FakeWorker` attaches to the ring by its fd, as a
worker does, and takes and commits tasks when the test says so: a bare
result, or a batch or an error written into the slot as a worker writes
them."""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional, Tuple

from torch.utils.data._utils import ExceptionWrapper

from fastload import _core
from fastload.capture import trailer
from fastload.serialize import SlotWriter
from fastload.wire import Kind, Task, decode_task

SLOT_BYTES = 1 << 20


def new_ring(num_slots: int = 8, num_workers: int = 2) -> _core.Ring:
    return _core.Ring.create(num_slots, num_workers, SLOT_BYTES)


class FakeWorker:
    """Worker ``worker`` of ``ring``, played by the test: the ring's worker
    side (``_core.WorkerRing``), attached by fd as a worker attaches it."""

    def __init__(self, ring: _core.Ring, worker: int) -> None:
        self.ring = _core.WorkerRing.attach(os.dup(ring.fd))  # attach takes the fd it is given
        self.worker = worker
        self._joined = False
        self._writer: Optional[SlotWriter] = None

    def join(self, pid: Optional[int] = None) -> None:
        """Attach as a started worker does (its progress counts from now)."""
        self.ring.worker_started(self.worker, os.getpid() if pid is None else pid)
        self._joined = True

    def take(self) -> Optional[Tuple[int, int]]:
        """The next task's (slot, seq), or None if its queue is empty (joins
        first if the test did not)."""
        if not self._joined:
            self.join()
        status, slot, seq, _n = self.ring.next_task(0.0)
        return (slot, seq) if status == _core.WaitResult.READY else None

    def commit(self, slot: int, kind: int = Kind.DATA, data_len: int = 0, make_ns: int = 0) -> None:
        self.ring.commit(slot, kind, data_len, 0, 0, make_ns)

    def next_task(self) -> Optional[Tuple[int, int, Task]]:
        """The next task's (slot, seq, task as the worker decodes it), or None
        if its queue is empty (joins first if the test did not)."""
        if not self._joined:
            self.join()
        status, slot, seq, n = self.ring.next_task(0.0)
        if status != _core.WaitResult.READY:
            return None
        start = slot * self.ring.slot_bytes
        payload = memoryview(self.ring.payload_region()).cast("B")
        return slot, seq, decode_task(payload[start : start + n])

    def commit_batch(self, slot: int, batch: Any, snapshot: Any = None, make_ns: int = 0) -> None:
        """Write ``batch`` into ``slot`` as a worker does (its resume capture
        ``snapshot`` after it) and commit it; it must fit the slot."""
        if self._writer is None:
            self._writer = SlotWriter(self.ring.payload_region(), self.ring.slot_bytes)
        self._writer.begin(slot)
        data_len, meta_off, meta_len, overflow_fd, _ = self._writer.finish(batch, trailer(snapshot))
        assert overflow_fd is None, "a fake worker's batch must fit its slot"
        self.ring.commit(slot, Kind.DATA, data_len, meta_off, meta_len, make_ns)

    def commit_error(self, slot: int, error: ExceptionWrapper, snapshot: Any = None) -> None:
        """Commit ``error`` (what a worker caught making the batch) as the slot's result."""
        meta = pickle.dumps(error) + trailer(snapshot)
        start = slot * self.ring.slot_bytes
        memoryview(self.ring.payload_region()).cast("B")[start : start + len(meta)] = meta
        self.ring.commit(slot, Kind.ERROR, 0, 0, len(meta))
