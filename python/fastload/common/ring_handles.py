"""Handing the ring to a worker process by file descriptor.

The main process holds the ring's main side (:class:`fastload._core.Ring`);
a worker gets its own side, a :class:`fastload._core.WorkerRing` over the
same memory, from :meth:`RingHandle.get`. Under spawn and forkserver the
handle is pickled while the worker Process is being started; its
``__reduce__`` wraps the fd in ``multiprocessing.reduction.DupFd``, which the
start method passes to the child (``spawnv_passfds`` / the forkserver's fd
passing), and the child maps the ring while it unpickles the handle
(:meth:`fastload._core.WorkerRing.attach`). Under fork the handle is
inherited as is, the main side in it; :meth:`RingHandle.get` then maps the
ring again from a duplicate of its fd.
"""

from __future__ import annotations

import os
from multiprocessing import reduction
from typing import Any, Callable, Tuple, Union

from .. import _core


class RingHandle:
    """Picklable reference to a ring, for worker processes."""

    def __init__(self, ring: Union["_core.Ring", "_core.WorkerRing"]) -> None:
        # The main side where the handle was made (or inherited through
        # fork); the worker side where it was unpickled.
        self._ring = ring

    def get(self) -> "_core.WorkerRing":
        """The worker's side of the ring (called in the worker)."""
        ring = self._ring
        if isinstance(ring, _core.WorkerRing):
            return ring
        return _core.WorkerRing.attach(os.dup(ring.fd))

    def __reduce__(self) -> Tuple[Callable[..., Any], tuple]:
        ring = self._ring
        if not isinstance(ring, _core.Ring):
            raise TypeError("fastload: only the main process hands its ring to workers")
        return _attach, (reduction.DupFd(ring.fd),)


def _attach(dup: Any) -> RingHandle:
    return RingHandle(_core.WorkerRing.attach(dup.detach()))


class FdHandle:
    """Picklable reference to one file descriptor, for worker processes
    (passed the same way as the ring: DupFd while the Process starts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Callable[..., Any], tuple]:
        return _fd_from_dup, (reduction.DupFd(self.fd),)


def _fd_from_dup(dup: Any) -> FdHandle:
    return FdHandle(dup.detach())
