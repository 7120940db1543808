"""Driving a ring from one process, for tests of the main side's parts with
no worker process: :class:`FakeWorker` attaches to the ring by its fd, as a
worker does, and takes and commits tasks when the test says so: a bare
result, or a batch or an error written into the slot as a worker writes
them; on :class:`Channels`, workers send overflow segments as workers do."""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any, List, Optional, Tuple, Union

from torch.utils.data._utils import ExceptionWrapper

from fastload import _core
from fastload.transport import overflow
from fastload.transport.format import trailer
from fastload.transport.overflow import OverflowSegments
from fastload.transport.writer import SlotWriter
from fastload.common.protocol import Kind, Task, decode_task

SLOT_BYTES = 1 << 20


def new_ring(num_slots: int = 8, num_workers: int = 2) -> _core.Ring:
    return _core.Ring.create(num_slots, num_workers, SLOT_BYTES)


def segment(data: bytes) -> int:
    """An overflow segment holding ``data``: a memfd, as the writer makes one."""
    fd = os.memfd_create("fastload-test-overflow", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class Channels:
    """``n`` workers' channels as a pool makes them, one socketpair per
    worker id (``mine``: the main side's ends, ``theirs``: the workers'),
    and the overflow segments received on them."""

    def __init__(self, n: int) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
        self.mine: List[socket.socket] = [p[0] for p in pairs]
        self.theirs: List[socket.socket] = [p[1] for p in pairs]
        self.segments = OverflowSegments(self.mine)

    def send(self, worker: int, seq: int, data: bytes = b"overflow") -> None:
        """Worker ``worker`` sends batch ``seq``'s segment, as a worker does
        before it commits the batch, and closes its own fd."""
        fd = segment(data)
        try:
            overflow.send(self.theirs[worker], seq, fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.segments.close()
        for s in self.mine + self.theirs:
            s.close()


class FakeWorker:
    """Worker ``worker`` of ``ring``, played by the test: the ring's worker
    side (``_core.WorkerRing``: given, or attached by fd as a worker
    attaches it), and ``sock``, its end of its channel, if the test gave it
    one."""

    def __init__(self, ring: Union[_core.Ring, _core.WorkerRing], worker: int,
                 sock: Optional[socket.socket] = None) -> None:
        if not isinstance(ring, _core.WorkerRing):  # a main-side ring, or a test's wrapper of one
            ring = _core.WorkerRing.attach(os.dup(ring.fd))  # attach takes the fd it is given
        self.ring = ring
        self.worker = worker
        self.sock = sock
        self.task_len = 0  # the length of the task last taken
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
        status, slot, seq, self.task_len = self.ring.next_task(0.0)
        return (slot, seq) if status == _core.WaitResult.READY else None

    def send_segment(self, seq: int, data: bytes = b"overflow") -> None:
        """Send batch ``seq``'s overflow segment, as a worker does before it
        commits the batch, and close this side's fd."""
        assert self.sock is not None, "a FakeWorker made without a channel"
        fd = segment(data)
        try:
            overflow.send(self.sock, seq, fd)
        finally:
            os.close(fd)

    def commit(self, slot: int, kind: int = Kind.DATA, data_len: int = 0, make_ns: int = 0,
               meta_off: int = 0, meta_len: int = 0) -> None:
        self.ring.commit(slot, kind, data_len, meta_off, meta_len, make_ns)

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

    def commit_batch(self, slot: int, batch: Any, capture: Any = None, make_ns: int = 0) -> None:
        """Write ``batch`` into ``slot`` as a worker does (its resume capture
        ``capture`` after it) and commit it; it must fit the slot."""
        if self._writer is None:
            self._writer = SlotWriter(self.ring.payload_region(), self.ring.slot_bytes)
        self._writer.begin(slot)
        data_len, meta_off, meta_len, overflow_fd, _ = self._writer.finish(batch, trailer(capture))
        assert overflow_fd is None, "a fake worker's batch must fit its slot"
        self.ring.commit(slot, Kind.DATA, data_len, meta_off, meta_len, make_ns)

    def commit_error(self, slot: int, error: ExceptionWrapper, capture: Any = None) -> None:
        """Commit ``error`` (what a worker caught making the batch) as the slot's result."""
        meta = pickle.dumps(error) + trailer(capture)
        start = slot * self.ring.slot_bytes
        memoryview(self.ring.payload_region()).cast("B")[start : start + len(meta)] = meta
        self.ring.commit(slot, Kind.ERROR, 0, 0, len(meta))
