"""Driving a ring from one process, for tests of the main side's parts with
no worker process: :class:`FakeWorker` attaches to the ring by its fd, as a
worker does, and takes and commits tasks when the test says so."""

from __future__ import annotations

import os
from typing import Optional, Tuple

from fastload import _core
from fastload.wire import Kind

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
