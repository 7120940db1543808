"""The zygote process: fastload's fork server, the side that forks.

:class:`fastload.launching.zygote.Zygote` (in the main process)
starts a fresh interpreter whose :func:`fastload.launching.boot.boot` calls
:func:`serve`. It imports torch (and what else it is told to preload), turns
its garbage collector off, and then serves requests on its control socket
until the main process closes it. The requests it answers and the messages
it sends are described in :mod:`fastload.launching.zygote_protocol`.

One spawned interpreter is the *fork server* of the training process
(:func:`fastload.launching.fork_server.fork_server`): it imports torch once, and every
pool's zygote is forked from it, so a second, third, tenth loader starts
its workers in milliseconds instead of importing torch again.

A preloaded session is held in this module (:func:`preloaded` reads it in
a forked worker) and shared copy-on-write with the workers forked after it;
the gc recipe that keeps those pages shared is described in :func:`serve`.
When unpickling the session opens files, the zygote declines to hold it;
when it starts threads or a GPU context, the zygote is *tainted*: no longer
safe to fork from, so the main side replaces it.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import hashlib
import multiprocessing
import os
import pickle
import select
import signal
import socket
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, NoReturn, Optional, Set, Tuple

from . import parcels
from .entry import run
from .zygote_protocol import (DECLINED, EXITED, FORGET_REQ, IMPORT_REQ, MAX_FDS, MODULES,
                              MODULES_MAX, PRELOAD, PRELOAD_REQ, PRELOADED, STARTED, TAINTED,
                              UNPICKLING, WHY_MAX, ZYGOTE_REQ)

__all__ = ["serve", "preloaded"]

# In a zygote: the session it preloaded, (token, objects); inherited by the
# workers it forks. None when it holds none.
_preloaded: Optional[Tuple[int, Any]] = None
# In a zygote: the digest of the bytes and the identities of the fds of the session it
# holds (or held, until its workers were retired), and that session's objects:
# an identical session sent next is not unpickled again (see _preload).
_last: Optional[Tuple[bytes, List[Tuple[int, int]], Any]] = None
# In a zygote: why it is no longer safe to fork from after an import request
# ("" while it is), answered to its next preload.
_import_taint = ""


def preloaded(token: int) -> Any:
    """In a worker forked from a zygote: the session the zygote had
    preloaded when it forked it, which must be the one numbered ``token``."""
    if _preloaded is None or _preloaded[0] != token:
        have = None if _preloaded is None else _preloaded[0]
        raise RuntimeError(f"fastload: this worker was forked without the session it was told "
                           f"to inherit (session {token}; the zygote held {have})")
    return _preloaded[1]


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


def _tainted_by(threads_before: int, cause: str = "unpickling the session") -> str:
    """Why this zygote is no longer safe to fork from after ``cause``, or ``""``."""
    if _threads() > threads_before:
        return f"{cause} started threads in the zygote"
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return f"{cause} initialised CUDA in the zygote"
    except Exception:  # noqa: BLE001
        pass
    return ""


def _forget() -> None:
    """In the zygote: drop the session held, its memory back to the system."""
    global _preloaded, _last
    _preloaded = _last = None  # the last session's objects go, but for reference cycles:
    gc.collect()  # the zygote's collector is off (see serve); everything else is frozen


def _retire() -> None:
    """In the zygote: the workers of the session held are retired; no
    worker is forked with it again. Its objects are kept, unused, in case
    the next session is the same (the next epoch of an unchanged dataset):
    it then costs no unpickling (a dataset that reopens files or builds
    indexes in ``__setstate__`` pays that at every epoch otherwise)."""
    global _preloaded
    _preloaded = None


def _identities(fds: List[int]) -> List[Tuple[int, int]]:
    """What each fd refers to: the same memfd or file sent again (a dataset's
    tensors, its buffers' copies) has the same identity."""
    out = []
    for fd in fds:
        st = os.fstat(fd)
        out.append((st.st_dev, st.st_ino))
    return out


def _preload(head: Dict[str, Any], fds: List[int],
             starting: Callable[[], Any]) -> Tuple[int, str, List[str]]:
    """In the zygote: drop the session held, unpickle the one sent (``fds``:
    its parcel's memfd, then the fds it refers to; all ours to close) and hold
    it, frozen, if workers may share it (see
    fastload.launching.zygote.Zygote.preload).
    ``starting`` is called as unpickling starts (the caller's time limit
    starts then)."""
    global _preloaded, _last
    shared = fds[1:]
    try:
        data = parcels.read_memfd(fds[0])
        identities = _identities(shared)
    except BaseException as e:  # noqa: BLE001
        for fd in shared:
            os.close(fd)
        _forget()
        return DECLINED, f"reading the session failed: {e}", []
    digest = hashlib.blake2b(data).digest()
    if _last is not None and _last[0] == digest and _last[1] == identities:
        # The same bytes referring to the same shared memory and files: the
        # same objects, unpickled already.
        for fd in shared:
            os.close(fd)
        _preloaded = (head["token"], _last[2])
        return PRELOADED, "", []
    _forget()
    gc.freeze()  # what stays (modules the last session imported) stays for good
    outcome, why = DECLINED, ""
    imports: List[str] = []
    try:
        sys.path[:] = head["sys_path"]
        sys.argv[:] = head["sys_argv"]
        multiprocessing.current_process().authkey = head["authkey"]
        threads, before = _threads(), _fds()
        starting()
        with _recording_imports(imports):
            session = parcels.unpack(data, shared)  # closes the fds nobody took
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
                _last = (digest, identities, session)
                outcome = PRELOADED
        del session
    except BaseException as e:  # noqa: BLE001 - the workers will meet it again and report it
        outcome, why = DECLINED, f"unpickling the session failed: {type(e).__name__}: {e}"
    # All of them, those this zygote had already (imported ahead, see
    # IMPORT_REQ) included: the fork server may not have them.
    return outcome, why, list(dict.fromkeys(imports)) if outcome == PRELOADED else []


@contextlib.contextmanager
def _recording_imports(out: List[str]) -> Iterator[None]:
    """Record in ``out`` the modules imported directly (not by other
    modules' imports) while the block runs, in order: what unpickling asks
    ``__import__`` for. Imported in that order elsewhere (the fork server),
    they run the same module code in the same order: importing every module
    that ends up loaded, one by one, would not (a library that configures
    another before importing it, as Ultralytics sets OpenCV's threads)."""
    original = builtins.__import__
    depth = 0

    def recording(name: str, globals: Any = None, locals: Any = None,
                  fromlist: Any = (), level: int = 0) -> Any:
        nonlocal depth
        if depth == 0 and level == 0:
            out.append(name)
        depth += 1
        try:
            return original(name, globals, locals, fromlist, level)
        finally:
            depth -= 1

    builtins.__import__ = recording
    try:
        yield
    finally:
        builtins.__import__ = original


def serve(header: Dict[str, Any]) -> None:
    """The zygote's loop (in the zygote process): answer requests until the
    main process closes the control socket."""
    _prepare(header)
    _serve(socket.socket(fileno=header["ctl"]))


def _serve(ctl: socket.socket) -> None:
    children: Dict[int, int] = {}  # pidfd -> pid, workers and zygotes
    zygotes: Set[int] = set()  # the pids of zygotes forked from this one
    while True:
        ready, _w, _x = select.select([ctl, *children], [], [])
        for fd in ready:
            if fd is not ctl:
                zygotes.discard(_report_exit(ctl, children, fd))
                continue
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 20, MAX_FDS + 3)
            except OSError:
                msg, fds = b"", []
            if not msg:  # the training process stopped us, or died
                _end_children({pfd: pid for pfd, pid in children.items() if pid not in zygotes})
                ctl.close()
                return
            if msg[:1] == PRELOAD_REQ:
                _answer_preload(ctl, msg, fds)
            elif msg == FORGET_REQ:
                _retire()
            elif msg[:1] == IMPORT_REQ:
                _import(msg)
            elif msg == ZYGOTE_REQ:
                zygotes.add(_fork(ctl, fds, children, _be_zygote, msg))
            else:
                _fork(ctl, fds, children, _be_worker, msg)


def _prepare(header: Dict[str, Any]) -> None:
    """Import what workers share, then stop the collector from touching it."""
    sys.path[:] = header["sys_path"]
    os.close(header["note_fd"])
    # The zygote reaps its workers and reports their exit status: a SIGCHLD
    # ignored in the training process (SIG_IGN survives exec) would have the
    # kernel reap them, the status lost and waitpid() failing.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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


def _import(msg: bytes) -> None:
    """Import the modules the request ``msg`` names (see IMPORT_REQ)."""
    global _import_taint
    head = pickle.loads(msg[1:])
    sys.path[:] = head["sys_path"]
    threads, before = _threads(), _fds()
    for name in head["modules"]:
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - the session meets it again and reports it
            pass
    cause = "importing the loader's modules"
    why = _tainted_by(threads, cause)
    opened = _opened_since(before)
    if opened and not why:  # workers forked from here would share the files' offsets
        why = f"{cause} opened {', '.join(opened[:4])}"
    if why and not _import_taint:
        _import_taint = why
    # The modules stay for good, as torch's do (see _prepare): frozen, so
    # that no process forked from here scans (and copies) their pages when
    # it collects.
    gc.collect()
    gc.freeze()


def _answer_preload(ctl: socket.socket, msg: bytes, fds: List[int]) -> None:
    """Preload the session request ``msg`` sends and answer with the outcome."""
    head = pickle.loads(msg[1:])
    if _import_taint:
        for fd in fds:
            os.close(fd)
        _send(ctl, PRELOAD.pack(b"P", head["token"], TAINTED) + _import_taint.encode()[:WHY_MAX])
        return
    outcome, why, names = _preload(head, fds, lambda: _send(
        ctl, PRELOAD.pack(UNPICKLING, head["token"], 0)))
    if names:
        data = MODULES + pickle.dumps(names, protocol=pickle.HIGHEST_PROTOCOL)
        while len(data) > MODULES_MAX:  # keep the first imported: they import the rest
            names = names[: len(names) // 2]
            data = MODULES + pickle.dumps(names, protocol=pickle.HIGHEST_PROTOCOL)
        _send(ctl, data)
    _send(ctl, PRELOAD.pack(b"P", head["token"], outcome) + why.encode(errors="replace")[:WHY_MAX])


def _send(ctl: socket.socket, data: bytes) -> None:
    """Send to the training process; if it is gone (killed while this
    zygote was busy), say nothing: the serve loop reads its end next and
    stops."""
    try:
        ctl.send(data)
    except OSError:
        pass


def _fork(ctl: socket.socket, fds: List[int], children: Dict[int, int],
          be: Callable[[socket.socket, bytes, List[int], Dict[int, int]], NoReturn],
          msg: bytes) -> int:
    """Fork the child request ``msg`` asks for (a worker, or a zygote: see
    :func:`_be_worker`, :func:`_be_zygote`; ``fds`` are the child's), tell
    the main process its pid, and return it."""
    pid = os.fork()
    if pid == 0:
        be(ctl, msg, fds, children)
    for f in fds:
        os.close(f)
    children[os.pidfd_open(pid)] = pid
    _send(ctl, STARTED.pack(b"S", pid))
    return pid


def _be_zygote(ctl: socket.socket, msg: bytes, fds: List[int], children: Dict[int, int]) -> NoReturn:
    """In a zygote forked from the fork server: drop the server's sockets and
    children, take the training process's stdout and stderr (``fds[2:4]``,
    if sent), then serve the control socket in ``fds[0]`` (``fds[1]``: a
    death note it does not need); never returns."""
    global _preloaded, _last
    code = 1
    try:
        ctl.close()
        for pfd in children:
            os.close(pfd)
        for fd, std in zip(fds[2:4], (1, 2)):
            os.dup2(fd, std)
            os.close(fd)
        os.close(fds[1])
        _preloaded = _last = None  # (an import taint of the server's is inherited, and told)
        _serve(socket.socket(fileno=fds[0]))
        code = 0
    except BaseException:  # noqa: BLE001 - shown on stderr; the main side sees the exit
        traceback.print_exc()
    finally:
        os._exit(code)


def _be_worker(ctl: socket.socket, msg: bytes, fds: List[int], children: Dict[int, int]) -> NoReturn:
    """In the forked worker: drop the zygote's fds, freeze what it inherited
    (the preloaded session included), run the entry point; never returns."""
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
        code = run(h, fds[1:])
    finally:
        os._exit(code)


def _report_exit(ctl: socket.socket, children: Dict[int, int], pidfd: int) -> int:
    """Reap the child whose pidfd turned readable, report its exit code and
    return its pid."""
    pid = children.pop(pidfd)
    os.close(pidfd)
    _pid, status = os.waitpid(pid, 0)
    _send(ctl, EXITED.pack(b"X", pid, os.waitstatus_to_exitcode(status)))
    return pid


def _end_children(children: Dict[int, int]) -> None:
    """Kill and reap every worker still running (the main process is gone or stopping us)."""
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
