"""The main process's handles on a pool's worker processes.

Per worker id, :class:`WorkerHandles` keeps the worker's process, its
*channel* (this side of a socketpair: a session's fds go out on it,
overflow segments come back, :mod:`fastload.transport.overflow`) and the
memfd it dumps its Python stack into when asked. It starts a worker with
the launch the pool gives it, has the worker's death wake the ring's waits
(its pidfd), and replaces or forgets a worker's handles, emptying its
channel into the overflow segments first: a channel is never closed with a
segment unread. It decides nothing: when workers are started, replaced,
retired and stopped is :class:`fastload.pool.worker_pool.WorkerPool`'s to say.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from typing import Any, Callable, List, Optional, Tuple

from .. import _core
from ..common.ring_handles import FdHandle, RingHandle
from .exits import dump_stack, exited_unseen
from ..launching.child import Child
from ..transport.overflow import OverflowSegments
from ..common.protocol import WorkerSpec

log = logging.getLogger("fastload")

Process = multiprocessing.process.BaseProcess
# Starts worker ``i`` from its spec; returns a handle that quacks like
# ``multiprocessing.Process`` (a :class:`~fastload.launching.child.Child`).
Launch = Callable[[int, WorkerSpec], Process]


class WorkerHandles:
    """The processes, channels and stack files of one ring's workers.

    ``hide_accelerators`` and ``inherited`` (the session objects, for
    workers forked from this process) go into every worker's spec.
    """

    def __init__(self, ring: _core.Ring, hide_accelerators: bool,
                 inherited: Optional[tuple] = None) -> None:
        self._ring = ring
        self._handle = RingHandle(ring)
        self._hide = hide_accelerators
        self._inherited = inherited
        self.procs: List[Process] = []
        self.channels: List[socket.socket] = []
        self.stack_fds: List[int] = []  # one memfd per worker for its stack dump
        # The overflow segments the workers send on their channels.
        self.overflow = OverflowSegments(self.channels)
        # Whether every worker's death wakes the ring's waits (pidfds); if
        # not, the iterator checks liveness between short waits.
        self.deaths_watched = True

    def start(self, i: int, num_workers: int, launch: Launch) -> None:
        """Start worker ``i`` of ``num_workers`` with ``launch``: a new one,
        or the replacement of one that is gone (its handles are dropped)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stack_fd = os.memfd_create(f"fastload-stack-{i}", os.MFD_CLOEXEC)
        if i < len(self.procs):
            self.overflow.collect(i)
            self.channels[i].close()
            os.close(self.stack_fds[i])
            self.channels[i], self.stack_fds[i] = mine, stack_fd
        else:
            self.channels.append(mine)
            self.stack_fds.append(stack_fd)
        spec = WorkerSpec(
            ring=self._handle,
            sock=theirs,
            worker_id=i,
            num_workers=num_workers,
            parent_pid=os.getpid(),
            hide_accelerators=self._hide,
            stack_file=FdHandle(stack_fd),
            session=self._inherited,
        )
        try:
            p = launch(i, spec)
        finally:
            theirs.close()
        if i < len(self.procs):
            self.procs[i] = p
        else:
            self.procs.append(p)
        self._watch(i)

    def _watch(self, i: int) -> None:
        """Have worker ``i``'s death wake the main process's waits on the
        ring (they answer WORKER_DIED): its pidfd, handed to the ring's
        death watch (which keeps a duplicate). Where no pidfd can be had,
        :attr:`deaths_watched` turns False and the iterator polls instead."""
        p = self.procs[i]
        fd = p.pidfd if isinstance(p, Child) else None
        owned: Optional[int] = None
        if fd is None:
            try:
                fd = owned = os.pidfd_open(p.pid)  # type: ignore[arg-type]
            except ProcessLookupError:
                # Gone and reaped already: a pipe with no writer reads as
                # ready at once, so the death is reported like any other.
                owned, w = os.pipe()
                os.close(w)
                fd = owned
            except OSError as e:  # no pidfd_open (kernel < 5.3)
                log.debug("fastload: cannot watch worker %d through a pidfd (%s); "
                          "polling its liveness instead", i, e)
                self.deaths_watched = False
                return
        try:
            self._ring.watch_worker(i, fd)
        except RuntimeError as e:  # out of fds, or no thread to be had
            log.warning("fastload: cannot watch worker %d (%s); polling its liveness instead", i, e)
            self.deaths_watched = False
        finally:
            if owned is not None:
                os.close(owned)

    def kill_all(self) -> None:
        """SIGKILL every live worker, its death unwatched (it is on purpose)."""
        for w, p in enumerate(self.procs):
            self._ring.unwatch_worker(w)
            if p.pid is not None and p.exitcode is None:
                p.kill()

    def forget_past(self, n: int) -> None:
        """Drop the handles of workers ``n`` and up (exited, or retired and
        waited for): their process objects, channels (emptied first) and
        stack files."""
        del self.procs[n:]
        while len(self.channels) > n:
            self.overflow.collect(len(self.channels) - 1)
            self.channels.pop().close()
        while len(self.stack_fds) > n:
            os.close(self.stack_fds.pop())

    @property
    def pids(self) -> Tuple[int, ...]:
        return tuple(p.pid for p in self.procs)  # type: ignore[misc]

    def death_note(self, worker: int) -> str:
        """What worker ``worker`` wrote before dying at start-up, if anything."""
        note = getattr(self.procs[worker], "death_note", "")
        return note if isinstance(note, str) else ""

    def stack(self, worker: int, wait_s: float = 0.5) -> str:
        """The worker's Python stack, dumped by faulthandler on request."""
        return dump_stack(self.procs[worker].pid, self.stack_fds[worker],  # type: ignore[arg-type]
                          wait_s)

    def exited(self, forked: bool) -> List[Tuple[int, int, Optional[int]]]:
        """(worker id, pid, exit code) of every worker that has exited; the
        code is None for a worker ``forked`` by multiprocessing whose status
        is lost (:func:`~fastload.pool.exits.exited_unseen`)."""
        out: List[Tuple[int, int, Optional[int]]] = []
        for i, p in enumerate(self.procs):
            code = p.exitcode
            if code is not None or (forked and exited_unseen(p)):
                out.append((i, p.pid, code))  # type: ignore[arg-type]
        return out

    def close_fds(self) -> None:
        """Close this process's ends: channels, stack files, overflow
        segments (the pool is stopping; idempotent, never raises)."""
        self.overflow.close()
        for fd in self.stack_fds:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass
        self.stack_fds.clear()
        for s in self.channels:
            try:
                s.close()
            except Exception:  # pragma: no cover
                pass


def wait_retired(p: Any, timeout: float) -> None:
    """Wait up to ``timeout`` s for a retired worker to exit on its own (it
    sees the ring's answer at its next look), then kill it."""
    p.join(timeout)
    if p.exitcode is None:
        log.warning("fastload: retired worker pid %s did not exit; killing it", p.pid)
        p.kill()
        p.join(5.0)
    if isinstance(p, Child):
        p.close()
