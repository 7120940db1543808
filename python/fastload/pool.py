"""The worker pool: one ring and the processes that fill it.

Owned by one loader iterator, or kept warm by its loader between
iterators. Workers are forked from the pool's zygote by default, afresh for
each session (:meth:`WorkerPool.start_session`: the zygote unpickles the
session once and its workers share it); spawned or forked workers (an
explicit start method) are started with the pool and kept across sessions.
:meth:`WorkerPool.shutdown` stops them,
escalating from the ring's shutdown flag to SIGTERM to SIGKILL, and is also
run by a finalizer, so a pool dropped without shutdown (``break``, an
exception, ``del``) still leaves no process behind. The memory needs no
clean-up: a memfd disappears with the last process holding it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import socket
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from . import _core, crossing, launch
from .launch import Zygote
from ._ring import FdHandle, RingHandle
from .ledger import Record, Role, SlotLedger
from .wire import STACK_SIGNAL, encode_session, hidden_env, recv_overflow, send_session
from .worker import WorkerSpec, worker_main

log = logging.getLogger("fastload")

_WORKER_MAIN = "fastload.worker:worker_main"


def launcher_of(ctx: Any) -> Optional[str]:
    """'zygote' or 'spawn' when fastload starts the workers itself (they then
    never run ``__main__``), None for a multiprocessing context that forks
    from this process (workers inherit the dataset, as DataLoader's)."""
    if ctx == ZYGOTE:
        return "zygote"
    method = ctx if isinstance(ctx, str) else ctx.get_start_method()
    if method == "spawn":
        return "spawn"
    if method == "forkserver":  # a fork server that imports nothing of __main__
        return "zygote"
    return None


def _stop(ring: "_core.Ring", procs: List[multiprocessing.process.BaseProcess],
          socks: List[socket.socket], overflow_fds: Dict[int, int], stack_fds: List[int],
          zygotes: List[Zygote], owner_pid: int, grace_s: float = 2.0) -> None:
    """Stop workers and release our ends; idempotent; safe at interpreter exit.

    In a process forked from the owner (which inherited the pool object and
    may collect it) only this process's copies of the fds are closed: the
    ring, the workers and the zygote are the owner's."""
    if os.getpid() != owner_pid:
        _close_fds(socks, overflow_fds, stack_fds, ring)
        return
    try:
        ring.shutdown()
    except Exception:  # pragma: no cover - never let clean-up raise
        pass
    for i, p in enumerate(procs):
        try:
            # Still starting (importing torch): it would only see the
            # shutdown flag seconds from now. Nothing of ours runs in it yet.
            if p.pid is not None and ring.worker_pid(i) == 0 and p.is_alive():
                p.terminate()
        except Exception:  # pragma: no cover
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # pragma: no cover
            pass
    for p in procs:
        try:
            if p.pid is not None and p.is_alive():
                log.warning("fastload worker pid %s did not stop in %.1fs; terminating it",
                            p.pid, grace_s)
                p.terminate()
                p.join(1.0)
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
        except Exception:  # pragma: no cover
            pass
    for zygote in zygotes:  # after its workers
        try:
            zygote.stop()
        except Exception:  # pragma: no cover
            pass
    for p in procs:
        if isinstance(p, launch.Child):
            p.close()  # its pidfd and death-note pipe; its exit code stays readable
    _close_fds(socks, overflow_fds, stack_fds, ring)


def _close_fds(socks: List[socket.socket], overflow_fds: Dict[int, int], stack_fds: List[int],
               ring: "_core.Ring") -> None:
    for fd in [*overflow_fds.values(), *stack_fds]:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover
            pass
    overflow_fds.clear()
    stack_fds.clear()
    for s in socks:
        try:
            s.close()
        except Exception:  # pragma: no cover
            pass
    try:
        ring.close_fd()
    except Exception:  # pragma: no cover
        pass


class WorkerPool:
    """Main side: a ring and ``num_workers`` processes feeding it.

    A pool outlives one iterator when the loader keeps it warm: the next
    iterator starts a new *session* on it (the dataset re-sent, workers
    reseeded) instead of building a new ring and starting interpreters
    again. Its :class:`SlotLedger` says what every slot out of the free list
    is doing, across iterators.

    Workers forked from the zygote are started by each session, not by the
    pool: the zygote first unpickles the session (:meth:`Zygote.preload`),
    so the workers forked from it share those objects' pages copy-on-write
    instead of unpickling a copy each; the last session's workers are
    retired. Spawned and forked workers start with the pool and serve every
    session (the objects are sent to each of them).
    """

    def __init__(
        self,
        *,
        ctx: Any,
        num_workers: int,
        num_slots: int,
        slot_bytes: int,
        hide_accelerators: bool,
        force_shm: bool = False,
        zygote: Optional[Zygote] = None,
        inherited: Optional[tuple] = None,
    ) -> None:
        self.config = (ctx, num_workers, num_slots, slot_bytes, hide_accelerators, force_shm)
        self.ring = _core.Ring.create(num_slots, num_workers, slot_bytes, force_shm)
        self.num_workers = num_workers
        # Whether every worker's death wakes the ring's waits (pidfds); if
        # not, the iterator checks liveness between short waits.
        self.deaths_watched = True
        self.procs: List[multiprocessing.process.BaseProcess] = []
        self._socks: List[socket.socket] = []
        self._stack_fds: List[int] = []  # one memfd per worker for its stack dump
        self._overflow_fds: Dict[int, int] = {}  # seq -> fd received early
        # Through a weak reference: a ledger holding its pool would keep the
        # pool (and its workers) alive until a garbage collection.
        close = weakref.WeakMethod(self._close_overflow)
        self.ledger = SlotLedger(self.ring, lambda w, seq: _call_if_alive(close, w, seq))
        # fastload.pinning.PinnedRing when batches are pinned in place; leases
        # handed out keep it alive past the pool.
        self._pinner: Optional[Any] = None
        # The default: workers forked from this pool's own zygote (one the
        # loader started ahead, or a new one).
        self._launcher = launcher_of(ctx)
        # The session objects themselves, for workers forked from this
        # process (what only fork can hand over). Such a pool serves one
        # session: a later one must see the objects as they are then.
        self._inherited = inherited
        if inherited is not None and self._launcher is not None:
            raise ValueError("fastload: an inherited session needs workers forked from this process")
        # Every zygote this pool used (a lost one is replaced when a worker
        # must be restarted); the last is the current one.
        self._zygotes: List[Zygote] = []
        if self._launcher == "zygote":
            self._zygotes.append(zygote if zygote is not None else start_zygote(hide_accelerators))
        elif zygote is not None:
            zygote.stop()
        # Preloading (zygote workers): the number of the session the current
        # zygote holds (None: none), the zygote holding it, and, per worker,
        # the session it was forked with. Sessions are numbered per pool.
        self._session_numbers = itertools.count(1)
        self._preloaded: Optional[int] = None
        self._preload_zygote: Optional[Zygote] = None
        self._forked_with: List[Optional[int]] = [None] * num_workers
        self._preload_ok = True  # False once a session of this pool could not be preloaded
        self._finalizer = weakref.finalize(self, _stop, self.ring, self.procs, self._socks,
                                           self._overflow_fds, self._stack_fds, self._zygotes,
                                           os.getpid())
        self._ctx = ctx
        self._hide = hide_accelerators
        self._handle = RingHandle(self.ring)
        if self._launcher != "zygote":  # zygote workers start with each session
            try:
                for i in range(num_workers):
                    self._start_worker(i)
            except BaseException:
                self.shutdown()
                raise
        log.debug("fastload: pool of %d workers (%s), ring %d x %d bytes (%s)", num_workers,
                  self._launcher or self._ctx.get_start_method(), num_slots, self.ring.slot_bytes,
                  self.ring.backend)

    def _start_worker(self, i: int) -> None:
        """Start worker ``i`` (a new one, or the replacement of a dead one)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stack_fd = os.memfd_create(f"fastload-stack-{i}", os.MFD_CLOEXEC)
        if i < len(self.procs):
            self._socks[i].close()
            os.close(self._stack_fds[i])
            self._socks[i], self._stack_fds[i] = mine, stack_fd
        else:
            self._socks.append(mine)
            self._stack_fds.append(stack_fd)
        spec = WorkerSpec(
            ring=self._handle,
            sock=theirs,
            worker_id=i,
            num_workers=self.num_workers,
            parent_pid=os.getpid(),
            hide_accelerators=self._hide,
            stack_file=FdHandle(stack_fd),
            session=self._inherited,
        )
        try:
            if self._launcher is None:  # fork: the spec is inherited, not pickled
                p = self._ctx.Process(target=worker_main, args=(spec,),
                                      name=f"fastload-worker-{i}", daemon=True)
                p.start()
            else:
                parcel = crossing.pack(spec, "worker spec")
                try:
                    if self._launcher == "zygote":
                        zygote = self._current_zygote()
                        p = zygote.start(_WORKER_MAIN, parcel)
                        self._forked_with[i] = (self._preloaded if zygote is self._preload_zygote
                                                else None)
                    else:
                        p = launch.spawn(_WORKER_MAIN, parcel, env=hidden_env(self._hide))
                finally:
                    parcel.close()
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
        fd = p.pidfd if isinstance(p, launch.Child) else None
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
            self.ring.watch_worker(i, fd)
        except RuntimeError as e:  # out of fds, or no thread to be had
            log.warning("fastload: cannot watch worker %d (%s); polling its liveness instead", i, e)
            self.deaths_watched = False
        finally:
            if owned is not None:
                os.close(owned)

    @property
    def _zygote(self) -> Optional[Zygote]:
        return self._zygotes[-1] if self._zygotes else None

    def _current_zygote(self) -> Zygote:
        """The zygote to fork from; a new one if the last was lost (the OOM
        killer likes its size)."""
        zygote = self._zygotes[-1]
        if zygote.gone():
            log.warning("fastload: the zygote the workers are forked from is gone; "
                        "starting a new one")
            self._zygotes.append(start_zygote(self._hide))
        return self._zygotes[-1]

    def replace_worker(self, w: int) -> None:
        """Replace dead (or hung: it is killed) worker ``w`` by a new process;
        the old one has exited when this returns. Overflow fds it sent before
        dying are kept. The caller starts the new worker's session."""
        old = self.procs[w]
        self.ring.unwatch_worker(w)  # its death is handled here
        if old.exitcode is None:
            old.kill()
        old.join(5.0)
        if isinstance(old, launch.Child):
            old.close()
        self._collect_overflow(w)
        self.ring.reset_worker(w)
        self._start_worker(w)

    def _collect_overflow(self, w: int) -> None:
        """Keep the overflow fds worker ``w`` sent and nobody read yet (its
        channel is about to be replaced)."""
        sock = self._socks[w]
        sock.setblocking(False)
        try:
            while True:
                seq, fd = recv_overflow(sock)
                if fd is None:
                    break
                self._overflow_fds[seq] = fd  # type: ignore[index]
        except (BlockingIOError, InterruptedError):
            pass
        except ConnectionResetError:
            # It died with our session message unread: nothing of its to keep.
            pass

    def _retire_workers(self) -> List[multiprocessing.process.BaseProcess]:
        """Retire every worker (a new session gets fresh ones); returns the
        processes, which exit on their own at their next look at the ring."""
        old = list(self.procs)
        for w, p in enumerate(old):
            self.ring.unwatch_worker(w)  # it exits on purpose
            if p.exitcode is None and self.ring.worker_pid(w) == 0:
                # Not attached to the ring yet (a previous iterator was dropped
                # at once): it would attach to the new queue. No code of ours
                # runs in it yet.
                p.kill()
                p.join(5.0)
            self._collect_overflow(w)
            self.ring.reset_worker(w)  # its next next_task() answers SHUTDOWN
        return old

    def _fresh_workers(self, parcel: crossing.Parcel, timeout: Optional[float]) -> None:
        """A new session of a zygote pool: retire the workers, have the
        zygote preload ``parcel`` and fork fresh workers from it."""
        old = self._retire_workers()
        self._preloaded = self._preload_zygote = None
        number = next(self._session_numbers)
        if self._preload_ok:
            zygote = self._current_zygote()
            outcome, why = zygote.preload(parcel, number, timeout)
            if outcome == launch.PRELOADED:
                self._preloaded, self._preload_zygote = number, zygote
            else:
                # The dataset is the same next epoch: don't pay its unpickling
                # in the zygote again. Each worker unpickles its own copy.
                self._preload_ok = False
                level = logging.DEBUG if outcome == launch.DECLINED else logging.WARNING
                log.log(level, "fastload: workers unpickle the dataset themselves "
                               "(not shared through the zygote): %s", why)
                if outcome != launch.DECLINED:
                    # Threads or a GPU context in it, or stuck: fork from a new one.
                    zygote.stop()
                    self._zygotes.append(start_zygote(self._hide))
        # The retired workers are gone before new ones attach (one queue each).
        deadline = time.monotonic() + 2.0
        for p in old:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.warning("fastload: retired worker pid %s did not exit; killing it", p.pid)
                p.kill()
                p.join(5.0)
            if isinstance(p, launch.Child):
                p.close()
        for i in range(self.num_workers):
            self._start_worker(i)

    @property
    def pids(self) -> Tuple[int, ...]:
        return tuple(p.pid for p in self.procs)  # type: ignore[misc]

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and not self.dead_workers()

    @property
    def pinner(self) -> Optional[Any]:
        """The :class:`fastload.pinning.PinnedRing` of this pool, if pinned."""
        return self._pinner

    def pin(self, runtime: Any) -> Any:
        """Register the ring as pinned memory with ``runtime`` (once per pool)."""
        if self._pinner is None:
            from .pinning import PinnedRing

            self._pinner = PinnedRing(self.ring, runtime)
            self.ledger.use_gate(self._pinner.gate)
        return self._pinner

    @property
    def reusable(self) -> bool:
        """Whether a later iterator may start a session on this pool."""
        return self._inherited is None

    def start_session(self, parcel: Optional[crossing.Parcel], base_seed: int,
                      workers: Optional[List[int]] = None,
                      resume: Optional[List[Optional[bytes]]] = None,
                      preload_timeout: Optional[float] = None) -> List[Record]:
        """Start a session on every worker (or, for replacement workers, on
        those in ``workers``): its seeds, its objects and, to resume, the
        state to put its generators back to (``resume[w]``); returns the
        session records, which the ledger frees when they complete.

        The objects (``parcel``: the pickled dataset and the fds of what it
        shares) reach a worker by inheritance where they can: a whole
        session of a zygote pool forks fresh workers from a zygote that has
        unpickled ``parcel`` (``preload_timeout``: how long it may take), as
        does a replacement forked while it holds it; ``parcel`` is None for a
        pool whose workers were forked from this process with the objects.
        Other workers are sent ``parcel`` and unpickle it themselves."""
        targets = range(self.num_workers) if workers is None else workers
        states = resume if resume is not None else [None] * self.num_workers
        if parcel is None:
            assert self._inherited is not None
            return [self.ledger.assign(Role.SESSION, w, encode_session(base_seed, True, states[w]))
                    for w in targets]
        if workers is None and self._launcher == "zygote":
            self._fresh_workers(parcel, preload_timeout)
        fd = None
        try:
            records = []
            for w in targets:
                number = self._forked_with[w]
                if number is not None and number == self._preloaded:
                    task = encode_session(base_seed, resume=states[w], preloaded=number)
                else:
                    if fd is None:
                        fd = launch.memfd_of(parcel.data)
                    self.ledger.make_free(1)
                    send_session(self._socks[w], [fd, *parcel.fds])
                    task = encode_session(base_seed, False, states[w])
                records.append(self.ledger.assign(Role.SESSION, w, task))
            return records
        finally:
            if fd is not None:
                os.close(fd)

    def death_note(self, worker: int) -> str:
        """What worker ``worker`` wrote before dying at start-up, if anything."""
        note = getattr(self.procs[worker], "death_note", "")
        return note if isinstance(note, str) else ""

    def worker_stack(self, worker: int, wait_s: float = 0.5) -> str:
        """The worker's Python stack, dumped by faulthandler on request."""
        fd = self._stack_fds[worker]
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)  # the offset is shared with the worker's dup
        pid: int = self.procs[worker].pid  # type: ignore[assignment]
        note = ""
        try:
            if _is_stopped(pid):  # SIGSTOP/SIGTSTP: it could not answer
                os.kill(pid, signal.SIGCONT)
                note = "(the worker was stopped by a signal; it was resumed to dump this)\n"
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return "(the worker is gone)"
        deadline = time.monotonic() + wait_s
        text = b""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            text = os.pread(fd, 1 << 20, 0)
            if text.endswith(b"\n") and b"most recent call first" in text:
                time.sleep(0.05)  # let the other threads' stacks follow
                text = os.pread(fd, 1 << 20, 0)
                break
        stack = text.decode(errors="replace").rstrip() or "(no stack: the worker did not answer)"
        return note + stack

    def dead_workers(self) -> List[Tuple[int, int, int]]:
        """(worker id, pid, exit code) of every worker that has exited."""
        out = []
        for i, p in enumerate(self.procs):
            code = p.exitcode
            if code is not None:
                out.append((i, p.pid, code))  # type: ignore[arg-type]
        return out

    def recv_overflow(self, worker: int, seq: int) -> int:
        """The overflow segment fd a worker sent for batch ``seq``."""
        fd = self._overflow_fds.pop(seq, None)
        sock = self._socks[worker]
        while fd is None:
            got, got_fd = recv_overflow(sock)
            if got_fd is None:
                raise RuntimeError(f"fastload: worker {worker} closed its channel before sending "
                                   f"the overflow data of batch {seq}")
            if got == seq:
                fd = got_fd
            else:
                self._overflow_fds[got] = got_fd  # type: ignore[index]
        return fd

    def _close_overflow(self, worker: int, seq: int) -> None:
        os.close(self.recv_overflow(worker, seq))

    def drop_overflow(self, seq: int) -> None:
        """Forget an overflow fd of a batch nobody will read."""
        fd = self._overflow_fds.pop(seq, None)
        if fd is not None:
            os.close(fd)

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._pinner = None
        self.ledger.forget()
        self._finalizer()


def _call_if_alive(method: "weakref.WeakMethod[Any]", *args: Any) -> None:
    fn = method()
    if fn is not None:
        fn(*args)


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def describe_exit(pid: int, exitcode: int, note: str = "") -> str:
    """DataLoader's wording for a worker that died; with the worker's own
    last words when it left some (an error at start-up)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
            desc = signal.strsignal(-exitcode) or name
        except ValueError:
            desc = f"signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {desc}. "
    if note:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                f"It failed with:\n{note}\n")
    return (
        f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
        "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
        "better error trace. "
    )


# multiprocessing_context=None: each pool forks its workers from a zygote of
# its own (fastload.launch.Zygote). An explicit 'spawn' is always real spawn.
ZYGOTE = "fastload-zygote"


def start_zygote(hide_accelerators: bool) -> Zygote:
    """A zygote launched now, in the background (see launch.Zygote)."""
    return Zygote(hide_accelerators, env=hidden_env(hide_accelerators))


def default_context() -> Any:
    return ZYGOTE


