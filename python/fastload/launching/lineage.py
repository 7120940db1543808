"""Where a zygote pool's workers come from: the fork server and the zygotes.

``multiprocessing_context=None`` (the default, see
:mod:`fastload.launching.start_methods`) means workers forked from a zygote
of the pool's own (:class:`fastload.launching.zygote_client.Zygote`),
itself forked in milliseconds from the training process's *fork server*:
one fresh interpreter that imports torch once (:func:`fork_server`), so that
only the first loader of a training process waits for torch's import. A
:class:`Lineage` is the zygote side of one pool: the zygotes it has
started (one is replaced when it dies, gets stuck unpickling a session, or
is left with threads in it), and the session the current one holds, so
that workers forked from it share that session's pages copy-on-write
instead of each unpickling a copy (docs/design.md, "Warm workers").
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
from typing import Callable, Dict, List, Optional

from . import crossing
from .child import Child
from .spawn import hidden_env
from .zygote_client import Zygote
from .zygote_protocol import DECLINED, PRELOADED

log = logging.getLogger("fastload")


def _start_server(hide_accelerators: bool) -> Zygote:
    """A new fork server: a fresh interpreter that imports torch, its
    environment hiding the accelerators or not."""
    return Zygote(hide_accelerators, env=hidden_env(hide_accelerators))


class ForkServers:
    """The fork servers of this process, one per accelerator setting, and
    the leases that keep them running.

    A server is started by the first lease (a loader's construction,
    ``fastload.install()``), in the background: it imports torch while the
    script goes on. It stops when the last lease is released (the last
    loader is gone), so that no process outlives the loaders; a zygote
    needed with no lease held (a pool outliving its loader) starts one that
    stops with the next release or at exit. The server's environment hides
    the accelerators or not, as the pools forked from it need; their
    sessions set the rest of the training process's environment.

    ``start_server(hide_accelerators)`` starts one (tests pass a fake).
    """

    def __init__(self, start_server: Callable[[bool], Zygote] = _start_server) -> None:
        self._start_server = start_server
        self._lock = threading.Lock()
        self._servers: Dict[bool, Zygote] = {}
        self._leases: Dict[bool, int] = {}
        self._owner_pid = os.getpid()

    def _mine(self) -> None:
        """In a process forked from the owner: forget the owner's servers
        (their sockets are the owner's), never stop them."""
        if os.getpid() != self._owner_pid:
            self._servers, self._leases, self._owner_pid = {}, {}, os.getpid()

    def server(self, hide_accelerators: bool) -> Zygote:
        """The live server for this setting; a new one if there is none, or
        it is gone (killed, say by the OOM killer)."""
        with self._lock:
            self._mine()
            server = self._servers.get(hide_accelerators)
            if server is None or server.gone():
                if server is not None:
                    log.warning("fastload: the fork server is gone; starting a new one")
                    server.stop()
                server = self._servers[hide_accelerators] = self._start_server(hide_accelerators)
            return server

    def start_zygote(self, hide_accelerators: bool) -> Zygote:
        """A zygote for one pool, forked from the fork server (see
        zygote_client.Zygote.fork_zygote): milliseconds once the server is
        ready. If the server cannot fork it (it died just now), a new server
        is started and asked once more."""
        try:
            return self.server(hide_accelerators).fork_zygote()
        except RuntimeError:
            return self.server(hide_accelerators).fork_zygote()

    def lease(self, hide_accelerators: bool) -> "ServerLease":
        lease = ServerLease(self, hide_accelerators)
        with self._lock:
            self._mine()
            self._leases[hide_accelerators] = self._leases.get(hide_accelerators, 0) + 1
        self.server(hide_accelerators)
        return lease

    def release(self, hide_accelerators: bool, owner_pid: int) -> None:
        with self._lock:
            if os.getpid() != owner_pid or os.getpid() != self._owner_pid:
                return  # a lease copied into a forked child: the parent's
            left = self._leases.get(hide_accelerators, 0) - 1
            self._leases[hide_accelerators] = max(left, 0)
            stopping = [self._servers.pop(hide_accelerators)] if (
                left <= 0 and hide_accelerators in self._servers) else []
        for server in stopping:
            server.stop()

    def stop_all(self) -> None:
        """Stop every server (at exit)."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                return
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.stop()

    def running_pid(self, hide_accelerators: bool) -> Optional[int]:
        """The pid of the server for this setting, if one runs (none is started)."""
        with self._lock:
            server = self._servers.get(hide_accelerators) if os.getpid() == self._owner_pid else None
            return server.pid if server is not None and not server.gone() else None


class ServerLease:
    """Keeps a fork server running until :meth:`release` (idempotent)."""

    def __init__(self, servers: ForkServers, hide_accelerators: bool) -> None:
        self._servers = servers
        self._hide = hide_accelerators
        self._pid = os.getpid()
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        if self._held:
            self._held = False
            self._servers.release(self._hide, self._pid)


# The process's fork servers: shared by every loader, by design (one
# interpreter importing torch per training process, docs/design.md).
_FORK_SERVERS = ForkServers()
atexit.register(_FORK_SERVERS.stop_all)


def lease_fork_server(hide_accelerators: bool) -> ServerLease:
    """Start the fork server for this setting if it is not running, and keep
    it running until the lease is released."""
    return _FORK_SERVERS.lease(hide_accelerators)


def fork_server(hide_accelerators: bool) -> Zygote:
    """The running fork server for this setting (started if needed)."""
    return _FORK_SERVERS.server(hide_accelerators)


def fork_server_pid(hide_accelerators: bool) -> Optional[int]:
    """The pid of the running fork server for this setting, or None; starts
    nothing (for diagnostics)."""
    return _FORK_SERVERS.running_pid(hide_accelerators)


class Lineage:
    """The zygotes one pool forks its workers from, and what they hold.

    Sessions are numbered per pool. After :meth:`preload`, the current
    zygote holds session :attr:`preloaded` (or none, if it could not), and
    :meth:`fork` records per worker the session it was forked with:
    :meth:`inherits` tells whether a worker already has the current one.

    ``zygote``: one forked ahead for the pool (a loader's spare); ``servers``:
    the fork servers its zygotes come from (the process's own by default).
    """

    def __init__(self, num_workers: int, hide_accelerators: bool,
                 zygote: Optional[Zygote] = None, *,
                 servers: Optional[ForkServers] = None) -> None:
        self._hide = hide_accelerators
        self._servers = servers if servers is not None else _FORK_SERVERS
        # The pool keeps the fork server running while it may need a zygote
        # from it (released by the pool's teardown, fastload.teardown).
        self.lease = self._servers.lease(hide_accelerators)
        # Every zygote started for the pool, oldest first; the last is current.
        self.zygotes: List[Zygote] = [zygote if zygote is not None
                                      else self._servers.start_zygote(hide_accelerators)]
        self._numbers = itertools.count(1)
        self.preloaded: Optional[int] = None  # the session the current zygote holds
        self._holder: Optional[Zygote] = None  # the zygote holding it
        self._forked_with: List[Optional[int]] = [None] * num_workers
        self._ok = True  # False once a session of this pool could not be preloaded

    @property
    def current(self) -> Zygote:
        return self.zygotes[-1]

    def _live(self) -> Zygote:
        """The zygote to fork from; a new one if the last was lost (the OOM
        killer likes its size)."""
        if self.current.gone():
            log.warning("fastload: the zygote the workers are forked from is gone; "
                        "starting a new one")
            self.zygotes.append(self._servers.start_zygote(self._hide))
        return self.current

    def fork(self, worker: int, target: str, parcel: crossing.Parcel) -> Child:
        """Fork worker ``worker`` running ``target(parcel)`` from the current zygote."""
        zygote = self._live()
        child = zygote.start(target, parcel)
        self._forked_with[worker] = self.preloaded if zygote is self._holder else None
        return child

    def inherits(self, worker: int) -> bool:
        """Whether ``worker`` was forked from the zygote holding the current session."""
        number = self._forked_with[worker]
        return number is not None and number == self.preloaded

    def forget(self) -> None:
        """The pool's workers are retired: the zygote holding the session
        lets go of it (no worker will be forked with it again)."""
        holder, self.preloaded, self._holder = self._holder, None, None
        if holder is not None:
            holder.forget()

    def preload(self, parcel: crossing.Parcel, timeout: Optional[float]) -> None:
        """A new session: have the current zygote unpickle ``parcel`` (within
        ``timeout`` s) so that the workers forked next inherit it. If it
        cannot, the workers unpickle their own from now on, and a zygote
        left unsafe to fork from (threads, a GPU context, stuck) is replaced."""
        self.preloaded = self._holder = None
        number = next(self._numbers)
        if not self._ok:
            return
        zygote = self._live()
        zygote.session_imports = []
        outcome, why = zygote.preload(parcel, number, timeout)
        if outcome == PRELOADED:
            self.preloaded, self._holder = number, zygote
            if zygote.session_imports and zygote.server is not None:
                # Imported without harm here: the fork server imports them
                # too, so the zygotes of later pools (a validation loader, a
                # loader a library rebuilds) need not.
                zygote.server.warm_imports(zygote.session_imports)
            return
        # The dataset is the same next epoch: don't pay its unpickling in
        # the zygote again. Each worker unpickles its own copy.
        self._ok = False
        level = logging.DEBUG if outcome == DECLINED else logging.WARNING
        log.log(level, "fastload: workers unpickle the dataset themselves "
                       "(not shared through the zygote): %s", why)
        if outcome != DECLINED:
            zygote.stop()
            self.zygotes.append(self._servers.start_zygote(self._hide))
