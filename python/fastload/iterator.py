"""The multi-process iterator: DataLoader's, step for step, over the ring.

:class:`FastLoaderIter` mirrors ``torch.utils.data.dataloader.
_MultiProcessingDataLoaderIter`` and does only what it does: draw indices
from the sampler, send them to workers round-robin over the active ones,
keep ``prefetch_factor`` tasks per worker outstanding, hand batches out in
order (or as they come with ``in_order=False``), mark IterableDataset
replicas that ran out, and start the next epoch of persistent workers. The
rest belongs to its parts, each driven by it and returning what happened:

* :class:`fastload.ledger.SlotLedger` (the pool's): what each slot is doing;
* :class:`fastload.supervisor.Supervisor`: deaths, hangs, restarts;
* :class:`fastload.transport.reader.SlotReader`: a done slot back into a batch;
* :class:`fastload.loader_state.LoaderState` (the loader's): the pool, kept warm;
* :class:`fastload.iterator_workers.WorkersMixin`: its session on the
  workers, its waits for their results, its end (NOTE [ Shutdown ]);
* :class:`fastload.iterator_resume.ResumeMixin`: its position, for
  ``state_dict()``, and getting back to one.

NOTE [ Ordering ]
Batch ``n`` goes to the next active worker in round-robin order, as in
DataLoader (some datasets rely on it), into the lowest free slot. Results
are handed out by batch number, not by slot, so a slot the loop still holds
never blocks a later batch. With ``prefetch_factor > 1`` the refill task of
a delivered batch is sent at the start of the next ``__next__``, when the
loop has dropped the batch before it, so the task can reuse that batch's
slot: the ring then commits ``num_workers * prefetch_factor + 1`` slots of
memory, not one more (a slot keeps its pages once written). Its index is
drawn when DataLoader draws it, so a sampler that raises does so with the
same batch.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from typing import Any, List, Optional

from torch.utils.data import DataLoader
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import resume
from .debug_views import IteratorView, RingView
from .device import DevicePrefetcher
from .iterator_auto import AutoCountMixin
from .iterator_resume import ResumeMixin
from .iterator_workers import WorkersMixin
from .launching import crossing
from .launching.start_methods import default_context
from .ledger import Record, Role
from .epoch_meter import EpochMeter, loader_label, samples_in
from .pool import WorkerPool
from .process_state import ProcessState
from .loader_state import LoaderState
from .transport.reader import SlotReader
from .wire import FLAG_OVERFLOW, Kind, encode_fetch

log = logging.getLogger("fastload")

_NO_INDEX = object()  # _try_put_index: draw the next index from the sampler


class FastLoaderIter(WorkersMixin, ResumeMixin, AutoCountMixin, _BaseDataLoaderIter):
    """Multi-process iterator over the ring; mirrors _MultiProcessingDataLoaderIter."""

    def __init__(self, loader: DataLoader, state: LoaderState, *, stream_ops: Any = None,
                 device_runtime: Any = None) -> None:
        """``state``: fastload's state for ``loader``; ``stream_ops`` and
        ``device_runtime``: device prefetch and ring pinning (None: off)."""
        meter: EpochMeter = state.meter
        self._meter = meter
        meter.begin(loader.num_workers, loader_label(loader, state.options.auto_workers),
                    state.options.auto_workers)
        self._meter_epoch = meter.epoch
        self._epoch_over = False  # the epoch's last batch was handed out (stats())
        self._read_ns = 0
        self._delivered_samples = 0
        saved = self._saved = state.take_resume()
        first_start = None
        if saved is None:
            first_start = resume.epoch_start(loader, None, True)
        super().__init__(loader)  # draws the base seed as any iter() does (NOTE [ Resume ])
        opts = state.options
        self._prefetch_factor: int = loader.prefetch_factor  # type: ignore[assignment]
        self._capacity = self._choose_count(loader, state, saved)
        if saved is not None:
            self._base_seed = saved["base_seed"]
        else:
            first_start["base_seed"] = self._base_seed  # type: ignore[index]
        self._first_start = first_start
        self._book = resume.ResumeBook(self._capacity)
        self._finished = False
        self._drawn = 0
        self._skip_draw: set = set()
        self._skip_send: set = set()
        self._cycle_next = 0
        state.live_iterator = weakref.ref(self)
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
        self._epoch = 0
        self._task_info: dict = {}
        self._prefetcher = DevicePrefetcher(stream_ops) if stream_ops is not None else None
        if stream_ops is not None and opts.device is not None and opts.device.type == "cuda":
            # Overlapping the copy needs pinned memory: pin the ring too.
            self._pin_memory = True
            self._pin_memory_device = "cuda"
        blob = self._open_pool(loader, state, device_runtime)
        try:
            self._start_session(state, saved, blob)
        except BaseException:
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True)
        meter.started()

    def _open_pool(self, loader: DataLoader, state: LoaderState,
                   device_runtime: Any) -> Optional[crossing.Parcel]:
        """Pack the session, take a pool (warm or new) and set up its parts;
        returns the packed session for :meth:`_start_session`."""
        opts = state.options
        blob, ctx, inherited = crossing.pack_session(
            (ProcessState.capture(), self._dataset, self._collate_fn, loader.worker_init_fn,
             self._dataset_kind, self._auto_collation, self._drop_last),
            loader.multiprocessing_context or default_context(), state)
        pool = state.pool_for(ctx, self._num_workers, self._prefetch_factor,
                              persistent=self._persistent_workers, inherited=inherited,
                              capacity=self._capacity)
        self._pool, self._ring, self._ledger = pool, pool.ring, pool.ledger
        if self._auto is not None:
            self._num_workers = pool.num_workers  # a warm pool keeps the count it ended with
            state.meter.resize(pool.num_workers)
        if self._pin_memory and pool.pinner is None and device_runtime is not None:
            runtime = device_runtime(self._pin_memory_device)
            if runtime is not None:
                pool.pin(runtime)
        pinner = self._pinner = pool.pinner if self._pin_memory else None
        self._reader = SlotReader(self._ring, self._ledger, pool.overflow,
                                  opts.held_batches, pinner)
        self._supervise(pool, blob, state)
        return blob

    # ---- epoch set-up ------------------------------------------------------
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        if not first_iter:  # a persistent iterator's next epoch
            self._meter.begin(self._num_workers, loader_label(loader, self._auto is not None),
                              self._auto is not None)
            self._meter_epoch = self._meter.epoch
            self._epoch_over = False
        if not first_iter and self._fatal is None:
            # Tasks the previous epoch still owed (the loop broke out): DataLoader
            # had sent them, and its workers fetch them before the new epoch,
            # which moves a persistent worker's RNG.
            self._pay_refills()
        saved = self._saved if first_iter else None
        mid_epoch = saved is not None and saved["position"] is not None
        if first_iter and self._first_start is not None:
            start = self._first_start
        elif mid_epoch:
            start = saved["epoch_start"]
        else:
            start = resume.epoch_start(loader, self._base_seed, False)
        yielded_before = self._num_yielded if not first_iter else 0
        super()._reset(loader, first_iter)
        if self._prefetcher is not None:
            self._prefetcher.reset()
        if self._fatal is not None:  # a persistent pool that lost a worker stays failed
            raise RuntimeError(self._fatal)
        if not first_iter:
            self._next_session_epoch()
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info = {}
        self._tasks_outstanding = 0
        self._owed: List[Any] = []  # indices drawn for tasks not sent yet (_process_data)
        self._sampler_done = False
        if getattr(self, "_retiring", None) and self._pool is not None:
            self._pool.shrink(self._num_workers)  # the epoch before drained their tasks
        self._workers_status = [True] * self._capacity
        self._workers_num_tasks = [0] * self._capacity
        self._retiring: List[int] = []  # workers num_workers="auto" retires once their tasks are in
        self._finished = False
        self._drawn = 0
        first_worker, replay = 0, None
        if mid_epoch:
            first_worker, replay = self._fast_forward(saved, loader)
        else:
            self._book.new_epoch(start, yielded_before)
        self._worker_queue_idx_cycle = itertools.cycle(
            [*range(first_worker, self._num_workers), *range(first_worker)])
        try:
            for _ in range(self._prefetch_factor * self._num_workers):
                self._try_put_index()
        finally:
            if replay is not None:
                replay.done()
        if not first_iter:
            self._meter.started()
        self._start_windows()

    def _release_unclaimed(self) -> None:
        """Free the slots of results nobody will take (their batches were skipped)."""
        for rec in self._task_info.values():
            if rec.done:
                self._ledger.discard(rec)
        self._task_info = {}

    # ---- sending -----------------------------------------------------------
    def _try_put_index(self, index: Any = _NO_INDEX) -> None:
        """DataLoader's: send the sampler's next index (or ``index``, drawn
        earlier) to the next active worker."""
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks and not self._retiring:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")
        if index is _NO_INDEX:
            try:
                index = self._next_index()
            except StopIteration:
                self._sampler_done = True
                return
        if self._tasks_outstanding >= max_tasks:
            # Workers being retired still hold tasks beyond the new count's
            # share: the task waits, its index drawn in DataLoader's order.
            self._owed.insert(0, index)
            return
        for _ in range(self._num_workers):  # find the next active worker, if any
            worker_queue_idx = next(self._worker_queue_idx_cycle)
            self._cycle_next = (worker_queue_idx + 1) % self._num_workers
            if self._workers_status[worker_queue_idx]:
                if self._in_order:
                    break
                elif self._workers_num_tasks[worker_queue_idx] < max_tasks // sum(
                    self._workers_status[: self._num_workers]
                ):
                    break
        else:
            return
        while self._send_idx in self._skip_send:  # delivered before a resume
            self._skip_send.discard(self._send_idx)
            self._send_idx += 1
        rec = self._ledger.assign(Role.BATCH, worker_queue_idx,
                                  encode_fetch(self._epoch, self._send_idx, index),
                                  idx=self._send_idx, index=index)
        self._task_info[self._send_idx] = rec
        self._workers_num_tasks[worker_queue_idx] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    def _pay_refills(self) -> None:
        """Send the tasks :meth:`_process_data` deferred (NOTE [ Ordering ]),
        as many as the worker count allows."""
        limit = self._prefetch_factor * self._num_workers
        while self._owed and self._tasks_outstanding < limit:
            self._try_put_index(self._owed.pop(0))


    def __next__(self) -> Any:
        # The loop's wait for a batch, for stats(): the whole next() call.
        t0 = time.perf_counter_ns()
        try:
            data = super().__next__()
        except StopIteration:
            if self._meter_epoch == self._meter.epoch:
                self._meter.waited(time.perf_counter_ns() - t0)
                self._meter.end()
            raise
        meter = self._meter
        if self._meter_epoch == meter.epoch:
            now = time.perf_counter_ns()
            meter.delivered(now - t0, self._read_ns, self._delivered_samples,
                            self._reader.batch_bytes)
            if self._epoch_over:
                meter.end()
            elif self._auto is not None and now >= self._auto[1].due_ns:
                self._rescale(now)
        return data

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
                self._finished = True
                if not self._persistent_workers:
                    self._hand_back_pool()
                raise StopIteration

            rec = self._task_info[self._rcvd_idx]
            if rec.done:
                del self._task_info[self._rcvd_idx]
                self._rcvd_idx += 1
                return self._deliver(rec)

            if self._shutdown or self._tasks_outstanding <= 0:
                raise AssertionError("Invalid iterator state: no outstanding tasks")
            got = self._receive_one(deadline, rec if self._in_order else None)
            self._tasks_outstanding -= 1
            if got.kind == Kind.EXHAUSTED:
                self._ledger.discard(got)
                if self._task_info.get(got.idx) is got:
                    del self._task_info[got.idx]
                if self._workers_status[got.worker]:
                    self._workers_status[got.worker] = False
                    self._try_put_index()
                continue
            if self._task_info.get(got.idx) is not got:
                self._ledger.discard(got)  # a task skipped above: nobody wants it
                continue
            if got.idx != self._rcvd_idx:
                if not self._in_order:
                    del self._task_info[got.idx]
                    return self._deliver(got)
                continue  # stays in its slot until its turn
            del self._task_info[got.idx]
            self._rcvd_idx += 1
            return self._deliver(got)

    def _deliver(self, rec: Record) -> Any:
        data = self._process_data(rec)
        if (self._sampler_done and not self._task_info and not self._owed
                and self._tasks_outstanding == 0):
            # That was the epoch's last batch: its figures are final, and the
            # pool goes back now, not at the StopIteration that a loop
            # stopping after len(loader) batches (Lightning's does) never
            # asks for; the next iter() finds it warm.
            self._epoch_over = True
            if not self._persistent_workers:
                self._hand_back_pool()
        return data

    def _process_data(self, rec: Record) -> Any:
        self._workers_num_tasks[rec.worker] -= 1
        t0 = time.perf_counter_ns()
        self._delivered_samples = samples_in(rec.index, self._auto_collation)
        try:
            data = self._reader.take(rec)
            if self._reader.copied:
                self._meter.copied += 1
            if rec.kind & FLAG_OVERFLOW:
                self._meter.overflow += 1
        finally:
            self._book.taken(rec.worker, rec.idx, self._reader.snapshot, self._num_yielded)
            state = self._state_ref()
            if state is not None and self._reader.batch_bytes:
                state.learn(self._reader.batch_bytes)
            if self._prefetch_factor > 1:
                # NOTE [ Ordering ]: the refill goes out at the next __next__;
                # its index is drawn now, as DataLoader draws it.
                try:
                    self._owed.append(self._next_index())
                except StopIteration:
                    self._sampler_done = True
            else:  # each worker would idle: send it at once, as DataLoader does
                self._try_put_index()
        if self._pin_memory:
            if self._pinner is not None:  # views of a registered slot stay as they are
                data = self._pinner.pin(data)
            else:  # no host-register call: copy as DataLoader's pin thread does
                data = pin_memory(data, self._pin_memory_device)
                self._meter.pin_copied += 1
        self._read_ns = time.perf_counter_ns() - t0
        if self._retiring:
            self._retire_idle()
        return data

    # ---- fastload.debug ----------------------------------------------------
    def debug_view(self) -> IteratorView:
        """This iterator as :func:`fastload.debug.debug_view` shows it."""
        pool = self._pool
        return IteratorView(
            num_workers=self._num_workers, pool=pool.debug_view() if pool is not None else None,
            ring=RingView(self._ring), shut_down=self._shutdown, hang_timeout=self._hang_timeout,
            held_batches=self._held_batches, restarts_left=self._supervisor.restarts_left,
            base_seed=self._base_seed)


