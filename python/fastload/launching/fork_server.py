"""Where a zygote pool's workers come from: the fork server and the zygotes.

``multiprocessing_context=None`` (the default, see
:mod:`fastload.launching.start_methods`) means workers forked from a zygote
of the pool's own (:class:`fastload.launching.zygote.Zygote`),
itself forked in milliseconds from the training process's *fork server*:
one fresh interpreter that imports torch once (:func:`fork_server`), so that
at most the first loader of a training process waits for torch's import.
The server lives as long as the training process (:class:`ForkServers`),
and starts at ``import fastload`` in the user's own code
(:func:`start_at_import`) or with the first loader. A
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
import sys
import threading
from typing import Callable, Dict, List, Optional, Tuple

from . import parcels
from .child import Child
from .spawn import hidden_env
from .zygote import Zygote
from .zygote_protocol import DECLINED, PRELOADED

log = logging.getLogger("fastload")


def _start_server(hide_accelerators: bool) -> Zygote:
    """A new fork server: a fresh interpreter that imports torch, its
    environment hiding the accelerators or not."""
    return Zygote(hide_accelerators, env=hidden_env(hide_accelerators))


class ForkServers:
    """The fork servers of this process, one per accelerator setting.

    A server is started by the first lease (a loader's construction,
    ``fastload.install()``) or by :func:`start_at_import`, in the
    background: it imports torch while the script goes on. It then lives as
    long as this process, as ``multiprocessing``'s forkserver does: it holds
    no dataset and no GPU context (the zygotes, workers and rings of a
    loader end with that loader), so a loader made after the last one was
    dropped (a loader per epoch or per evaluation, a notebook cell run
    again) forks from a ready server instead of importing torch again. It
    ends when this process ends, however it ends: its control socket is
    held by this process alone (a forked child closes its copy at once, see
    :meth:`after_fork_in_child`), so the kernel closes it at any death,
    SIGKILL included, and the server, reading the end of it, exits. Or at
    :meth:`stop_all` (:func:`fastload.shutdown`, and at exit). A lease
    marks a loader or pool as a user of the server and starts it if it is
    not running; releasing the last one does not stop it.

    The server's environment hides the accelerators or not, as the pools
    forked from it need; their sessions set the rest of the training
    process's environment.

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

    def after_fork_in_child(self) -> None:
        """In a child just forked from the owner (``os.fork``, a ``'fork'``
        worker): close this process's copies of the servers' control
        sockets, so that the servers end with the owner and not with the
        last of its forked children, and forget the servers. Runs with one
        thread in the process: the lock, maybe held by another thread of the
        parent as it forked, is made anew rather than taken."""
        if os.getpid() == self._owner_pid:
            return
        self._lock = threading.Lock()
        for server in list(self._servers.values()):
            server.close_inherited()
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
        zygote.Zygote.fork_zygote): milliseconds once the server is
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
        """A lease is released: one user fewer. The server keeps running."""
        with self._lock:
            if os.getpid() != owner_pid or os.getpid() != self._owner_pid:
                return  # a lease copied into a forked child: the parent's
            self._leases[hide_accelerators] = max(self._leases.get(hide_accelerators, 0) - 1, 0)

    def users(self, hide_accelerators: bool) -> int:
        """How many leases on the server for this setting are held."""
        with self._lock:
            return self._leases.get(hide_accelerators, 0) if os.getpid() == self._owner_pid else 0

    def stop_all(self) -> None:
        """Stop every server now (:func:`fastload.shutdown`, and at exit).
        The next lease or zygote needed starts a new one."""
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

    def held(self) -> Tuple[List[int], List[int]]:
        """The pids of the servers started by this process and not stopped,
        and the fds this process holds for them (their control sockets,
        death-note pipes): what outlives every loader by design, for leak
        checks to tell apart from a leak."""
        with self._lock:
            if os.getpid() != self._owner_pid:
                return [], []
            servers = list(self._servers.values())
        pids = [s.launched_pid for s in servers]
        return pids, [fd for s in servers for fd in s.held_fds()]


class ServerLease:
    """Marks a user of a fork server (started by the lease if it was not
    running) until :meth:`release` (idempotent). The server outlives its
    leases (see :class:`ForkServers`)."""

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
os.register_at_fork(after_in_child=_FORK_SERVERS.after_fork_in_child)

# Set to "0" to start no fork server at ``import fastload`` (see
# :func:`start_at_import`).
SERVER_AT_IMPORT_ENV = "FASTLOAD_SERVER_AT_IMPORT"


def lease_fork_server(hide_accelerators: bool) -> ServerLease:
    """Start the fork server for this setting if it is not running, and mark
    the caller as a user of it until the lease is released."""
    return _FORK_SERVERS.lease(hide_accelerators)


def fork_server(hide_accelerators: bool) -> Zygote:
    """The running fork server for this setting (started if needed)."""
    return _FORK_SERVERS.server(hide_accelerators)


def fork_server_pid(hide_accelerators: bool) -> Optional[int]:
    """The pid of the running fork server for this setting, or None; starts
    nothing (for diagnostics)."""
    return _FORK_SERVERS.running_pid(hide_accelerators)


def fork_servers_held() -> Tuple[List[int], List[int]]:
    """The pids of this process's running fork servers and the fds it holds
    for them (see :meth:`ForkServers.held`)."""
    return _FORK_SERVERS.held()


def shutdown() -> None:
    """Stop this process's fork servers now.

    fastload keeps one fork server per training process (a fresh
    interpreter that has imported torch, from which every loader's workers
    are forked) for as long as the process runs, and stops it at exit, or
    when the process dies: call this only to have it gone sooner (its memory
    back, say, once a script is done with loaders). Loaders still alive keep
    their own processes and go on working; the next one that needs the
    server starts a new one, which imports torch again.
    """
    _FORK_SERVERS.stop_all()


def _started_by_fastload_or_multiprocessing() -> bool:
    """Whether this interpreter is one fastload or ``multiprocessing``
    started (a worker, a zygote, the fork server, a spawned DataLoader
    worker or DDP rank importing the script as ``__mp_main__``)."""
    import multiprocessing

    # fastload's fresh interpreters, and multiprocessing's (a spawned child,
    # its forkserver, which imports __main__ ahead), run ``python -c``.
    if any("fastload.launching.boot" in arg or "from multiprocessing" in arg
           for arg in getattr(sys, "orig_argv", ())):
        return True
    me = multiprocessing.current_process()
    return (multiprocessing.parent_process() is not None or me.name != "MainProcess"
            or getattr(me, "_inheriting", False))


def _install_hook_on() -> bool:
    """Whether ``FASTLOAD_INSTALL`` is on (as ``_fastload_autoinstall.enabled``
    reads it): its start-up hook imports fastload in every Python process of
    the tree, most of which never iterate a loader."""
    return os.environ.get("FASTLOAD_INSTALL", "").strip().lower() not in (
        "", "0", "false", "no", "off")


def start_at_import() -> bool:
    """Start the default fork server (accelerators hidden) as ``import
    fastload`` runs in the user's own code, so that torch's import in it
    overlaps the script's own imports and set-up, and the first loader's
    first batch does not wait for it. Returns whether it started one.

    Not in a process that fastload or ``multiprocessing`` started, nor with
    ``FASTLOAD_INSTALL`` on (its hook imports fastload in every Python
    process of a tree; the first loader starts the server there), nor with
    ``FASTLOAD_SERVER_AT_IMPORT=0``. A script that never makes a loader pays
    one process start here (the server imports torch on another core, and
    is stopped at exit).
    """
    if os.environ.get(SERVER_AT_IMPORT_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if _install_hook_on() or _started_by_fastload_or_multiprocessing():
        return False
    try:
        _FORK_SERVERS.server(True)
    except OSError as e:  # the first loader tries again, and reports
        log.debug("fastload: could not start the fork server at import: %s", e)
        return False
    return True


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
        # from it (released by the pool's teardown, fastload.pool.teardown).
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

    def fork(self, worker: int, target: str, parcel: parcels.Parcel) -> Child:
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

    def preload(self, parcel: parcels.Parcel, timeout: Optional[float]) -> None:
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
