"""Driving a ring from one process, for tests of the main side's parts with
no worker process: :class:`FakeWorker` attaches to the ring by its fd, as a
worker does, and takes and commits tasks when the test says so; with a
channel (:func:`channels`), it sends overflow segments as a worker does."""

from __future__ import annotations

import os
import socket
from typing import List, Optional, Tuple, Union

from fastload import _core
from fastload.transport import overflow
from fastload.wire import Kind

SLOT_BYTES = 1 << 20


def new_ring(num_slots: int = 8, num_workers: int = 2) -> _core.Ring:
    return _core.Ring.create(num_slots, num_workers, SLOT_BYTES)


def channels(n: int) -> Tuple[List[socket.socket], List[socket.socket]]:
    """``n`` worker channels as a pool makes them: (the main side's ends, the
    workers' ends), one socketpair per worker id."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def segment(data: bytes) -> int:
    """An overflow segment holding ``data``: a memfd, as the writer makes one."""
    fd = os.memfd_create("fastload-test-overflow", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


class FakeWorker:
    """Worker ``worker`` of ``ring``, played by the test: the ring's worker
    side (``_core.WorkerRing``: given, or attached by fd as a worker
    attaches it), and ``sock``, its end of its channel, if the test gave it
    one."""

    def __init__(self, ring: Union[_core.Ring, _core.WorkerRing], worker: int,
                 sock: Optional[socket.socket] = None) -> None:
        if isinstance(ring, _core.Ring):
            ring = _core.WorkerRing.attach(os.dup(ring.fd))  # attach takes the fd it is given
        self.ring = ring
        self.worker = worker
        self.sock = sock
        self.task_len = 0  # the length of the task last taken
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
