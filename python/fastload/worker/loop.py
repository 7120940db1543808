"""The worker process: take a task from the ring, make the batch in its slot.

Runs in a process started by :mod:`fastload.pool.worker_pool` (forked from a zygote by
default, see :mod:`fastload.launching`). It never touches an accelerator: the
pool hides them through the environment before anything here runs. The loop
polls the ring with a timeout, so it notices shutdown and the death of the
main process on its own.

The tasks it takes and the results it commits are described in
:mod:`fastload.common.protocol`; what a session holds (the dataset replica, its seeds
and fetcher) is :mod:`fastload.worker.session`.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing.util
import os
import select
import signal
import socket
import threading
import time
from typing import Any, List, Optional, Tuple

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import collate, signal_handling

from .. import _core
from .._core import WaitResult
from ..launching import parcels
from ..launching import zygote_main
from ..transport import overflow
from ..transport.writer import SlotWriter
from ..common.protocol import (ACCELERATOR_ENV, FLAG_OVERFLOW, STACK_SIGNAL, FetchTask, Kind,
                               SessionTask, WorkerSpec, decode_task, recv_session_fds)
from .session import Session

_POLL_S = 0.5


class _MainWatch:
    """Tells when the main process (not necessarily our parent: under
    forkserver the parent is the server) has exited.

    A pidfd, opened at start while the main process is waiting for us, turns
    readable when it exits (a zombie included) and cannot be fooled by pid
    reuse. Without pidfd_open (Linux < 5.3), a signal-0 probe.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: Optional[int] = None
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pass

    def gone(self, wait: Optional[float] = 0.0) -> bool:
        if self.fd is not None:
            return bool(select.select([self.fd], [], [], wait)[0])
        if wait:
            time.sleep(wait)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

    def exit_when_gone(self) -> None:
        # Ends the worker when the main process is gone even while the loop
        # is busy in dataset code (the loop checks too, between tasks).
        while not self.gone(wait=None if self.fd is not None else 1.0):
            pass
        os._exit(0)


def _describe_indices(index: Any, limit: int = 16) -> str:
    if isinstance(index, (list, tuple)):
        if all(i is None for i in index):
            return ""
        shown = ", ".join(repr(i) for i in index[:limit])
        more = f", ... ({len(index)} in all)" if len(index) > limit else ""
        return f", sample indices [{shown}{more}]"
    if index is None:
        return ""
    return f", sample index {index!r}"


def _where(session: Session, task: FetchTask) -> str:
    """Where an error making ``task``'s batch arose, for its message (made
    only then: describing a batch's indices costs microseconds per batch)."""
    return (f"{session.where} (batch {task.batch_idx} of the epoch"
            f"{_describe_indices(task.index)})")


def recv_session(sock: socket.socket) -> Tuple[bytes, List[int]]:
    """The session the pool sent: the pickled bytes and the fds of what the
    dataset shares."""
    fds = recv_session_fds(sock)
    return parcels.read_memfd(fds[0]), fds[1:]


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process. The steps run in this order: isolate
    the process, join the ring, make the default collate stack into slots,
    then take tasks until shutdown."""
    main_watch = _isolate(spec)
    ring = _join_ring(spec)
    loop = _TaskLoop(spec, ring, main_watch)
    _stack_into_slots(loop.writer)
    try:
        loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        spec.sock.close()  # else it is collected unclosed (a ResourceWarning under -X dev)
        _run_multiprocessing_exit_finalizers()


# How long a worker at its end waits for multiprocessing's exit finalizers:
# DataLoader's shutdown gives each worker this long to exit before it
# terminates it (torch's MP_STATUS_CHECK_INTERVAL).
EXIT_FINALIZERS_TIMEOUT = 5.0


def _run_multiprocessing_exit_finalizers() -> None:
    """Run what a ``multiprocessing.Process`` runs as it ends (DataLoader's
    workers are such processes): above all, each ``multiprocessing.Queue``
    this worker put to has a feeder thread that writes the items to its pipe
    a moment after ``put()``, and the finalizers wait for it. The worker then
    ends with ``os._exit`` (no interpreter teardown), which would drop what
    those threads still held. Bounded, as DataLoader bounds its wait for a
    worker: a queue nobody reads can hold a feeder forever.

    ``multiprocessing.util._exit_function`` is private; it is what
    ``Process._bootstrap`` calls, and it does nothing the second time (a
    worker started by ``multiprocessing.Process`` runs it again on return).
    ``tests/test_zygote.py`` pins it."""
    t = threading.Thread(target=multiprocessing.util._exit_function,
                         name="fastload-exit-finalizers", daemon=True)
    t.start()
    t.join(EXIT_FINALIZERS_TIMEOUT)


def _isolate(spec: WorkerSpec) -> _MainWatch:
    """First of all: hide the accelerators, ignore Ctrl-C, arm the stack
    dump (``STACK_SIGNAL``), and watch the main process."""
    if spec.hide_accelerators:
        for var in ACCELERATOR_ENV:
            os.environ[var] = ""
    # Ctrl-C goes to the whole process group; the main process handles it and
    # shuts the pool down. A worker dying of it would only blur the error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(STACK_SIGNAL, file=spec.stack_file.fd, all_threads=True)
    main_watch = _MainWatch(spec.parent_pid)
    threading.Thread(target=main_watch.exit_when_gone, daemon=True).start()
    return main_watch


def _join_ring(spec: WorkerSpec) -> _core.WorkerRing:
    """DataLoader's worker signal handlers, one torch thread and the process
    name ``top`` and ``ps`` show, as its workers have; then the ring, told
    that this worker has started."""
    signal_handling._set_worker_signal_handlers()
    torch.set_num_threads(1)
    try:  # what torch.multiprocessing._set_thread_name does, through /proc
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("pt_data_worker")
    except OSError:  # pragma: no cover - no /proc
        pass
    ring = spec.ring.get()
    ring.worker_started(spec.worker_id, os.getpid())
    return ring


def _stack_into_slots(writer: SlotWriter) -> None:
    """Make the default collate stack tensors into the slot ``writer`` is
    writing, instead of into torch's /dev/shm-backed shared storage (what
    DataLoader's workers do): that is both the zero-copy path and what keeps
    a 64 MB /dev/shm out of the picture. Same semantics and errors as
    torch's collate_tensor_fn."""
    torch_collate_tensor = collate.collate_tensor_fn

    def collate_tensor_into_slot(batch: Any, *, collate_fn_map: Any = None) -> Any:
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided or elem.device.type != "cpu":
            return torch_collate_tensor(batch, collate_fn_map=collate_fn_map)
        # Outside the batch's collate: plain memory, never torch's /dev/shm.
        shape = (len(batch), *elem.shape)
        out = writer.alloc_tensor(shape, elem.dtype)
        if out is None:  # bigger than the slot: plain memory, contiguous like DataLoader's
            out = torch.empty(shape, dtype=elem.dtype)
        return torch.stack(batch, 0, out=out)

    collate.default_collate_fn_map[torch.Tensor] = collate_tensor_into_slot


class _TaskLoop:
    """A worker's loop: take the next task its ring queue holds, do it in
    the task's slot, commit the result (see :mod:`fastload.common.protocol`)."""

    def __init__(self, spec: WorkerSpec, ring: _core.WorkerRing, main_watch: _MainWatch) -> None:
        self._spec = spec
        self._ring = ring
        self._main_watch = main_watch
        payload = ring.payload_region()
        self._mv = memoryview(payload).cast("B")
        self._slot_bytes = ring.slot_bytes
        self.writer = SlotWriter(payload, self._slot_bytes)
        self._session: Optional[Session] = None

    def run(self) -> None:
        """Until the ring shuts this worker down or the main process is gone."""
        ring, slot_bytes, mv = self._ring, self._slot_bytes, self._mv
        while True:
            status, slot, seq, task_len = ring.next_task(_POLL_S)
            if status == WaitResult.TIMED_OUT:
                if self._main_watch.gone():
                    break
                continue
            if status == WaitResult.SHUTDOWN:
                break
            start = slot * slot_bytes
            task = decode_task(mv[start : start + task_len])
            if isinstance(task, SessionTask):
                self._session = None  # drop the old replica before unpickling the new one
                self._session = self._new_session(task)
                ring.commit(slot, Kind.DATA, 0, 0, 0)
                continue
            assert self._session is not None, "fastload: a fetch task before any session"
            self._fetch(self._session, slot, seq, task, time.perf_counter_ns())

    def _new_session(self, task: SessionTask) -> Session:
        """The session a session task starts, its objects taken from where
        the task says."""
        spec = self._spec
        if task.preloaded is not None:  # preloaded by the zygote that forked us
            load = functools.partial(zygote_main.preloaded, task.preloaded)
        elif task.inherited:  # inherited at fork from the training process
            load = lambda: spec.session  # noqa: E731
        else:
            data, fds = recv_session(spec.sock)
            load = functools.partial(parcels.unpack, data, fds)
        return Session(load, task.base_seed, spec.worker_id, spec.num_workers,
                        self.writer.collating, task.resume)

    def _fetch(self, session: Session, slot: int, seq: int, task: FetchTask, t0: int) -> None:
        """A fetch task: the batch, or what stands in for it (the replica's
        end, the session's set-up error). ``t0``: when the task was taken
        (``time.perf_counter_ns``), for the batch's make time."""
        if task.epoch != session.epoch:
            session.new_epoch(task.epoch)
        if session.iteration_end:
            self._ring.commit(slot, Kind.EXHAUSTED, 0, 0, 0)
            return
        if session.init_exception is not None:
            self._commit_error(slot, session.init_exception, session.capture())
            return
        self._make_batch(session, slot, seq, task, t0)

    def _make_batch(self, session: Session, slot: int, seq: int, task: FetchTask,
                    t0: int) -> None:
        """Fetch and collate the batch into ``slot``, then commit it (or the
        error that stopped it)."""
        index = task.index
        writer = self.writer
        writer.begin(slot)
        try:
            data = session.fetcher.fetch(index)
        except StopIteration:
            writer.abort()
            if session.dataset_kind == _DatasetKind.Iterable:
                session.iteration_end = True
                self._ring.commit(slot, Kind.EXHAUSTED, 0, 0, 0)
            else:
                self._commit_error(slot, ExceptionWrapper(where=_where(session, task)),
                                   session.capture())
            return
        except Exception:
            writer.abort()
            self._commit_error(slot, ExceptionWrapper(where=_where(session, task)),
                               session.capture())
            return
        trailer = session.capture()
        try:
            data_len, meta_off, meta_len, ofd, _ = writer.finish(data, trailer)
        except Exception:
            del data
            self._commit_error(slot, ExceptionWrapper(
                where=f"{_where(session, task)} while sending it to the main process"), trailer)
            return
        del data  # no reference to the batch is left once it is committed
        self._commit_batch(slot, seq, data_len, meta_off, meta_len, ofd, t0)

    def _commit_batch(self, slot: int, seq: int, data_len: int, meta_off: int, meta_len: int,
                      ofd: Optional[int], t0: int) -> None:
        """Publish the batch written into ``slot``, its overflow segment
        (``ofd``, if any) sent to the main process first; the slot's header
        says how long making it took since ``t0`` (the loader's stats())."""
        kind: int = Kind.DATA
        if ofd is not None:
            try:
                overflow.send(self._spec.sock, seq, ofd)
            finally:
                os.close(ofd)
            kind |= FLAG_OVERFLOW
        # Every commit here may answer CommitResult.RECLAIMED: main gave
        # up on this worker and took the slot back. The batch is simply
        # dropped (it will be made again); next_task() then answers
        # SHUTDOWN if main has replaced this worker, and the loop ends.
        self._ring.commit(slot, kind, data_len, meta_off, meta_len, time.perf_counter_ns() - t0)

    def _commit_error(self, slot: int, wrapper: ExceptionWrapper, trailer: bytes) -> None:
        """Commit ``wrapper`` as the slot's result."""
        self._ring.commit(slot, Kind.ERROR, 0, 0, self.writer.write_error(slot, wrapper, trailer))
