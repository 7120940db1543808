"""The zygote: one spawn-started process that imports torch once; the pool's
workers are forked from it (DESIGN decision 2).

A spawned worker pays for a new interpreter and ``import torch`` each, and
keeps its own copy of torch's pages (~150 MB PSS each here). Workers forked
from a zygote share those pages copy-on-write and start in milliseconds once
the zygote is up. The zygote itself is spawn-started (a fresh interpreter,
started with accelerators hidden and SIGINT ignored), imports torch and
fastload's worker module, never touches an accelerator and starts no thread
before it forks: the workers inherit nothing from the training process,
which is what spawn is for.

It is Python's forkserver with its own server per pool instead of the
process-wide one (whose preload list and environment belong to whoever
started it first), and it ends with the pool.
"""

from __future__ import annotations

import io
import logging
import os
import signal
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any, Dict, Optional, Sequence

__all__ = ["Zygote", "ZYGOTE_PRELOAD"]

log = logging.getLogger("fastload")

# What the zygote imports before it forks.
ZYGOTE_PRELOAD = ("torch", "fastload.worker")


class _ZygotePopen(popen_forkserver.Popen):
    """popen_forkserver.Popen, asking our server instead of the global one."""

    def _launch(self, process_obj: "ZygoteProcess") -> None:
        server = process_obj._zygote_server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        # As the standard library does: a duplicate of the data pipe's write
        # end is the child's sentinel of this process.
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)
        # The zygote reports the worker's exit status on the sentinel; if the
        # zygote itself dies (the OOM killer likes its size), that report is
        # lost but the worker lives on: watch the worker's own pidfd then.
        self._pidfd: Optional[int] = None
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            pass
        else:
            util.Finalize(self, os.close, (self._pidfd,))

    def poll(self, flag: int = os.WNOHANG) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        from multiprocessing.connection import wait

        timeout = 0 if flag == os.WNOHANG else None
        if not wait([self.sentinel], timeout):
            return None
        if self.sentinel != self._pidfd:
            try:
                self.returncode = forkserver.read_signed(self.sentinel)
                return self.returncode
            except (OSError, EOFError):  # the zygote died before reporting
                if self._pidfd is None:
                    self.returncode = 255  # what the standard library says
                    return self.returncode
                log.warning("fastload: the zygote died; watching worker pid %s directly "
                            "(its exit status will be unknown)", self.pid)
                self.sentinel = self._pidfd  # what wait() and join() watch from now on
                if not wait([self.sentinel], timeout):
                    return None
        self.returncode = 255  # exited; not our child, so its status is unknown
        return self.returncode


class ZygoteProcess(process.BaseProcess):
    """A worker process forked from a :class:`Zygote`."""

    _start_method = "forkserver"
    _zygote_server: Optional[forkserver.ForkServer] = None

    @staticmethod
    def _Popen(process_obj: "ZygoteProcess") -> _ZygotePopen:  # type: ignore[override]
        return _ZygotePopen(process_obj)

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_zygote_server", None)  # holds a lock; the child needs none of it
        return state


class Zygote:
    """One pool's fork server. Quacks enough like a multiprocessing context
    for :class:`fastload.pool.WorkerPool`: ``Process(...)`` and
    ``get_start_method()``."""

    def __init__(self, hide_accelerators: bool, preload: Sequence[str] = ZYGOTE_PRELOAD) -> None:
        self.hide_accelerators = hide_accelerators  # how its environment was set at start
        self._owner_pid = os.getpid()  # a forked copy of this object must not stop it
        self._server = forkserver.ForkServer()
        self._server.set_forkserver_preload(list(preload))

    def start(self) -> None:
        """Launch the zygote without waiting for it: it imports torch while
        the caller goes on; the first fork request queues until it is ready.
        The caller sets the environment it inherits (see pool.start_zygote)."""
        self._server.ensure_running()

    def get_start_method(self) -> str:
        return "zygote"

    def Process(self, **kwargs: Any) -> ZygoteProcess:  # noqa: N802 - multiprocessing's name
        p = ZygoteProcess(**kwargs)
        p._zygote_server = self._server
        return p

    @property
    def pid(self) -> Optional[int]:
        return self._server._forkserver_pid

    def stop(self) -> None:
        """End the zygote (its workers must be gone already). Idempotent.
        A no-op in a process forked from the owner (it inherited this object)."""
        if os.getpid() != self._owner_pid:
            return
        server = self._server
        with server._lock:
            pid = server._forkserver_pid
            if pid is None:
                return
            # It would exit by itself once every holder of the "alive" pipe
            # has closed it; after the workers are gone we need not wait.
            try:
                os.close(server._forkserver_alive_fd)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            address = server._forkserver_address
            if address and not util.is_abstract_socket_namespace(address):
                try:
                    os.unlink(address)
                except OSError:
                    pass
            server._forkserver_pid = None
            server._forkserver_alive_fd = None
            server._forkserver_address = None
