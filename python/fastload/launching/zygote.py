"""A zygote as the main process sees it: start one, have it fork workers.

:class:`Zygote` starts a fresh interpreter, as :mod:`fastload.launching.spawn`
starts one (in a process group of its own, never running ``__main__``),
that imports torch once and then forks a worker per request: a fork server
of fastload's own. The process itself runs :mod:`fastload.launching.zygote_main`;
the two talk as :mod:`fastload.launching.zygote_protocol` says. Workers
share torch's pages and start in milliseconds; like spawned ones they
inherit nothing from the training process. A zygote can also *preload* a
session (:meth:`Zygote.preload`): it unpickles the session's ``(dataset,
collate_fn, ...)`` once, and the workers forked afterwards inherit it,
sharing its pages copy-on-write as forked DataLoader workers share the
training process's (the garbage collector, off in the zygote, freezes what a
worker inherits: ``gc.freeze()``). :meth:`Zygote.fork_zygote` forks another
zygote from one in milliseconds: the training process's fork server makes
each pool's zygote so (:mod:`fastload.launching.fork_server`).

A worker it forks is a :class:`fastload.launching.child.Child`, a handle that
quacks like ``multiprocessing.Process`` and reads the child's death note.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import parcels
from .child import Child, note_pipe
from .parcels import memfd_of
from .spawn import OWN_PROCESS_GROUP, ZYGOTE_BOOT_COMMAND, child_env, child_header
from .zygote_protocol import (DECLINED, EXITED, FORGET_REQ, IMPORT_REQ, LOST, MAX_FDS, MODULES,
                              MODULES_MAX, PRELOAD, PRELOAD_REQ, STARTED, UNPICKLING, ZYGOTE_REQ)

__all__ = ["Zygote", "ZYGOTE_PRELOAD"]

# What the zygote imports before it forks.
ZYGOTE_PRELOAD = ("torch", "fastload.worker.loop")


def _std_streams() -> List[int]:
    """This process's stdout and stderr fds as they are now (both, or none
    if either is closed), for a zygote forked from a server started
    earlier: its workers write where this process writes now."""
    try:
        os.fstat(1)
        os.fstat(2)
    except OSError:
        return []
    return [1, 2]


class Zygote:
    """A fork server of fastload's own: a process that has imported torch
    and forks a worker per :meth:`start` request.

    The constructor launches one as a fresh interpreter, without waiting for
    it: it imports torch while the caller goes on (the training process's
    fork server, started when the first loader is constructed, while the
    script builds its model); the first request waits until it is ready.
    :meth:`fork_zygote` forks another from it in milliseconds, sharing what
    it imported: each pool's own zygote is made so. A zygote ends with
    :meth:`stop`, or when the training process dies (its control socket
    closes).
    """

    def __init__(self, hide_accelerators: bool, env: Optional[Mapping[str, str]] = None,
                 preload: Sequence[str] = ZYGOTE_PRELOAD) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        note_r, note_w = note_pipe()
        r, w = os.pipe()
        try:
            header = pickle.dumps({"target": "zygote", "preload": list(preload),
                                   "ctl": theirs.fileno(), "sys_path": list(sys.path),
                                   "note_fd": note_w}, protocol=pickle.HIGHEST_PROTOCOL)
            popen = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE_BOOT_COMMAND.format(fd=r)],
                pass_fds=(r, theirs.fileno(), note_w), env=child_env(env), **OWN_PROCESS_GROUP,
            )
        except BaseException:
            for fd in (r, w, note_r, note_w):
                os.close(fd)
            mine.close()
            theirs.close()
            raise
        os.close(r)
        os.close(note_w)
        theirs.close()
        with os.fdopen(w, "wb") as f:
            f.write(header)
        self._adopt(hide_accelerators, mine, Child(popen.pid, note_r, popen=popen), None)

    def _adopt(self, hide_accelerators: bool, ctl: socket.socket, proc: Optional[Child],
               server: Optional["Zygote"], pending: Optional[Tuple[int, int]] = None) -> None:
        self.hide_accelerators = hide_accelerators  # how its environment was set at start
        self._owner_pid = os.getpid()  # a forked copy of this object must not stop it
        self._lock = threading.Lock()
        self._exited: Dict[int, int] = {}
        self.alive = True
        self._ctl = ctl
        self._proc_handle = proc
        # Forked on a request whose answer was not read yet: (ticket, note fd).
        self._pending = pending
        self.server = server  # the zygote this one was forked from, if any
        # The modules its last preload imported (zygote_protocol's MODULES).
        self.session_imports: List[str] = []
        # Requests answered by STARTED are numbered (tickets) in the order
        # sent; answers come in that order and are filed by ticket, so a
        # request may be sent before an earlier one's answer is read.
        self._sent = 0
        self._answered = 0
        self._started: Dict[int, int] = {}

    @property
    def _proc(self) -> Child:
        """The zygote's process; for one forked on a request sent earlier,
        read from its server's answer now (waiting for the server if it is
        still importing torch)."""
        if self._proc_handle is None:
            assert self.server is not None and self._pending is not None
            ticket, note_r = self._pending
            server = self.server
            with server._lock:
                pid = server._read_until_started(ticket)
            self._pending = None
            self._proc_handle = Child(pid, note_r, zygote=server)
        return self._proc_handle

    def fork_zygote(self, wait: bool = True) -> "Zygote":
        """A new zygote forked from this one: it shares the modules this one
        imported and holds no session, and takes this process's stdout and
        stderr as they are now; its parent (this one) reaps it.
        Requests may be sent to it at once (its control socket holds them
        until it runs). ``wait``: wait for this one to fork it (which waits
        for this one to be ready, Ctrl-C interrupting the wait); else the
        answer is read when its pid is first needed."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        note_r, note_w = note_pipe()
        try:
            with self._lock:
                if not self.alive:
                    raise RuntimeError("fastload: the fork server is gone")
                socket.send_fds(self._ctl, [ZYGOTE_REQ],
                                [theirs.fileno(), note_w, *_std_streams()])
                ticket = self._sent
                self._sent += 1
                theirs.close()
                os.close(note_w)
                note_w = -1
        except BaseException:
            mine.close()
            theirs.close()
            os.close(note_r)
            if note_w >= 0:
                os.close(note_w)
            raise
        zygote = Zygote.__new__(Zygote)
        zygote._adopt(self.hide_accelerators, mine, None, self, (ticket, note_r))
        if wait:
            try:
                zygote._proc
            except BaseException:
                zygote.stop()
                raise
        return zygote

    def warm_imports(self, modules: Sequence[str]) -> None:
        """Have the zygote import ``modules`` now, in the background (see
        zygote_protocol's IMPORT_REQ); no answer is read."""
        if not modules:
            return
        msg = IMPORT_REQ + pickle.dumps({"sys_path": list(sys.path), "modules": list(modules)},
                                        protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self.alive and os.getpid() == self._owner_pid:
                try:
                    self._ctl.send(msg)
                except OSError:
                    pass  # gone: whoever uses it next finds out

    @property
    def pid(self) -> Optional[int]:
        """Its pid while it runs; None once it was stopped."""
        return self._proc.pid if self.alive else None

    @property
    def launched_pid(self) -> int:
        """Its pid, also after it is gone (for diagnostics)."""
        return self._proc.pid

    def held_fds(self) -> List[int]:
        """The fds this process holds for the zygote (its control socket,
        its process's handle), while it is not stopped."""
        if not self.alive:
            return []
        fds = [self._ctl.fileno()]
        if self._proc_handle is not None:
            fds += self._proc_handle.held_fds()
        return [fd for fd in fds if fd >= 0]

    def close_inherited(self) -> None:
        """In a process forked from the owner: close this process's copy of
        the control socket, so that the zygote's life does not depend on
        this process (the zygote ends when every copy is closed). Takes no
        lock: a forked child runs one thread, and the lock may have been
        held by another thread of the parent as it forked."""
        if os.getpid() == self._owner_pid:
            return
        self.alive = False
        try:
            self._ctl.close()
        except OSError:
            pass

    def gone(self) -> bool:
        """Whether the zygote has exited (or was stopped, or its server died
        before forking it)."""
        try:
            return not self.alive or self._proc.exitcode is not None
        except RuntimeError:
            return True

    def get_start_method(self) -> str:
        return "zygote"

    def start(self, target: str, parcel: parcels.Parcel) -> Child:
        """Fork a worker running ``target(unpacked parcel)``; waits for the
        zygote to be ready (Ctrl-C interrupts the wait)."""
        note_r, note_w = note_pipe()
        try:
            header = child_header(target, -1, parcel)
            fds = [note_w, *parcel.fds]
            if len(fds) > MAX_FDS:
                raise ValueError(f"fastload: a worker's start-up needs {len(fds)} fds; "
                                 f"at most {MAX_FDS} can be passed")
            with self._lock:
                if not self.alive:
                    raise RuntimeError("fastload: the zygote is gone")
                socket.send_fds(self._ctl, [header], fds)
                ticket = self._sent
                self._sent += 1
                os.close(note_w)
                note_w = -1
                pid = self._read_until_started(ticket)
        except BaseException:
            os.close(note_r)
            if note_w >= 0:
                os.close(note_w)
            raise
        return Child(pid, note_r, zygote=self)

    def _read_until_started(self, ticket: int) -> int:
        """The pid the answer to request ``ticket`` carries (caller holds the lock)."""
        while ticket not in self._started:
            msg = self._recv(None)
            if msg is None:
                code = self._proc.exitcode
                raise RuntimeError(
                    "fastload: the zygote (the process workers are forked from) exited "
                    f"with code {code} before starting a process it was asked for; its "
                    "stderr says why")
        return self._started.pop(ticket)

    def preload(self, parcel: parcels.Parcel, token: int,
                timeout: Optional[float] = None) -> Tuple[int, str]:
        """Have the zygote unpickle session ``parcel`` (as :func:`parcels.
        unpack` in a worker would) and hold it as session ``token``, in place
        of the one it held; the workers it forks from then on inherit it
        (:func:`fastload.launching.zygote_main.preloaded`). Returns the outcome (PRELOADED, DECLINED,
        TAINTED, or LOST: the zygote died or did not answer within
        ``timeout`` seconds) and, unless PRELOADED, why. Waits for the zygote
        to be ready (Ctrl-C interrupts the wait)."""
        fds = [-1, *parcel.fds]
        if len(fds) > MAX_FDS:
            return DECLINED, f"the session holds {len(fds) - 1} fds; at most {MAX_FDS - 1} can be passed"
        me = multiprocessing.current_process()
        head = PRELOAD_REQ + pickle.dumps({
            "token": token, "sys_path": list(sys.path), "sys_argv": list(sys.argv),
            "authkey": bytes(me.authkey)}, protocol=pickle.HIGHEST_PROTOCOL)
        fds[0] = memfd_of(parcel.data)
        try:
            with self._lock:
                if not self.alive:
                    return LOST, "the zygote is gone"
                socket.send_fds(self._ctl, [head], fds)
                os.close(fds[0])
                fds[0] = -1
                deadline = None  # the clock starts when it starts unpickling
                while True:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    msg = self._recv(left)
                    if msg is None:
                        return LOST, "the zygote exited while unpickling the session"
                    if msg == b"":
                        return LOST, f"the zygote did not unpickle the session within {timeout} s"
                    if msg[:1] == MODULES:
                        self.session_imports = pickle.loads(msg[1:])
                        continue
                    if msg[:1] not in (PRELOAD_REQ, UNPICKLING):
                        continue  # an exit report
                    kind, got, outcome = PRELOAD.unpack_from(msg)
                    if got != token:
                        continue  # about an earlier request (interrupted)
                    if kind == PRELOAD_REQ:
                        return outcome, msg[PRELOAD.size:].decode(errors="replace")
                    if timeout is not None:
                        deadline = time.monotonic() + timeout
        finally:
            if fds[0] >= 0:
                os.close(fds[0])

    def forget(self) -> None:
        """Tell the zygote that no worker will be forked with its session
        again (it does not answer). It keeps the session's objects unused, so
        that the next session, if identical, is not unpickled again."""
        with self._lock:
            if self.alive and os.getpid() == self._owner_pid:
                try:
                    self._ctl.send(FORGET_REQ)
                except OSError:
                    pass  # gone: whoever forks from it next finds out

    def _recv(self, timeout: Optional[float]) -> Optional[bytes]:
        """One message (exit reports and start answers are filed on the way); None when the
        zygote is gone or nothing came within ``timeout``."""
        if timeout is not None and not select.select([self._ctl], [], [], timeout)[0]:
            return b""
        try:
            msg = self._ctl.recv(MODULES_MAX)
        except (ConnectionResetError, OSError):
            msg = b""
        if not msg:
            self.alive = False
            return None
        if msg[:1] == b"X":
            _x, pid, code = EXITED.unpack(msg)
            self._exited[pid] = code
        elif msg[:1] == b"S":  # filed by ticket, whoever reads it (see _read_until_started)
            self._started[self._answered] = STARTED.unpack(msg)[1]
            self._answered += 1
        return msg

    def exit_code(self, pid: int, wait: float = 0.0) -> Optional[int]:
        """The exit code the zygote reported for ``pid``, if it has."""
        if os.getpid() != self._owner_pid:
            return None
        with self._lock:
            deadline = time.monotonic() + wait
            while pid not in self._exited and self.alive:
                left = deadline - time.monotonic()
                msg = self._recv(max(0.0, left))
                if msg == b"" and left <= 0:
                    break
            return self._exited.get(pid)

    def stop(self) -> None:
        """End the zygote now. Idempotent; a no-op in a process forked from
        the owner. Its workers are the pool's to stop (a worker started by a
        request whose answer never came, say on Ctrl-C, finds the ring shut
        down and exits: workers never outlive their ring's shutdown)."""
        if os.getpid() != self._owner_pid:
            return
        with self._lock:
            self.alive = False
            try:
                self._ctl.close()
            except OSError:
                pass
        if self._proc_handle is None:
            # Its server has not answered yet (it may still be importing
            # torch): the zygote, once forked, finds its socket closed and
            # exits; the server reaps it.
            if self._pending is not None:
                os.close(self._pending[1])
                self._pending = None
            return
        self._proc.kill()  # it may still be importing torch: no need to wait for that
        if self.server is None:
            self._proc.join()  # our child: reap it
        # else its parent, the fork server, reaps it
        self._proc.close()

