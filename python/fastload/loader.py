"""``FastLoader``: DataLoader's API and semantics, fastload's transport.

``FastLoader`` *is* a ``torch.utils.data.DataLoader`` (a subclass): argument
checking, samplers, ``len()``, attribute rules, warnings and ``num_workers=0``
are DataLoader's own code, so they cannot drift. With workers, its iterator
follows ``_MultiProcessingDataLoaderIter`` step for step (task order,
round-robin over active workers, prefetching, IterableDataset exhaustion,
persistent workers) but batches travel through the shared-memory ring of
:mod:`fastload.pool` instead of pickled queues.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import operator
import os
import pickle
import time
import mmap
import weakref
from typing import (Any, Callable, Generic, NoReturn, Dict, Iterable, List, Optional, Sequence,
                    Tuple, TypeVar)

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler
from torch.utils.data import _DatasetKind
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter, _SingleProcessDataLoaderIter

from . import _core, crossing
from .device import CudaStreamOps, DevicePrefetcher, StreamOps, resolve_device
from .pinning import DeviceRuntime, PinnedRing, cuda_runtime_or_none
from .errors import WorkerHangError, add_note
from .pool import ZYGOTE, WorkerPool, describe_exit, default_context, start_zygote
from .launch import Zygote
from .worker import OP_FETCH
from .serialize import FLAG_OVERFLOW, KIND_DATA, KIND_ERROR, KIND_EXHAUSTED, read_batch

__all__ = ["FastLoader"]

log = logging.getLogger("fastload")

T_co = TypeVar("T_co", covariant=True)

_NO_INDEX = object()  # _try_put_index: draw the next index from the sampler
_POLL_S = 0.1  # how often a waiting main process checks worker liveness
_MIN_SLOT_BYTES = 1 << 20
_DEFAULT_SLOT_BYTES = 64 << 20  # memfd pages are only committed when written
_DEFAULT_SLOT_BYTES_SHM = 16 << 20  # the shm fallback reserves every page up front
# Where a loader keeps its _LoaderState: FastLoader sets it in its constructor,
# fastload.install() on first iteration of a plain DataLoader.
STATE_ATTR = "_fastload_state"


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """fastload's own loader options, checked on construction (see FastLoader)."""

    allow_gpu_in_workers: bool = False
    slot_bytes: Optional[int] = None
    held_batches: int = 4
    reuse_workers: bool = True
    hang_timeout: Optional[float] = 300.0
    max_worker_restarts: int = 0
    device: Optional[torch.device] = None

    def __post_init__(self) -> None:
        slot_bytes, hang_timeout = self.slot_bytes, self.hang_timeout
        max_worker_restarts, held_batches = self.max_worker_restarts, self.held_batches
        if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes <= 0):
            raise ValueError(f"slot_bytes option should be a positive int, but got {slot_bytes!r}")
        if hang_timeout is not None and (
            isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float))
            or not hang_timeout > 0
        ):
            raise ValueError(
                f"hang_timeout option should be a positive number of seconds or None, "
                f"but got {hang_timeout!r}"
            )
        if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int) \
                or max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts option should be an int >= 0, "
                             f"but got {max_worker_restarts!r}")
        if not isinstance(held_batches, int) or held_batches < 1:
            raise ValueError(f"held_batches option should be an int >= 1, but got {held_batches!r}")
        # frozen: normalise through object.__setattr__
        object.__setattr__(self, "allow_gpu_in_workers", bool(self.allow_gpu_in_workers))
        object.__setattr__(self, "reuse_workers", bool(self.reuse_workers))
        object.__setattr__(self, "device", resolve_device(self.device))


class _LoaderState:
    """fastload's state for one loader, kept across its iterators.

    FastLoader makes one in its constructor; ``fastload.install()`` makes one
    for a plain DataLoader when it is first iterated. The iterator reads the
    options from it, learns slot sizes into it and hands its warm pool back
    to it, so any DataLoader can run on fastload without new attributes of
    its own. Copies and pickles of a loader carry the options only: worker
    processes are not copied.
    """

    def __init__(self, options: LoaderOptions) -> None:
        self.options = options
        self.learned_batch_bytes = 0
        self.idle_pool: Optional[WorkerPool] = None
        self.spare_zygotes: List[Zygote] = []
        self.warned_fork = False  # said that its workers fork from this process

    def __reduce__(self) -> Tuple[Any, Tuple[LoaderOptions]]:
        return (_LoaderState, (self.options,))

    def device_runtime(self, device_type: Optional[str]) -> Optional[DeviceRuntime]:
        """The runtime that can register the ring as pinned memory, if any."""
        return cuda_runtime_or_none(device_type)

    def stream_ops(self) -> Optional[StreamOps]:
        """Stream operations for device prefetch; None when there is nothing to do."""
        device = self.options.device
        if device is None or device.type == "cpu":
            return None
        if device.type == "cuda":
            return CudaStreamOps(device)
        return _BlockingOps(device)

    def take_spare_zygote(self, hide_accelerators: bool) -> Optional[Zygote]:
        while self.spare_zygotes:
            zygote = self.spare_zygotes.pop()
            if zygote.hide_accelerators == hide_accelerators:
                return zygote
            zygote.stop()
        return None

    def take_idle_pool(self, config: tuple) -> Optional[WorkerPool]:
        pool, self.idle_pool = self.idle_pool, None
        if pool is None:
            return None
        if pool.config == config and pool.alive:
            return pool
        pool.shutdown()
        return None

    def keep_idle_pool(self, pool: WorkerPool) -> None:
        if (self.options.reuse_workers and self.idle_pool is None and pool.alive
                and pool.reusable and pool.slots_accounted_for()):
            self.idle_pool = pool
        else:
            pool.shutdown()


_V = TypeVar("_V")


class _Option(Generic[_V]):
    """A FastLoader attribute backed by its LoaderOptions (read and write,
    checked as in the constructor)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, loader: Any, owner: Optional[type] = None) -> _V:
        if loader is None:
            return self  # type: ignore[return-value]
        return getattr(getattr(loader, STATE_ATTR).options, self._name)

    def __set__(self, loader: Any, value: _V) -> None:
        state = getattr(loader, STATE_ATTR)
        state.options = dataclasses.replace(state.options, **{self._name: value})


class FastLoader(DataLoader[T_co]):
    """Drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Takes exactly DataLoader's arguments, with the same defaults and errors,
    plus keyword-only options:

    Args:
        allow_gpu_in_workers: do not hide CUDA/ROCm devices from workers
            (by default ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` and
            ``ROCR_VISIBLE_DEVICES`` are set empty in their environment).
        slot_bytes: bytes per ring slot; by default 64 MiB (memfd pages are
            committed only when written) and learned from the batches seen.
            A batch larger than its slot still arrives whole, through an
            overflow segment.
        held_batches: how many batches the training loop may keep alive
            while still getting zero-copy batches; past that, batches are
            copied out of the ring so the workers never run dry (default 4).
        reuse_workers: with ``persistent_workers=False``, keep the worker
            processes between epochs and start each epoch by re-sending the
            dataset and reseeding them as fresh DataLoader workers would be
            (default True; the processes end with the loader). False starts
            new processes every epoch, as DataLoader does.
        hang_timeout: seconds a worker may hold one batch without progress
            before :class:`fastload.WorkerHangError` (with the worker's Python
            stack) ends the epoch; a warning is logged at half of it.
            ``None`` turns the watchdog off (default 300).
        max_worker_restarts: how many times per iterator a worker that died
            or hung is replaced by a new process, its unfinished batches made
            again, so the epoch goes on with every index delivered once and in
            order (default 0: the error, as DataLoader). Map-style datasets
            only. Exceptions raised by ``dataset[i]`` are never retried.
        device: device prefetch (default None: off). With a CUDA/ROCm device
            the loader copies each batch to it on a side stream one batch
            ahead and yields device tensors, the current stream made to wait
            for the copy; the ring is then pinned as with ``pin_memory=True``.
            ``'cpu'`` yields the batches unchanged.

    Differences from DataLoader, on purpose: when ``multiprocessing_context``
    is None (DataLoader uses the platform default, ``fork`` on Linux) workers
    are forked from a zygote of the pool's own, a spawn-started process that
    imported torch and nothing of the training process (see
    :mod:`fastload.zygote`); ``'spawn'`` given explicitly is real spawn. What
    plain pickle cannot send to a spawned worker (``__main__`` classes,
    lambdas, closures) is sent by value with cloudpickle.
    """

    allow_gpu_in_workers: _Option[bool] = _Option()
    slot_bytes: _Option[Optional[int]] = _Option()
    held_batches: _Option[int] = _Option()
    reuse_workers: _Option[bool] = _Option()
    hang_timeout: _Option[Optional[float]] = _Option()
    max_worker_restarts: _Option[int] = _Option()
    device: _Option[Optional[torch.device]] = _Option()

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Optional[Sampler | Iterable] = None,
        batch_sampler: Optional[Sampler[List] | Iterable[List]] = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable[[List[Any]], Any]] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Optional[Callable[[int], None]] = None,
        multiprocessing_context: Any = None,
        generator: Optional[torch.Generator] = None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        allow_gpu_in_workers: bool = False,
        slot_bytes: Optional[int] = None,
        held_batches: int = 4,
        reuse_workers: bool = True,
        hang_timeout: Optional[float] = 300.0,
        max_worker_restarts: int = 0,
        device: Optional[Any] = None,
    ) -> None:
        self._fastload_state = _LoaderState(LoaderOptions(  # STATE_ATTR
            allow_gpu_in_workers=allow_gpu_in_workers, slot_bytes=slot_bytes,
            held_batches=held_batches, reuse_workers=reuse_workers, hang_timeout=hang_timeout,
            max_worker_restarts=max_worker_restarts, device=device,
        ))
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if self.num_workers > 0 and self.multiprocessing_context is None:
            # Start the zygote now: it imports torch while the script builds
            # its model, so the first epoch's workers fork from a ready one.
            # Whoever takes it (the first pool) owns it; else it ends with us.
            self._spare_zygote.append(start_zygote(not self.allow_gpu_in_workers))
            weakref.finalize(self, _stop_spare_zygotes, self._spare_zygote)

    @property
    def _idle_pool(self) -> Optional[WorkerPool]:
        """The warm pool kept between epochs, if any."""
        return self._fastload_state.idle_pool

    @property
    def _spare_zygote(self) -> List[Zygote]:
        """The zygote started with the loader, until a pool takes it."""
        return self._fastload_state.spare_zygotes

    def _get_iterator(self) -> _BaseDataLoaderIter:
        if self.num_workers == 0:
            ops = self._stream_ops()
            if ops is None:
                return super()._get_iterator()
            return _SingleProcessIter(self, ops)
        self.check_worker_number_rationality()
        _fail_as_dataloader_iterator(self)
        return _FastLoaderIter(self)

    def _device_runtime(self, device_type: Optional[str]) -> Optional[DeviceRuntime]:
        """The runtime that can register the ring as pinned memory, if any."""
        return self._fastload_state.device_runtime(device_type)

    def _stream_ops(self) -> Optional[StreamOps]:
        """Stream operations for device prefetch; None when there is nothing to do."""
        return self._fastload_state.stream_ops()


def _stop_spare_zygotes(spare: List[Zygote]) -> None:
    while spare:
        spare.pop().stop()


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _draws_len_first(loader: DataLoader) -> bool:
    """Whether the loader's first index comes from ``len(dataset)``: one of
    torch's default samplers over the dataset, batched or not."""
    sampler = loader._index_sampler
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    return type(sampler) in (SequentialSampler, RandomSampler) and sampler.data_source is loader.dataset


def _dataloader_start_method(loader: DataLoader) -> Optional[str]:
    """The start method DataLoader's workers would use (None: not known)."""
    ctx = loader.multiprocessing_context
    if ctx is None:
        # DataLoader's default: torch.multiprocessing's, the platform's first.
        return (torch.multiprocessing.get_start_method(allow_none=True)
                or multiprocessing.get_all_start_methods()[0])
    try:
        return ctx.get_start_method()
    except Exception:  # a user's context object; DataLoader's checks passed it
        return None


def _fail_as_dataloader_iterator(loader: DataLoader) -> None:
    """Raise what DataLoader's multi-process iterator would, where fastload
    would fail elsewhere, before anything is pickled or started.

    DataLoader's constructor lets these through and its iterator fails on
    them; fastload's iterator would fail first on something of its own:

    * a worker count or ``prefetch_factor`` that is not an integer
      (``num_workers=2.0``): DataLoader fails on ``range(num_workers)`` as it
      starts its workers, or on ``range(prefetch_factor * num_workers)`` as it
      primes them (``TypeError: 'float' object cannot be interpreted as an
      integer``); fastload would hand them to its ring's extension.
    * a dataset that is a bare iterator (a generator, ``map(...)``) with a
      default sampler: DataLoader's forked workers get it without pickling,
      and its first index fails on ``len(dataset)``; fastload would fail
      pickling the dataset for its workers.

    DataLoader meets these after its base set-up (pin-memory warnings, the
    sampler's iterator, the seed drawn from ``generator``), its
    ``num_workers > 0`` check (repeated here: a count set after construction
    could be negative) and its ``prefetch_factor > 0`` check (the iterator's
    own, so nothing is done here then). The set-up is repeated here first,
    so the warnings, the generator's state and, with several wrong arguments,
    the error are DataLoader's too.
    """
    num_workers, prefetch_factor = loader.num_workers, loader.prefetch_factor
    if not num_workers > 0:
        _BaseDataLoaderIter(loader)
        raise AssertionError("num_workers must be greater than 0 for multi-process loading")
    try:
        if not prefetch_factor > 0:
            return
    except TypeError:
        return  # the iterator's own check raises DataLoader's error for it
    dataset = loader.dataset
    unsized_iterator = (  # a generator, a map object, an open file...
        hasattr(type(dataset), "__next__") and not isinstance(dataset, Dataset)
        and not hasattr(dataset, "__len__") and _draws_len_first(loader)
        and _dataloader_start_method(loader) == "fork"
    )
    if _is_index(num_workers) and _is_index(prefetch_factor * num_workers) and not unsized_iterator:
        return
    it = _BaseDataLoaderIter(loader)
    range(num_workers)  # DataLoader's worker start
    range(prefetch_factor * num_workers)  # DataLoader's priming, which then draws an index
    it._reset(loader, first_iter=True)
    it._next_index()


class _Task:
    """One dispatched batch: who makes it, where it lands, what came back."""

    __slots__ = ("idx", "seq", "worker", "slot", "index", "kind", "done")

    def __init__(self, idx: int, seq: int, worker: int, slot: int, index: Any) -> None:
        self.idx = idx
        self.seq = seq
        self.worker = worker
        self.slot = slot
        self.index = index
        self.kind = -1
        self.done = False


class _FastLoaderIter(_BaseDataLoaderIter):
    """Multi-process iterator over the ring; mirrors _MultiProcessingDataLoaderIter."""

    def __init__(self, loader: DataLoader, state: Optional[_LoaderState] = None) -> None:
        """``state``: fastload's state for ``loader``; a FastLoader's own by default."""
        super().__init__(loader)
        if state is None:
            state = getattr(loader, STATE_ATTR)
        opts = state.options
        self._prefetch_factor: int = loader.prefetch_factor  # type: ignore[assignment]
        self._in_order = getattr(loader, "in_order", True)
        if self._prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for multi-process loading")
        self._state_ref = weakref.ref(state)
        self._held_batches = opts.held_batches
        self._pool: Optional[WorkerPool] = None
        self._owner_pid = os.getpid()
        self._shutdown = False
        self._fatal: Optional[str] = None
        self._hang_timeout = opts.hang_timeout
        self._restarts_left = opts.max_worker_restarts
        self._stall: Dict[int, Tuple[int, float, bool]] = {}  # worker -> (progress, since, warned)
        self._epoch = 0
        self._inflight: Dict[int, _Task] = {}  # seq -> task with no result yet
        self._task_info: Dict[int, _Task] = {}
        self._session: Dict[int, Tuple[int, int]] = {}  # seq -> (slot, worker) of session tasks
        self._pinner: Optional[PinnedRing] = None
        if isinstance(loader, FastLoader):  # a subclass may override these two
            stream_ops, device_runtime = loader._stream_ops, loader._device_runtime
        else:
            stream_ops, device_runtime = state.stream_ops, state.device_runtime
        ops = stream_ops()
        self._prefetcher = DevicePrefetcher(ops) if ops is not None else None
        if ops is not None and opts.device is not None and opts.device.type == "cuda":
            # Overlapping the copy needs pinned memory: pin the ring too.
            self._pin_memory = True
            self._pin_memory_device = "cuda"

        ctx = loader.multiprocessing_context or default_context()
        payload = (self._dataset, self._collate_fn, loader.worker_init_fn, self._dataset_kind,
                   self._auto_collation, self._drop_last)
        inherited: Optional[tuple] = None
        try:
            self._blob: Optional[crossing.Parcel] = crossing.pack(
                payload, "dataset, collate_fn and worker_init_fn",
                names=("dataset", "collate_fn", "worker_init_fn"))
        except crossing.ForkOnlyError as e:
            if ctx != default_context():
                add_note(e, "fastload: create it from the loader's start method, e.g. "
                           "multiprocessing.get_context('spawn').Value(...), or pass "
                           "multiprocessing_context='fork'")
                raise
            # Only fork can hand it over, and DataLoader's default on Linux is
            # fork: do what DataLoader does for this dataset, and say so.
            if not state.warned_fork:  # once per loader
                state.warned_fork = True
                log.warning("fastload: the dataset holds a multiprocessing object made in the "
                            "fork context, which only fork can hand over: its workers are "
                            "forked from this process, as DataLoader's are. Make it with "
                            "multiprocessing.get_context('spawn') to keep workers apart "
                            "from this process.")
            ctx = multiprocessing.get_context("fork")
            inherited, self._blob = payload, None
        # A slot per possible task, one per worker for its session task, and
        # the batches the loop may hold.
        num_slots = self._num_workers * (self._prefetch_factor + 1) + self._held_batches
        if num_slots > _core.MAX_SLOTS:
            raise ValueError(
                "num_workers * (prefetch_factor + 1) + held_batches must be at most "
                f"{_core.MAX_SLOTS}, got {num_slots}"
            )
        force_shm = os.environ.get("FASTLOAD_SEGMENT", "") == "shm"
        slot_bytes = opts.slot_bytes
        if slot_bytes is None:
            slot_bytes = _DEFAULT_SLOT_BYTES_SHM if force_shm else _DEFAULT_SLOT_BYTES
            learned = state.learned_batch_bytes * 5 // 4
            if learned > slot_bytes:
                slot_bytes = -(-learned // (1 << 20)) << 20
        slot_bytes = max(int(slot_bytes), _MIN_SLOT_BYTES)
        hide = not opts.allow_gpu_in_workers
        config = (ctx, self._num_workers, num_slots, slot_bytes, hide, force_shm)
        pool = None
        if not self._persistent_workers and inherited is None:
            pool = state.take_idle_pool(config)
        if pool is None:
            zygote = state.take_spare_zygote(hide) if ctx == ZYGOTE else None
            pool = WorkerPool(ctx=ctx, num_workers=self._num_workers, num_slots=num_slots,
                              slot_bytes=slot_bytes, hide_accelerators=hide, force_shm=force_shm,
                              zygote=zygote, inherited=inherited)
        self._pool = pool
        self._ring = pool.ring
        if self._pin_memory and pool.pinner is None:
            runtime = device_runtime(self._pin_memory_device)
            if runtime is not None:
                pool.pinner = PinnedRing(pool.ring, runtime)
        self._pinner = pool.pinner if self._pin_memory else None
        try:
            self._drain_orphans()
            self._make_free(self._num_workers)
            self._session = {seq: (slot, w) for seq, slot, w in
                             pool.start_session(self._blob, self._base_seed)}
        except BaseException:
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True)

    # ---- epoch set-up ------------------------------------------------------
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        if not first_iter and self._fatal is None:
            # Tasks the previous epoch still owed (the loop broke out): DataLoader
            # had sent them, and its workers fetch them before the new epoch,
            # which moves a persistent worker's RNG.
            self._pay_refills()
        super()._reset(loader, first_iter)
        if self._prefetcher is not None:
            self._prefetcher.reset()
        if self._fatal is not None:  # a persistent pool that lost a worker stays failed
            raise RuntimeError(self._fatal)
        if not first_iter:
            # A persistent pool's next epoch: DataLoader waits for every
            # worker to acknowledge _ResumeIteration; we wait out the
            # previous epoch's batches, then tag tasks with the new epoch.
            self._release_unclaimed()
            self._drain_inflight()
            self._epoch += 1
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._tasks_outstanding = 0
        self._owed: List[Any] = []  # indices drawn for tasks not sent yet (_process_data)
        self._sampler_done = False
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        self._worker_queue_idx_cycle = itertools.cycle(range(self._num_workers))
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _release_unclaimed(self) -> None:
        """Free the slots of results nobody will take (their batches were skipped)."""
        for task in self._task_info.values():
            if task.done:
                self._discard_result(task)
        self._task_info = {}

    def _drain_inflight(self) -> None:
        while self._inflight:
            task = self._receive_one(deadline=None)
            self._discard_result(task)

    def _drain_orphans(self) -> None:
        """Wait out the batches a previous iterator of this pool left in flight."""
        assert self._pool is not None
        for seq, slot, worker in self._pool.orphans:
            task = _Task(-1, seq, worker, slot, None)
            self._inflight[seq] = task
        self._pool.orphans = []
        self._drain_inflight()

    def _discard_result(self, task: _Task) -> None:
        """Free a done task's slot unread (and its overflow fd, if it has one)."""
        if self._ring.result(task.slot)[0] & FLAG_OVERFLOW and self._pool is not None:
            os.close(self._pool.recv_overflow(task.worker, task.seq))
        self._ring.release(task.slot)

    # ---- sending -----------------------------------------------------------
    def _try_put_index(self, index: Any = _NO_INDEX) -> None:
        """DataLoader's: send the sampler's next index (or ``index``, drawn
        earlier) to the next active worker."""
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")
        if index is _NO_INDEX:
            try:
                index = self._next_index()
            except StopIteration:
                self._sampler_done = True
                return
        for _ in range(self._num_workers):  # find the next active worker, if any
            worker_queue_idx = next(self._worker_queue_idx_cycle)
            if self._workers_status[worker_queue_idx]:
                if self._in_order:
                    break
                elif self._workers_num_tasks[worker_queue_idx] < max_tasks // sum(
                    self._workers_status
                ):
                    break
        else:
            return
        slot = self._pop_free_slot()
        if slot is None:  # cannot happen: the ring has a slot per possible task + held ones
            raise AssertionError("fastload: no free slot for a new task")
        assert self._pool is not None
        seq = self._pool.next_seq()
        task_bytes = pickle.dumps(
            (OP_FETCH, self._epoch, self._send_idx, index), protocol=pickle.HIGHEST_PROTOCOL
        )
        # Tracked before the assign: a KeyboardInterrupt delivered right after
        # it must not leave a task in flight that nobody waits for.
        task = _Task(self._send_idx, seq, worker_queue_idx, slot, index)
        self._task_info[self._send_idx] = task
        self._inflight[seq] = task
        self._workers_num_tasks[worker_queue_idx] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1
        try:
            self._ring.assign(slot, seq, worker_queue_idx, task_bytes)
        except BaseException:
            if self._ring.state(slot) == _core.SlotState.FREE:  # not handed out: undo
                self._send_idx -= 1
                del self._task_info[self._send_idx]
                del self._inflight[seq]
                self._workers_num_tasks[worker_queue_idx] -= 1
                self._tasks_outstanding -= 1
                self._ring.push_free_slot(slot)
            raise

    def _pop_free_slot(self) -> Optional[int]:
        self._make_free(1)
        return self._ring.pop_free_slot()

    def _make_free(self, n: int) -> None:
        """Have at least ``n`` free slots if slots held for device copies
        (pinned memory) can give them: those whose copies are done first,
        then waiting for the oldest."""
        gate = self._pinner.gate if self._pinner is not None else None
        if gate is None or not len(gate):
            return
        gate.collect()
        while self._ring.free_slot_count() < n and gate.wait_one():
            pass

    # ---- receiving ---------------------------------------------------------
    def _receive_one(self, deadline: Optional[float]) -> _Task:
        """Block until some in-flight task has a result; mark it done.

        Watches worker liveness every _POLL_S and the user's ``timeout``.
        """
        while True:
            for seq, (slot, _w) in list(self._session.items()):
                if self._ring.is_ready(slot, seq):  # a worker took its session
                    self._ring.release(slot)
                    del self._session[seq]
            tasks = list(self._inflight.values())
            seqs = [t.seq for t in tasks] + list(self._session)
            slots = [t.slot for t in tasks] + [slot for slot, _w in self._session.values()]
            wait = _POLL_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            status, which = self._ring.wait_any(slots, seqs, wait)
            if status == _core.WaitResult.READY:
                if which >= len(tasks):  # a worker took its session: free that slot
                    self._ring.release(self._session.pop(seqs[which])[0])
                    continue
                task = tasks[which]
                del self._inflight[task.seq]
                task.kind = self._ring.result(task.slot)[0]
                task.done = True
                return task
            self._check_workers()
            self._check_hangs()
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"DataLoader timed out after {self._timeout} seconds")

    def _check_workers(self) -> None:
        assert self._pool is not None
        dead = self._pool.dead_workers()
        if not dead:
            return
        if self._can_restart(len(dead)):
            for wid, pid, code in dead:
                self._restart(wid, describe_exit(pid, code).strip())
            return
        held = [t for t in self._inflight.values() if any(t.worker == d[0] for d in dead)]
        msgs = []
        for wid, pid, code in dead:
            mine = [t for t in held if t.worker == wid]
            msg = describe_exit(pid, code, self._pool.death_note(wid))
            if mine:
                batches = ", ".join(str(t.idx) for t in mine)
                idxs = [t.index for t in mine]
                msg += f"It was making batch(es) {batches} of this epoch (indices {_short(idxs)}). "
            msgs.append(msg)
        self._fail("".join(msgs).strip())

    def _check_hangs(self) -> None:
        """The hang watchdog: a worker holding a batch whose progress counter
        has not moved for hang_timeout seconds ends the epoch."""
        if self._hang_timeout is None or self._pool is None:
            return
        now = time.monotonic()
        for w in range(self._num_workers):
            progress = self._ring.worker_progress(w)
            seq = self._in_hand(w)
            last = self._stall.get(w)
            if seq is None:  # no work for it: it cannot be late
                self._stall.pop(w, None)
                continue
            if last is None or last[0] != progress:
                self._stall[w] = (progress, now, False)
                continue
            stalled = now - last[1]
            task = self._inflight.get(seq)
            what = (f"batch {task.idx} of this epoch (indices {_short(_as_list(task.index))})"
                    if task is not None else "its session set-up (unpickling the dataset, "
                    "worker_init_fn)")
            pid = self._pool.procs[w].pid
            if stalled >= self._hang_timeout:
                stack = self._pool.worker_stack(w)
                self._pool.procs[w].kill()  # no grace period for a hung worker
                if self._can_restart(1):
                    log.warning("fastload: worker %d (pid %s) hung on %s; its stack:\n%s",
                                w, pid, what, stack)
                    self._restart(w, f"no progress for {stalled:.0f} s")
                    self._stall.pop(w, None)
                    continue
                msg = (f"DataLoader worker {w} (pid {pid}) made no progress for {stalled:.0f} s "
                       f"on {what} (hang_timeout={self._hang_timeout}). Its Python stack:\n{stack}")
                self._fatal = msg
                self._shutdown_workers()
                raise WorkerHangError(msg)
            if stalled >= self._hang_timeout / 2 and not last[2]:
                log.warning("fastload: worker %d (pid %s) has been on %s for %.0f s "
                            "(hang_timeout=%s)", w, pid, what, stalled, self._hang_timeout)
                self._stall[w] = (last[0], last[1], True)

    def _in_hand(self, w: int) -> Optional[int]:
        """The seq of the task worker ``w`` should be working on, if any.

        The one it has popped; else, once it has attached, the oldest task
        queued for it (its session first): a worker stopped or stuck between
        two tasks holds up the epoch as surely as one stuck inside a task.
        """
        seq = self._ring.worker_current_seq(w)
        if seq is not None or self._ring.worker_pid(w) == 0:
            return seq
        queued = [s for s, (_slot, ww) in self._session.items() if ww == w]
        queued += [t.seq for t in self._inflight.values() if t.worker == w]
        return min(queued) if queued else None

    def _can_restart(self, n: int) -> bool:
        return self._restarts_left >= n and self._dataset_kind == _DatasetKind.Map

    def _restart(self, w: int, cause: str) -> None:
        """Replace worker ``w`` and have it make its unfinished batches again.

        Results it committed before dying stay valid (their slots are READY
        with its stamp); the rest are reclaimed and re-sent, in batch order,
        after the new worker's session task. Indices and batch numbers are
        unchanged, so delivery stays exactly-once and in order.
        """
        assert self._pool is not None
        self._restarts_left -= 1
        ring = self._ring
        log.warning("fastload: restarting worker %d (%s); %d restart(s) left", w, cause,
                    self._restarts_left)
        for seq, (slot, ww) in list(self._session.items()):
            if ww == w and not ring.is_ready(slot, seq) and ring.reclaim(slot):
                del self._session[seq]
                ring.push_free_slot(slot)
        self._make_free(1)
        seq_s, slot_s, _ = self._pool.restart_worker(w, self._blob, self._base_seed)
        self._session[seq_s] = (slot_s, w)
        redo = sorted((t for t in self._inflight.values() if t.worker == w), key=lambda t: t.idx)
        for task in redo:
            if ring.is_ready(task.slot, task.seq) or not ring.reclaim(task.slot):
                continue
            del self._inflight[task.seq]
            if task.idx < 0:  # a previous iterator's orphan: nobody wants it
                ring.push_free_slot(task.slot)
                continue
            task.seq = self._pool.next_seq()
            self._inflight[task.seq] = task
            ring.assign(task.slot, task.seq, w, pickle.dumps(
                (OP_FETCH, self._epoch, task.idx, task.index), protocol=pickle.HIGHEST_PROTOCOL))

    def _fail(self, msg: str) -> NoReturn:
        """A dead worker or a timeout ends the epoch: stop the workers and
        raise now and at every later next()."""
        self._fatal = msg
        self._shutdown_workers()
        raise RuntimeError(msg)

    def _next_data(self) -> Any:
        if self._prefetcher is not None:
            return self._prefetcher.next(self._next_host_batch)
        return self._next_host_batch()

    def _next_host_batch(self) -> Any:
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        self._pay_refills()  # before the end-of-epoch check below
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            # Skip tasks of workers that ended (IterableDataset) with no result.
            while self._rcvd_idx < self._send_idx:
                info = self._task_info.get(self._rcvd_idx, None)
                if info:
                    if info.done or self._workers_status[info.worker]:
                        break
                    del self._task_info[self._rcvd_idx]  # its EXHAUSTED result is freed on arrival
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._hand_back_pool()
                raise StopIteration

            task = self._task_info[self._rcvd_idx]
            if task.done:
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._deliver(task)

            if self._shutdown or self._tasks_outstanding <= 0:
                raise AssertionError("Invalid iterator state: no outstanding tasks")
            got = self._receive_one(deadline)
            self._tasks_outstanding -= 1
            if got.kind == KIND_EXHAUSTED:
                self._discard_result(got)
                if self._task_info.get(got.idx) is got:
                    del self._task_info[got.idx]
                if self._workers_status[got.worker]:
                    self._workers_status[got.worker] = False
                    self._try_put_index()
                continue
            if self._task_info.get(got.idx) is not got:
                self._discard_result(got)  # a task skipped above: nobody wants it
                continue
            if got.idx != self._rcvd_idx:
                if not self._in_order:
                    del self._task_info[got.idx]
                    return self._deliver(got)
                continue  # stays in its slot until its turn
            del self._task_info[got.idx]
            self._rcvd_idx += 1
            return self._deliver(got)

    def _deliver(self, task: _Task) -> Any:
        data = self._process_data(task)
        if (self._sampler_done and not self._persistent_workers and not self._task_info
                and not self._owed and self._tasks_outstanding == 0):
            # That was the epoch's last batch: give the pool back now, not at
            # the StopIteration that a loop stopping after len(loader) batches
            # (Lightning's does) never asks for; the next iter() finds it warm.
            self._hand_back_pool()
        return data

    def _pay_refills(self) -> None:
        """Send the tasks :meth:`_process_data` deferred."""
        while self._owed:
            self._try_put_index(self._owed.pop(0))

    def _process_data(self, task: _Task) -> Any:
        self._workers_num_tasks[task.worker] -= 1
        try:
            data = self._take(task)
        finally:
            if self._prefetch_factor > 1:
                # The next task goes out when the loop next asks for a batch,
                # not now: by then the loop has dropped the batch before this
                # one, and the task can take that batch's slot (batches take
                # the lowest free slot). Sent now, it would need a slot more
                # than the pipeline holds, and a slot keeps its pages once
                # written: a batch's worth of memory more. Each worker still
                # has a queued task meanwhile; with prefetch_factor=1 it
                # would idle, so the task goes out at once, as DataLoader's.
                # The index is drawn now, as DataLoader draws it: a sampler
                # that raises does so with this batch, and this batch is lost.
                try:
                    self._owed.append(self._next_index())
                except StopIteration:
                    self._sampler_done = True
            else:
                self._try_put_index()
        if self._pin_memory:
            if self._pinner is not None:  # views of a registered slot stay as they are
                data = self._pinner.pin(data)
            else:  # no host-register call: copy as DataLoader's pin thread does
                data = pin_memory(data, self._pin_memory_device)
        return data

    def _take(self, task: _Task) -> Any:
        """Turn a done task's slot into the batch (or raise its error)."""
        ring = self._ring
        kind, data_len, meta_off, meta_len = ring.result(task.slot)
        if kind == KIND_ERROR:
            try:
                wrapper = pickle.loads(_slot_bytes(ring, task.slot, 0, meta_len))
            finally:
                ring.release(task.slot)
            wrapper.reraise()
        overflow: Optional[mmap.mmap] = None
        meta: Any = None
        lease_len = meta_off + meta_len  # the slot holds data then meta
        if kind & FLAG_OVERFLOW:
            overflow = self._map_overflow(task)
            meta = memoryview(overflow)[meta_off : meta_off + meta_len]
            lease_len = data_len  # the meta lies in the overflow segment
        self._learn(lease_len + (len(overflow) if overflow is not None else 0))
        if lease_len == 0:
            ring.release(task.slot)
            return self._read(task, meta, [None, overflow])
        lease = (self._pinner.lease(task.slot, lease_len) if self._pinner is not None
                 else ring.lease(task.slot, lease_len))
        if meta is None:
            meta = memoryview(lease)[meta_off : meta_off + meta_len]
        if self._live_leases() <= self._held_batches:
            return self._read(task, meta, [lease, overflow])
        # The loop keeps batches alive: copy this one out so workers keep
        # enough slots to fill (never a deadlock, never an overwrite).
        meta = bytes(meta)
        copy = torch.frombuffer(lease, dtype=torch.uint8)[:data_len].clone() if data_len else None
        del lease  # frees the slot now
        return self._read(task, meta, [copy, overflow])

    @staticmethod
    def _read(task: _Task, meta: Any, buffers: List[Any]) -> Any:
        """read_batch; an error (e.g. an object that cannot be unpickled
        here) keeps its type and message and gets a note naming the batch."""
        try:
            return read_batch(meta, buffers)
        except Exception as e:
            add_note(e, f"fastload: raised while rebuilding batch {task.idx} (sample indices "
                       f"{_short(_as_list(task.index))}) in the main process")
            raise

    def _map_overflow(self, task: _Task) -> mmap.mmap:
        assert self._pool is not None
        fd = self._pool.recv_overflow(task.worker, task.seq)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def _live_leases(self) -> int:
        pipeline = (len(self._inflight) + len(self._session)
                    + sum(1 for t in self._task_info.values() if t.done))
        if self._pinner is not None:  # released, waiting for their device copies
            pipeline += len(self._pinner.gate)
        return self._ring.num_slots - self._ring.free_slot_count() - pipeline

    def _learn(self, batch_bytes: int) -> None:
        state = self._state_ref()
        if state is not None and batch_bytes > state.learned_batch_bytes:
            state.learned_batch_bytes = batch_bytes

    # ---- shutdown ----------------------------------------------------------
    def _hand_back_pool(self) -> None:
        """End of this iterator: give a healthy pool back to the loader, warm.

        Batches still in flight go with it as orphans: the next iterator
        waits them out before its session, so nothing is freed under a worker.
        """
        if self._shutdown:
            return
        self._shutdown = True
        pool = self._pool
        if pool is None:
            return
        state = self._state_ref()
        if state is None or self._persistent_workers or not pool.alive:
            self._pool = None
            pool.shutdown()
            return
        self._release_unclaimed()  # while self._pool is set: overflow fds are collected too
        self._pool = None
        pool.orphans = [(t.seq, t.slot, t.worker) for t in self._inflight.values()]
        pool.orphans += [(seq, slot, w) for seq, (slot, w) in self._session.items()]
        self._inflight.clear()
        self._session = {}
        state.keep_idle_pool(pool)

    def _shutdown_workers(self) -> None:
        """Stop the workers for good (an error, or the end of a persistent iterator)."""
        if self._shutdown:
            return
        self._shutdown = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        # Slots still leased by the loop stay mapped until their views die.
        self._inflight.clear()

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) != os.getpid():
            # A forked child collecting its inherited copy: the pool, its
            # slots and workers are the parent's (pool._stop closes our fds).
            return
        try:
            if getattr(self, "_persistent_workers", True):
                self._shutdown_workers()
            else:
                self._hand_back_pool()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


def _slot_bytes(ring: Any, slot: int, off: int, n: int) -> bytes:
    region = ring.payload_region()
    start = slot * ring.slot_bytes + off
    return bytes(memoryview(region)[start : start + n])


def _short(items: Sequence[Any], limit: int = 8) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return f"[{shown}{more}]"


def _as_list(index: Any) -> List[Any]:
    return list(index) if isinstance(index, (list, tuple)) else [index]


class _SingleProcessIter(_SingleProcessDataLoaderIter):
    """``num_workers=0`` with device prefetch: DataLoader's own iterator, one
    batch copied ahead."""

    def __init__(self, loader: FastLoader, ops: StreamOps) -> None:
        self._prefetcher = DevicePrefetcher(ops)
        super().__init__(loader)

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._prefetcher.reset()

    def _next_data(self) -> Any:
        return self._prefetcher.next(super()._next_data)


class _BlockingOps:
    """Devices without CUDA-style streams (xpu, mps, ...): a plain ``.to()``;
    correct, but the copy does not overlap the loop's work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_to_device(self, fetch: Callable[[], Any]) -> Any:
        from .device import move_to

        return move_to(fetch(), lambda t: t.to(self.device))

    def hand_over(self, data: Any) -> Any:
        return data
