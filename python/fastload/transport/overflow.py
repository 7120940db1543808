"""Overflow segments: the part of a batch that does not fit its slot.

A batch bigger than its slot leaves in the slot what fits and writes the
rest, with its meta, into an *overflow segment*: a memfd of its own
(:func:`write`, called by :meth:`fastload.transport.writer.SlotWriter.finish`).
The worker hands the segment's fd to the main process on its channel (the
socket the pool gave it; :func:`send`), closes its own copy, and only then
commits the batch with ``FLAG_OVERFLOW``. So once the main process sees
such a result, the fd is on that worker's channel, or already here.

:class:`OverflowSegments` is the main side: every segment fd received lives
in it until the batch's reader maps it (:meth:`~OverflowSegments.open`), the
ledger frees the batch unread (:meth:`~OverflowSegments.discard`), or the
pool stops (:meth:`~OverflowSegments.close`). A channel carries the fds in
commit order, not in the order the main process reads batches, so looking
for one batch's fd keeps those met on the way, by stamp. A channel is
emptied into it before the pool closes or replaces it
(:meth:`~OverflowSegments.collect`): a batch its worker committed before it
died or retired is still read whole, and a batch taken back from a dead
worker (made again under a new stamp) has its segment, if it was sent,
closed (:meth:`~OverflowSegments.forget`).
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["OverflowSegments", "write", "send"]

_MSG = struct.Struct("<Q")  # the stamp of the batch whose segment fd comes with it


def write(size: int, parts: Sequence[Tuple[int, Any]]) -> int:
    """Worker side: a new segment of ``size`` bytes holding ``parts``, each
    (offset, a tensor or a bytes-like object) copied in at its offset;
    returns its fd, which the caller sends (:func:`send`) and closes."""
    fd = os.memfd_create("fastload-overflow", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mm:
            u8 = torch.frombuffer(mm, dtype=torch.uint8)
            for off, item in parts:
                if isinstance(item, torch.Tensor):
                    n = item.numel() * item.element_size()
                    u8[off : off + n].view(item.dtype).view(item.shape).copy_(item)
                else:
                    n = memoryview(item).nbytes
                    mm[off : off + n] = item
            del u8
    except BaseException:
        os.close(fd)
        raise
    return fd


def send(sock: socket.socket, seq: int, fd: int) -> None:
    """Worker side: hand the main process the segment ``fd`` of batch
    ``seq``, before committing the batch."""
    socket.send_fds(sock, [_MSG.pack(seq)], [fd])


def _recv(sock: socket.socket) -> Tuple[Optional[int], Optional[int]]:
    """The next (seq, fd) on a worker's channel; (None, None) when the
    channel is closed."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, _MSG.size, 1)
    if not fds:
        return None, None
    return _MSG.unpack(msg)[0], fds[0]


class OverflowSegments:
    """Main side: the overflow segment fds of one pool's workers, by batch stamp.

    ``channels`` is the pool's list of its workers' sockets (one per worker
    id), read at each call: the pool replaces a worker's channel in place,
    after :meth:`collect`. Stamps never repeat within a pool, so a segment
    is never taken for another batch's.
    """

    def __init__(self, channels: List[socket.socket]) -> None:
        self._channels = channels
        self._early: Dict[int, int] = {}  # seq -> fd, received before its batch was read

    def __len__(self) -> int:
        """Segments held: received, and not yet mapped, discarded or closed."""
        return len(self._early)

    def open(self, worker: int, seq: int) -> mmap.mmap:
        """The reader: map batch ``seq``'s segment, which ``worker`` sent
        (its result has ``FLAG_OVERFLOW``). The fd is closed; the mapping
        keeps the memory for as long as the batch's tensors view it."""
        fd = self._take(worker, seq)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def discard(self, worker: int, seq: int) -> None:
        """The ledger: batch ``seq`` (``FLAG_OVERFLOW``) is freed unread;
        close its segment."""
        os.close(self._take(worker, seq))

    def forget(self, seq: int) -> None:
        """The ledger: batch ``seq`` was taken back from a dead worker, to be
        made again under a new stamp; close its segment if the worker sent
        one before dying (its channel was collected first)."""
        fd = self._early.pop(seq, None)
        if fd is not None:
            os.close(fd)

    def collect(self, worker: int) -> None:
        """The pool, before it closes or replaces ``worker``'s channel (the
        worker is gone, or retired): keep every segment the channel still
        holds. Never blocks."""
        sock = self._channels[worker]
        # Non-blocking for the look (socket.recv_fds ignores its flags).
        sock.setblocking(False)
        try:
            while True:
                seq, fd = _recv(sock)
                if fd is None:
                    return
                self._early[seq] = fd  # type: ignore[index]
        except (BlockingIOError, InterruptedError):
            pass
        except ConnectionResetError:
            pass  # it died with our session message unread: nothing of its to keep
        finally:
            sock.setblocking(True)

    def close(self) -> None:
        """The pool is stopping: close every segment held. Safe at
        interpreter exit, and in a forked child (its copies of the fds)."""
        fds = list(self._early.values())
        self._early.clear()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass

    def _take(self, worker: int, seq: int) -> int:
        """Batch ``seq``'s fd, the caller's to close: received already, or
        read from ``worker``'s channel, keeping the others met on the way.
        Blocks only until the fd comes, which the worker sent before it
        committed the batch."""
        fd = self._early.pop(seq, None)
        while fd is None:
            got, got_fd = _recv(self._channels[worker])
            if got_fd is None:
                raise RuntimeError(f"fastload: worker {worker} closed its channel before sending "
                                   f"the overflow data of batch {seq}")
            if got == seq:
                fd = got_fd
            else:
                self._early[got] = got_fd  # type: ignore[index]
        return fd
