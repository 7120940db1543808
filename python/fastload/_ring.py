"""Handing the ring to a worker process by file descriptor.

Under spawn and forkserver the handle is pickled while the worker Process is
being started; its ``__reduce__`` wraps the fd in
``multiprocessing.reduction.DupFd``, which the start method passes to the
child (``spawnv_passfds`` / the forkserver's fd passing). The child then maps
the same memory (:meth:`fastload._core.Ring.attach`). Under fork the handle
is inherited as is, mapping included.
"""

from __future__ import annotations

from multiprocessing import reduction
from typing import Any, Callable, Tuple

from . import _core


class RingHandle:
    """Picklable reference to a ring, for worker processes."""

    def __init__(self, ring: "_core.Ring") -> None:
        self._ring = ring

    def get(self) -> "_core.Ring":
        return self._ring

    def __reduce__(self) -> Tuple[Callable[..., Any], tuple]:
        return _attach, (reduction.DupFd(self._ring.fd),)


def _attach(dup: Any) -> RingHandle:
    return RingHandle(_core.Ring.attach(dup.detach()))


class FdHandle:
    """Picklable reference to one file descriptor, for worker processes
    (passed the same way as the ring: DupFd while the Process starts)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Callable[..., Any], tuple]:
        return _fd_from_dup, (reduction.DupFd(self.fd),)


def _fd_from_dup(dup: Any) -> FdHandle:
    return FdHandle(dup.detach())
