"""Starting worker processes that never run the training script.

``multiprocessing``'s spawn and forkserver start a child by re-importing the
parent's ``__main__`` (the script, as ``__mp_main__``): a script without an
``if __name__ == "__main__":`` guard then runs its top-level code once per
worker, and a worker that builds a loader there dies with "An attempt has been
made to start a new process before the current process has finished its
bootstrapping phase". fastload's workers need nothing from ``__main__``:
everything they use travels by value (:mod:`fastload.crossing`). So fastload
starts them itself, with two launchers:

* :func:`spawn` — a fresh interpreter (``python -c``) that runs
  :func:`boot`: it reads the worker's spec from a pipe, sets ``sys.path`` and
  ``sys.argv`` as the parent has them, and calls the worker's entry point.
  Real spawn: nothing is inherited but the fds named in the spec.
* :class:`Zygote` — one such interpreter that imports torch once and then
  forks a worker per request (a fork server of fastload's own). Workers share
  torch's pages and start in milliseconds; like spawned ones they inherit
  nothing from the training process. A zygote can also *preload* a session
  (:meth:`Zygote.preload`): it unpickles the session's ``(dataset,
  collate_fn, ...)`` once, and the workers forked afterwards inherit it,
  sharing its pages copy-on-write as forked DataLoader workers share the
  training process's (the garbage collector, off in the zygote, freezes
  what a worker inherits: ``gc.freeze()``).

Both put the child in a session of its own (``setsid``): Ctrl-C at the
terminal goes to the training process alone, which raises KeyboardInterrupt
and stops the workers, and no SIGINT has to be blocked or ignored in the
training process while a worker starts. Workers end when the training process
does (see ``worker._MainWatch``).

A child that fails before its loop runs (an import error, an unpicklable
spec) writes its traceback to a *death note* pipe as well as to stderr; the
main process quotes it in the error instead of "details are lost".

Process handles quack like ``multiprocessing.Process`` where the pool needs
it: ``pid``, ``exitcode`` (negative for a signal), ``is_alive()``,
``join()``, ``terminate()``, ``kill()``.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import crossing

__all__ = ["Child", "Zygote", "spawn", "boot", "preloaded", "ZYGOTE_PRELOAD"]

log = logging.getLogger("fastload")

# What the zygote imports before it forks.
ZYGOTE_PRELOAD = ("torch", "fastload.worker")

_BOOT = "import fastload.launch as l; l.boot({fd})"
_ZYGOTE_BOOT = _BOOT + "  # fastload zygote"  # told apart from workers in process lists
_NOTE_MAX = 1 << 16
_STARTED = struct.Struct("<ci")  # b"S", pid
_EXITED = struct.Struct("<cii")  # b"X", pid, exit code (negative: signal)
_MAX_FDS = 250  # SCM_RIGHTS carries at most 253 fds per message
_PRELOAD_REQ = b"P"  # a preload request; fork requests are pickles (b"\x80...")
_PRELOAD = struct.Struct("<cIB")  # b"P", token, outcome; then why, as text
_UNPICKLING = b"p"  # _PRELOAD's shape: the zygote has begun unpickling session token
_WHY_MAX = 1000

# Outcomes of a preload (Zygote.preload).
PRELOADED = 0  # the zygote holds the session: workers forked now inherit it
DECLINED = 1  # it could not or should not hold it: workers unpickle their own
TAINTED = 2  # as DECLINED, and unpickling left threads (or a GPU context) in
#              the zygote: it is no longer safe to fork from
LOST = 3  # the zygote died, or gave no answer in time (main side only)

# In a zygote: the session it preloaded, (token, objects); inherited by the
# workers it forks. None when it holds none.
_preloaded: Optional[Tuple[int, Any]] = None


def _header(target: str, note_fd: int, parcel: crossing.Parcel) -> bytes:
    """What a child needs before anything else: the parent's import path and
    argv (spawn's preparation data, without the main module), the entry
    point, the death-note fd and the parcel's fd numbers."""
    import multiprocessing

    me = multiprocessing.current_process()
    return pickle.dumps({
        "sys_path": list(sys.path),
        "sys_argv": list(sys.argv),
        "authkey": bytes(me.authkey),
        "target": target,
        "note_fd": note_fd,
        "fds": list(parcel.fds),
        "data": parcel.data,
    }, protocol=pickle.HIGHEST_PROTOCOL)


def _child_env(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    out = dict(os.environ)
    if env:
        out.update(env)
    return out


def _import(target: str) -> Any:
    module, _, name = target.partition(":")
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)


def _run(header: Dict[str, Any], fds: Sequence[int]) -> int:
    """Set up as the parent asked, run the entry point; the exit code."""
    note_fd = header["note_fd"]
    try:
        import multiprocessing

        sys.path[:] = header["sys_path"]
        sys.argv[:] = header["sys_argv"]
        me = multiprocessing.current_process()
        me.authkey = header["authkey"]  # managers and mp connections check it
        target = _import(header["target"])
        arg = crossing.unpack(header["data"], fds)
        target(arg)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit 1
        text = traceback.format_exc()
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        try:
            os.write(note_fd, text.encode(errors="replace")[-_NOTE_MAX:])
        except OSError:
            pass
        return 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass


def preloaded(token: int) -> Any:
    """In a worker forked from a zygote: the session the zygote had
    preloaded when it forked it, which must be the one numbered ``token``."""
    if _preloaded is None or _preloaded[0] != token:
        have = None if _preloaded is None else _preloaded[0]
        raise RuntimeError(f"fastload: this worker was forked without the session it was told "
                           f"to inherit (session {token}; the zygote held {have})")
    return _preloaded[1]


def boot(fd: int) -> None:
    """Entry point of a spawned child (``python -c``): read the header from
    pipe ``fd`` and run it; ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with os.fdopen(fd, "rb") as f:
        header = pickle.load(f)
    if header["target"] == "zygote":
        _serve(header)
        os._exit(0)
    # As a forked DataLoader worker ends: no interpreter teardown (with torch
    # loaded it takes seconds, and a stopping loader waits for it).
    os._exit(_run(header, header["fds"]))


class Child:
    """A worker process started by fastload (spawned or forked by a zygote)."""

    def __init__(self, pid: int, note_fd: int, popen: Optional[subprocess.Popen] = None,
                 zygote: Optional["Zygote"] = None) -> None:
        self.pid = pid
        self._popen = popen
        self._zygote = zygote
        self._note_fd = note_fd
        self._note = b""
        self._code: Optional[int] = None
        self._pidfd: Optional[int] = None
        if popen is None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # already gone (and reaped by the zygote)
                self._pidfd = None
        self._closed = False

    # -- multiprocessing.Process's surface ------------------------------------
    @property
    def exitcode(self) -> Optional[int]:
        if self._code is None:
            self._code = self._poll()
            if self._code is not None:
                self._read_note()
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._wait_gone(0.05 if left is None else min(0.05, left))

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    # -- fastload's additions ---------------------------------------------------
    @property
    def pidfd(self) -> Optional[int]:
        """The child's pidfd, if this handle holds one (a zygote's child)."""
        return None if self._closed else self._pidfd

    @property
    def death_note(self) -> str:
        """What the child wrote before dying of an error at start-up, if anything."""
        self._read_note()
        return self._note.decode(errors="replace").strip()

    def close(self) -> None:
        """Release the handle's fds (the process must be gone or not our concern)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._note_fd, self._pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __del__(self) -> None:
        self.close()

    # -- internals --------------------------------------------------------------
    def _poll(self) -> Optional[int]:
        if self._popen is not None:
            return self._popen.poll()
        assert self._zygote is not None
        code = self._zygote.exit_code(self.pid)
        if code is not None:
            return code
        if self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]:
            return None  # still running
        # Gone; its zygote reports the status once it has reaped it.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            code = self._zygote.exit_code(self.pid, wait=0.05)
            if code is not None:
                return code
            if not self._zygote.alive:
                break
        return 255  # exited; the zygote that could tell how is gone (multiprocessing's code)

    def _wait_gone(self, timeout: float) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        elif self._pidfd is not None:
            select.select([self._pidfd], [], [], timeout)
        else:
            time.sleep(timeout)

    def _signal(self, sig: int) -> None:
        if self._code is not None:
            return
        try:
            if self._popen is not None:
                self._popen.send_signal(sig)
            elif self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
        except (ProcessLookupError, OSError):
            pass

    def _read_note(self) -> None:
        if self._closed:
            return
        try:
            while True:
                chunk = os.read(self._note_fd, _NOTE_MAX)
                if not chunk:
                    break
                self._note = (self._note + chunk)[-_NOTE_MAX:]
        except (BlockingIOError, OSError):
            pass


def _note_pipe() -> Tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


def spawn(target: str, parcel: crossing.Parcel, env: Optional[Mapping[str, str]] = None) -> Child:
    """Start ``target(unpacked parcel)`` (``"module:function"``) in a fresh
    interpreter; ``env`` is overlaid on this process's environment."""
    note_r, note_w = _note_pipe()
    r, w = os.pipe()
    try:
        header = _header(target, note_w, parcel)
        popen = subprocess.Popen(
            [sys.executable, "-c", _BOOT.format(fd=r)],
            pass_fds=(r, note_w, *parcel.fds), env=_child_env(env), start_new_session=True,
        )
    except BaseException:
        for fd in (r, w, note_r, note_w):
            os.close(fd)
        raise
    os.close(r)
    os.close(note_w)
    child = Child(popen.pid, note_r, popen=popen)
    try:
        with os.fdopen(w, "wb") as f:
            f.write(header)
    except BrokenPipeError:  # it died at once; its exit code says the rest
        pass
    return child


class Zygote:
    """A fork server of fastload's own: one spawned interpreter that imports
    torch, then forks a worker per :meth:`start` request.

    Launched by the constructor without waiting for it: it imports torch
    while the caller goes on (a loader starts one at construction, while the
    script builds its model); the first request waits until it is ready.
    It ends with :meth:`stop`, or when the training process dies (its
    control socket closes).
    """

    def __init__(self, hide_accelerators: bool, env: Optional[Mapping[str, str]] = None,
                 preload: Sequence[str] = ZYGOTE_PRELOAD) -> None:
        self.hide_accelerators = hide_accelerators  # how its environment was set at start
        self._owner_pid = os.getpid()  # a forked copy of this object must not stop it
        self._lock = threading.Lock()
        self._exited: Dict[int, int] = {}
        self.alive = True
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ctl = mine
        note_r, note_w = _note_pipe()
        os.close(note_r)  # a zygote that fails shows it on stderr and by refusing work
        r, w = os.pipe()
        try:
            header = pickle.dumps({"target": "zygote", "preload": list(preload),
                                   "ctl": theirs.fileno(), "sys_path": list(sys.path),
                                   "note_fd": note_w}, protocol=pickle.HIGHEST_PROTOCOL)
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE_BOOT.format(fd=r)],
                pass_fds=(r, theirs.fileno(), note_w), env=_child_env(env),
                start_new_session=True,
            )
        except BaseException:
            for fd in (r, w, note_w):
                os.close(fd)
            mine.close()
            theirs.close()
            raise
        os.close(r)
        os.close(note_w)
        theirs.close()
        with os.fdopen(w, "wb") as f:
            f.write(header)

    @property
    def pid(self) -> Optional[int]:
        """Its pid while it runs; None once it was stopped."""
        return self._popen.pid if self.alive else None

    @property
    def launched_pid(self) -> int:
        """Its pid, also after it is gone (for diagnostics)."""
        return self._popen.pid

    def gone(self) -> bool:
        """Whether the zygote has exited (or was stopped)."""
        return not self.alive or self._popen.poll() is not None

    def get_start_method(self) -> str:
        return "zygote"

    def start(self, target: str, parcel: crossing.Parcel) -> Child:
        """Fork a worker running ``target(unpacked parcel)``; waits for the
        zygote to be ready (Ctrl-C interrupts the wait)."""
        note_r, note_w = _note_pipe()
        try:
            header = _header(target, -1, parcel)
            fds = [note_w, *parcel.fds]
            if len(fds) > _MAX_FDS:
                raise ValueError(f"fastload: a worker's start-up needs {len(fds)} fds; "
                                 f"at most {_MAX_FDS} can be passed")
            with self._lock:
                if not self.alive:
                    raise RuntimeError("fastload: the zygote is gone")
                socket.send_fds(self._ctl, [header], fds)
                os.close(note_w)
                note_w = -1
                pid = self._read_until_started()
        except BaseException:
            os.close(note_r)
            if note_w >= 0:
                os.close(note_w)
            raise
        return Child(pid, note_r, zygote=self)

    def _read_until_started(self) -> int:
        while True:
            msg = self._recv(None)
            if msg is None:
                code = self._popen.poll()
                raise RuntimeError(
                    "fastload: the zygote (the process workers are forked from) exited "
                    f"with code {code} before starting a worker; its stderr says why")
            if msg[:1] == b"S":
                return _STARTED.unpack(msg)[1]

    def preload(self, parcel: crossing.Parcel, token: int,
                timeout: Optional[float] = None) -> Tuple[int, str]:
        """Have the zygote unpickle session ``parcel`` (as :func:`crossing.
        unpack` in a worker would) and hold it as session ``token``, in place
        of the one it held; the workers it forks from then on inherit it
        (:func:`preloaded`). Returns the outcome (PRELOADED, DECLINED,
        TAINTED, or LOST: the zygote died or did not answer within
        ``timeout`` seconds) and, unless PRELOADED, why. Waits for the zygote
        to be ready (Ctrl-C interrupts the wait)."""
        fds = [-1, *parcel.fds]
        if len(fds) > _MAX_FDS:
            return DECLINED, f"the session holds {len(fds) - 1} fds; at most {_MAX_FDS - 1} can be passed"
        import multiprocessing

        me = multiprocessing.current_process()
        head = _PRELOAD_REQ + pickle.dumps({
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
                    if msg[:1] not in (_PRELOAD_REQ, _UNPICKLING):
                        continue  # an exit report
                    kind, got, outcome = _PRELOAD.unpack_from(msg)
                    if got != token:
                        continue  # about an earlier request (interrupted)
                    if kind == _PRELOAD_REQ:
                        return outcome, msg[_PRELOAD.size:].decode(errors="replace")
                    if timeout is not None:
                        deadline = time.monotonic() + timeout
        finally:
            if fds[0] >= 0:
                os.close(fds[0])

    def _recv(self, timeout: Optional[float]) -> Optional[bytes]:
        """One message (exit reports are filed on the way); None when the
        zygote is gone or nothing came within ``timeout``."""
        if timeout is not None and not select.select([self._ctl], [], [], timeout)[0]:
            return b""
        try:
            msg = self._ctl.recv(_PRELOAD.size + _WHY_MAX)
        except (ConnectionResetError, OSError):
            msg = b""
        if not msg:
            self.alive = False
            return None
        if msg[:1] == b"X":
            _x, pid, code = _EXITED.unpack(msg)
            self._exited[pid] = code
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
        self._popen.kill()  # it may still be importing torch: no need to wait for that
        self._popen.wait()


def memfd_of(data: bytes) -> int:
    """A new memfd holding ``data`` (close-on-exec)."""
    fd = os.memfd_create("fastload-dataset", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, len(data))
        if data:
            with mmap.mmap(fd, len(data)) as mm:
                mm[:] = data
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_memfd(fd: int) -> bytes:
    """The bytes of memfd ``fd``, which is closed."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            return mm[:]
    finally:
        os.close(fd)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> Dict[str, str]:
    """This process's open fds and what they are (the listing's own left out)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed since
            continue
    return out


def _opened_since(before: Dict[str, str]) -> List[str]:
    """Files this process opened since ``before`` (a :func:`_fds` snapshot)
    and holds, other than shared memory (which is meant to be shared)."""
    return [target for fd, target in sorted(_fds().items(), key=lambda kv: int(kv[0]))
            if before.get(fd) != target
            and not target.startswith(("/dev/shm/", "/memfd:", "/proc/"))]


def _tainted_by(threads_before: int) -> str:
    """Why this zygote is no longer safe to fork from, or ``""``."""
    if _threads() > threads_before:
        return "unpickling the session started threads in the zygote"
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return "unpickling the session initialised CUDA in the zygote"
    except Exception:  # noqa: BLE001
        pass
    return ""


def _preload(head: Dict[str, Any], fds: List[int], starting: Callable[[], Any]) -> Tuple[int, str]:
    """In the zygote: drop the session held, unpickle the one sent (``fds``:
    its blob's memfd, then the fds it refers to; all ours to close) and hold
    it, frozen, if workers may share it (see Zygote.preload). ``starting``
    is called as unpickling starts (the caller's time limit starts then)."""
    global _preloaded
    _preloaded = None  # the last session's objects go, but for reference cycles:
    gc.collect()  # the zygote's collector is off (see _serve); everything else is frozen
    gc.freeze()  # what stays (modules the last session imported) stays for good
    shared = fds[1:]
    try:
        data = read_memfd(fds[0])
    except BaseException as e:  # noqa: BLE001
        for fd in shared:
            os.close(fd)
        return DECLINED, f"reading the session failed: {e}"
    outcome, why = DECLINED, ""
    try:
        import multiprocessing

        sys.path[:] = head["sys_path"]
        sys.argv[:] = head["sys_argv"]
        multiprocessing.current_process().authkey = head["authkey"]
        threads, before = _threads(), _fds()
        starting()
        session = crossing.unpack(data, shared)  # closes the fds nobody took
        del data
        why = _tainted_by(threads)
        if why:
            outcome = TAINTED
        else:
            opened = _opened_since(before)
            if opened:
                why = f"unpickling the session opened {', '.join(opened[:4])}"
            else:
                _preloaded = (head["token"], session)
                outcome = PRELOADED
        del session
    except BaseException as e:  # noqa: BLE001 - the workers will meet it again and report it
        outcome, why = DECLINED, f"unpickling the session failed: {type(e).__name__}: {e}"
    return outcome, why


def _serve(header: Dict[str, Any]) -> None:
    """The zygote's loop (in the zygote process)."""
    sys.path[:] = header["sys_path"]
    os.close(header["note_fd"])
    for name in header["preload"]:
        try:
            __import__(name)
        except ImportError:
            traceback.print_exc()
    # Python's recipe for sharing pages with forked children: the collector
    # off here (a collection writes to every object it scans, which would
    # copy the pages a worker shares with us), objects frozen in the child
    # before it turns the collector back on. Torch's are frozen once here;
    # a preloaded session's stay unfrozen here, so that the next preload
    # can collect what reference cycles it leaves without rescanning torch.
    gc.collect()
    gc.freeze()
    gc.disable()
    ctl = socket.socket(fileno=header["ctl"])
    children: Dict[int, int] = {}  # pidfd -> pid
    while True:
        ready, _w, _x = select.select([ctl, *children], [], [])
        for fd in ready:
            if fd is ctl:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 20, _MAX_FDS + 3)
                except OSError:
                    msg, fds = b"", []
                if not msg:  # the training process stopped us, or died
                    for pid in children.values():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    for pid in children.values():
                        try:
                            os.waitpid(pid, 0)
                        except ChildProcessError:
                            pass
                    return
                if msg[:1] == _PRELOAD_REQ:
                    head = pickle.loads(msg[1:])
                    outcome, why = _preload(head, fds, lambda: ctl.send(
                        _PRELOAD.pack(_UNPICKLING, head["token"], 0)))
                    ctl.send(_PRELOAD.pack(b"P", head["token"], outcome)
                             + why.encode(errors="replace")[:_WHY_MAX])
                    continue
                pid = os.fork()
                if pid == 0:  # the worker
                    code = 1
                    try:
                        ctl.close()
                        for pfd in children:
                            os.close(pfd)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        gc.freeze()  # what it inherited, the session included
                        gc.enable()
                        h = pickle.loads(msg)
                        h["note_fd"] = fds[0]
                        code = _run(h, fds[1:])
                    finally:
                        os._exit(code)
                for f in fds:
                    os.close(f)
                children[os.pidfd_open(pid)] = pid
                ctl.send(_STARTED.pack(b"S", pid))
            else:
                pid = children.pop(fd)
                os.close(fd)
                _pid, status = os.waitpid(pid, 0)
                try:
                    ctl.send(_EXITED.pack(b"X", pid, os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
