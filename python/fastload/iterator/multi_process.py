"""The multi-process iterator: DataLoader's, step for step, over the ring.

:class:`FastLoaderIter` mirrors ``torch.utils.data.dataloader.
_MultiProcessingDataLoaderIter`` and does only what it does: draw indices
from the sampler, send them to workers round-robin over the active ones,
keep ``prefetch_factor`` tasks per worker outstanding, hand batches out in
order (or as they come with ``in_order=False``), mark IterableDataset
replicas that ran out, and start the next epoch of persistent workers. It
is a driver: each piece of its state belongs to one part, which it asks
what to do and which never calls back into it:

* :class:`.schedule.TaskSchedule`: which worker gets the next task, which
  batch the loop gets next, the refills deferred (NOTE [ Ordering ]);
* :class:`.resume_cursor.ResumeCursor`: its position for ``state_dict()``,
  and getting back to a loaded one;
* :class:`.auto_count.AutoCount`: the worker count under
  ``num_workers="auto"``;
* :class:`.workers.PoolSession`: its session on the pool's workers, its
  waits for their results under the supervisor, its end (NOTE [ Shutdown ]);
* :class:`fastload.transport.reader.SlotReader`: a done slot back into a batch;
* :class:`fastload.stats.meter.EpochMeter` (the loader's): what ``stats()`` says;
* :class:`.loader_runtime.LoaderRuntime` (the loader's): the pool, kept warm.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, _DatasetKind
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..common.debug_views import IteratorView, RingView
from ..device.prefetch import DevicePrefetcher
from ..common.inherited import InheritedSettings
from ..launching import parcels
from ..launching.start_methods import default_context
from ..pool.ledger import Record
from ..pool.worker_pool import WorkerPool
from ..common.protocol import FLAG_OVERFLOW
from ..resume import book
from ..stats.meter import EpochMeter, loader_label, samples_in
from ..transport.reader import SlotReader
from .auto_count import AutoCount
from .loader_runtime import LoaderOptions, LoaderRuntime
from .resume_cursor import ResumeCursor
from .schedule import Arrival, Due, TaskSchedule
from .workers import PoolSession

log = logging.getLogger("fastload")

_profiler_on = torch._C._autograd._profiler_enabled
_dataloader_next = _BaseDataLoaderIter.__next__


class FastLoaderIter(_BaseDataLoaderIter):
    """Multi-process iterator over the ring; mirrors _MultiProcessingDataLoaderIter."""

    def __init__(self, loader: DataLoader, state: LoaderRuntime, *, stream_ops: Any = None,
                 device_runtime: Any = None) -> None:
        """``state``: fastload's state for ``loader``; ``stream_ops`` and
        ``device_runtime``: device prefetch and ring pinning (None: off)."""
        meter: EpochMeter = state.meter
        self._meter = meter
        self._auto_asked = state.options.auto_workers  # num_workers="auto", for the meter
        meter.begin(loader.num_workers, loader_label(loader, self._auto_asked), self._auto_asked)
        self._meter_epoch = meter.epoch
        self._epoch_over = False  # the epoch's last batch was handed out (stats())
        self._read_ns = 0
        self._delivered_samples = 0
        self._session: Optional[PoolSession] = None
        self._owner_pid = os.getpid()
        saved = state.take_resume()
        first_start = None
        if saved is None:
            first_start = book.epoch_start(loader, None, True)
        super().__init__(loader)  # draws the base seed as any iter() does (NOTE [ Resume ])
        opts = state.options
        self._prefetch_factor: int = loader.prefetch_factor  # type: ignore[assignment]
        if self._prefetch_factor <= 0:
            raise AssertionError("prefetch_factor must be greater than 0 for multi-process loading")
        self._num_workers, self._capacity, self._auto = AutoCount.choose(
            opts, self._num_workers, self._dataset_kind, self._prefetch_factor,
            state.slot_bytes, saved, state.auto_count)
        if saved is not None:
            self._base_seed = saved["base_seed"]
        else:
            first_start["base_seed"] = self._base_seed  # type: ignore[index]
        self._cursor = ResumeCursor(self._capacity, saved, first_start)
        self._finished = False
        state.live_iterator = weakref.ref(self)
        self._in_order = getattr(loader, "in_order", True)
        self._state_ref = weakref.ref(state)
        self._held_batches = opts.held_batches
        self._hang_timeout = opts.hang_timeout
        self._prefetcher = DevicePrefetcher(stream_ops) if stream_ops is not None else None
        if stream_ops is not None and opts.device is not None and opts.device.type == "cuda":
            # Overlapping the copy needs pinned memory: pin the ring too.
            self._pin_memory = True
            self._pin_memory_device = "cuda"
        parcel = self._open_pool(loader, state, device_runtime)
        try:
            assert self._session is not None
            self._session.start(parcel, self._num_workers, self._cursor.worker_resumes(), state)
        except BaseException:
            self._shutdown_workers()
            raise
        self._reset(loader, first_iter=True)
        meter.started()

    def _open_pool(self, loader: DataLoader, state: LoaderRuntime,
                   device_runtime: Any) -> Optional[parcels.Parcel]:
        """Pack the session, take a pool (warm or new) and set up its parts;
        returns the packed session for the session's start."""
        opts = state.options
        parcel, ctx, inherited = parcels.pack_session(
            (InheritedSettings.capture(), self._dataset, self._collate_fn, loader.worker_init_fn,
             self._dataset_kind, self._auto_collation, self._drop_last),
            loader.multiprocessing_context or default_context(), state.pools)
        pool = state.pool_for(ctx, self._num_workers, self._prefetch_factor,
                              persistent=self._persistent_workers, inherited=inherited,
                              capacity=self._capacity)
        try:
            self._take_pool(pool, state, opts, parcel, device_runtime)
        except BaseException:  # the session does not hold it yet: nobody else stops it
            pool.shutdown()
            raise
        return parcel

    def _take_pool(self, pool: WorkerPool, state: LoaderRuntime, opts: LoaderOptions,
                   parcel: Optional[parcels.Parcel], device_runtime: Any) -> None:
        """Set up this iterator's parts over ``pool``."""
        if self._auto is not None:
            self._num_workers = pool.num_workers  # a warm pool keeps the count it ended with
            state.meter.resize(pool.num_workers)
        if self._pin_memory and pool.pinner is None and device_runtime is not None:
            runtime = device_runtime(self._pin_memory_device)
            if runtime is not None:
                pool.pin(runtime)
        pinner = self._pinner = pool.pinner if self._pin_memory else None
        self._reader = SlotReader(pool.ring, pool.overflow, opts.held_batches, pinner)
        self._ledger = pool.ledger
        self._schedule = TaskSchedule(pool.ledger, self._capacity, self._prefetch_factor,
                                      self._in_order)
        self._session = PoolSession(
            pool, opts, self._meter, self._base_seed, parcel,
            restartable=self._dataset_kind == _DatasetKind.Map,
            keep_parcel=opts.max_worker_restarts > 0 or self._auto is not None,
            resume_book=self._cursor.book, reader=self._reader)

    # ---- epoch set-up ------------------------------------------------------
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        session, schedule, cursor = self._session, self._schedule, self._cursor
        assert session is not None
        if not first_iter:  # a persistent iterator's next epoch
            self._meter.begin(self._num_workers, loader_label(loader, self._auto_asked),
                              self._auto_asked)
            self._meter_epoch = self._meter.epoch
            self._epoch_over = False
        if not first_iter and session.failure is None:
            # Tasks the previous epoch still owed (the loop broke out): DataLoader
            # had sent them, and its workers fetch them before the new epoch,
            # which moves a persistent worker's RNG.
            schedule.pay(session.epoch)
        mid_epoch = cursor.begin_epoch(loader, self._base_seed, first_iter)
        yielded_before = self._num_yielded if not first_iter else 0
        super()._reset(loader, first_iter)
        if self._prefetcher is not None:
            self._prefetcher.reset()
        if session.failure is not None:  # a persistent pool that lost a worker stays failed
            raise RuntimeError(session.failure)
        if not first_iter:
            schedule.release_unclaimed()
            session.next_epoch(self._state_ref())
        if schedule.retiring and session.pool is not None:
            session.pool.shrink(self._num_workers)  # the epoch before drained their tasks
        self._finished = False
        replay = None
        if mid_epoch:
            ff = cursor.fast_forward(loader, self._sampler_iter, self._index_sampler)
            self._sampler_iter = ff.sampler_iter
            self._num_yielded = ff.yielded
            schedule.reset(self._num_workers, first_batch=ff.first_batch,
                           first_worker=ff.first_worker, active=ff.active, skip=ff.skip)
            schedule.sampler_done = ff.sampler_done
            replay = ff.replay
        else:
            cursor.enter_epoch(yielded_before)
            schedule.reset(self._num_workers)
        try:
            for _ in range(self._prefetch_factor * self._num_workers):
                self._try_put_index()
        finally:
            if replay is not None:
                replay.done()
        if not first_iter:
            self._meter.started()
        if self._auto is not None and session.pool is not None:
            self._auto.restart(self._meter, session.pool.pids)

    # ---- sending -----------------------------------------------------------
    def _next_index(self) -> Any:
        """The sampler's next index (a resumed epoch skips those of batches
        delivered before the state was saved)."""
        return self._cursor.draw(self._sampler_iter)

    def _try_put_index(self) -> None:
        """DataLoader's: send the sampler's next index to the next active worker."""
        self._schedule.check_room()
        try:
            index = self._next_index()
        except StopIteration:
            self._schedule.sampler_done = True
            return
        assert self._session is not None
        self._schedule.send(index, self._session.epoch)

    # ---- receiving ---------------------------------------------------------
    def __next__(self) -> Any:
        # The loop's wait for a batch, for stats(): the whole next() call.
        t0 = time.perf_counter_ns()
        try:
            data = self._next_as_dataloader()
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
            elif self._auto is not None and self._auto.due(now):
                self._rescale(now)
        return data

    def _next_as_dataloader(self) -> Any:
        """``_BaseDataLoaderIter.__next__``, without the profiler annotation
        (``record_function``, about 10-30 us a batch) unless a profiler runs.
        torch's own ``__next__`` runs whenever a profiler is on (Python's, or
        one started from outside Python), and where it may warn of an
        IterableDataset longer than its ``len()``, so its words stay its own.
        A RecordFunction observer that is no profiler sees no
        ``enumerate(DataLoader)`` span."""
        if _profiler_on() or self._IterableDataset_len_called is not None:
            return _dataloader_next(self)
        if self._sampler_iter is None:
            self._reset()  # type: ignore[call-arg]  # as torch's __next__ does
        data = self._next_data()
        self._num_yielded += 1
        return data

    def _next_data(self) -> Any:
        if self._prefetcher is not None:
            return self._prefetcher.next(self._next_host_batch)
        return self._next_host_batch()

    def _next_host_batch(self) -> Any:
        session, schedule = self._session, self._schedule
        assert session is not None
        if session.failure is not None:
            raise RuntimeError(session.failure)
        schedule.pay(session.epoch)  # before the end-of-epoch check below
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            due, rec = schedule.due()
            if due is Due.END:
                self._finished = True
                if not self._persistent_workers:
                    self._hand_back_pool()
                raise StopIteration
            if due is Due.READY:
                assert rec is not None
                return self._deliver(rec)
            if session.shut_down or schedule.outstanding <= 0:
                raise AssertionError("Invalid iterator state: no outstanding tasks")
            got = session.receive(deadline, rec if self._in_order else None, self._timeout)
            arrival = schedule.arrived(got)
            if arrival is Arrival.DELIVER:
                return self._deliver(got)
            if arrival is Arrival.REPLICA_ENDED:
                self._try_put_index()

    def _deliver(self, rec: Record) -> Any:
        data = self._process_data(rec)
        if self._schedule.drained:
            # That was the epoch's last batch: its figures are final, and the
            # pool goes back now, not at the StopIteration that a loop
            # stopping after len(loader) batches (Lightning's does) never
            # asks for; the next iter() finds it warm.
            self._epoch_over = True
            if not self._persistent_workers:
                self._hand_back_pool()
        return data

    def _process_data(self, rec: Record) -> Any:
        schedule = self._schedule
        schedule.handed_out(rec)
        t0 = time.perf_counter_ns()
        self._delivered_samples = samples_in(rec.index, self._auto_collation)
        try:
            ledger = self._ledger
            data = self._reader.take(ledger.take(rec), ledger.live_leases())
            if self._reader.copied:
                self._meter.copied += 1
            if rec.kind & FLAG_OVERFLOW:
                self._meter.overflow += 1
        finally:
            self._cursor.taken(rec.worker, rec.idx, self._reader.capture, self._num_yielded)
            state = self._state_ref()
            if state is not None and self._reader.batch_bytes:
                state.pools.learn(self._reader.batch_bytes)
            if self._prefetch_factor > 1:
                # NOTE [ Ordering ]: the refill goes out at the next __next__;
                # its index is drawn now, as DataLoader draws it.
                try:
                    schedule.owe(self._next_index())
                except StopIteration:
                    schedule.sampler_done = True
            else:  # each worker would idle: send it at once, as DataLoader does
                self._try_put_index()
        if self._pin_memory:
            if self._pinner is not None:  # views of a registered slot stay as they are
                data = self._pinner.pin(data)
            else:  # no host-register call: copy as DataLoader's pin thread does
                data = pin_memory(data, self._pin_memory_device)
                self._meter.pin_copied += 1
        self._read_ns = time.perf_counter_ns() - t0
        if schedule.retiring:
            self._retire_idle()
        return data

    # ---- num_workers="auto" ------------------------------------------------
    def _rescale(self, now: int) -> None:
        """A window of the epoch ended: let the count controller change the count."""
        assert self._auto is not None and self._session is not None
        pool = self._session.pool
        if pool is None or self._schedule.retiring or self._session.failure is not None:
            return
        new = self._auto.decide(now, self._meter, pool.pids, self._num_workers)
        if new is None:
            return
        if new > self._num_workers:
            self._grow(new)
        else:
            self._shrink(new)
        state = self._state_ref()
        if state is not None:
            state.auto_count = self._num_workers

    def _grow(self, new: int) -> None:
        """Start workers up to ``new`` and give them tasks at once."""
        session, schedule = self._session, self._schedule
        assert session is not None and session.pool is not None and self._auto is not None
        pool, n = session.pool, self._num_workers
        try:
            added = pool.grow(new)
        except (OSError, RuntimeError) as e:  # out of processes or memory: keep the count
            log.warning("fastload: num_workers='auto' could not start more workers (%s); "
                        "staying at %d", str(e), n)  # not e: its traceback holds the pool
            pool.shrink(n)
            self._auto.cap_at(n)
            return
        session.start_added(added, self._capacity)
        self._num_workers = new
        self._meter.resize(new)
        schedule.grow(new, added)
        schedule.pay(session.epoch)
        for _ in range(self._prefetch_factor * (new - n)):
            if schedule.outstanding >= self._prefetch_factor * new:
                break
            self._try_put_index()

    def _shrink(self, new: int) -> None:
        """Give no more tasks to the workers past ``new``; they are retired
        once their batches are delivered (:meth:`_retire_idle`)."""
        session = self._session
        assert session is not None and session.pool is not None
        self._schedule.shrink(new)
        self._num_workers = new
        session.pool.num_workers = new  # the count its next session starts (reuse_workers)
        self._meter.resize(new)
        self._retire_idle()

    def _retire_idle(self) -> None:
        session = self._session
        assert session is not None
        if not self._schedule.retired():
            return
        if session.pool is not None:
            session.pool.shrink(self._num_workers)  # interrupted: tried again at the next batch
        self._schedule.end_retirement()
        self._schedule.pay(session.epoch)

    # ---- resume ------------------------------------------------------------
    def resume_state(self) -> dict:
        """This iterator's position, for ``FastLoader.state_dict()``."""
        session = self._session
        if session is not None and session.failure is not None:
            raise RuntimeError(f"state_dict: the loader's iterator failed: {session.failure}")
        return self._cursor.state(
            yielded=self._num_yielded, finished=self._finished,
            persistent=self._persistent_workers, base_seed=self._base_seed,
            num_workers=self._num_workers, position=self._schedule.position)

    # ---- shutdown (NOTE [ Shutdown ] in workers.py) ------------------------
    def _hand_back_pool(self) -> None:
        """End of this iterator: give a healthy pool back to the loader, warm."""
        session = self._session
        if session is None:
            return
        state = self._state_ref()
        if session.keeps_warm(state, self._persistent_workers):
            self._schedule.release_unclaimed()
        session.hand_back(state, self._persistent_workers)

    def _shutdown_workers(self, wait: bool = True) -> None:
        """Stop the workers for good (an error, a persistent iterator's end)."""
        if self._session is not None:
            self._session.shutdown(wait)

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) != os.getpid():
            # A forked child collecting its inherited copy: the pool, its
            # slots and workers are the parent's (teardown.stop_pool closes our fds).
            return
        try:
            if getattr(self, "_persistent_workers", True):
                self._shutdown_workers()
            else:
                self._hand_back_pool()
        except Exception:  # pragma: no cover - interpreter teardown
            pass

    # ---- fastload.debug ----------------------------------------------------
    def debug_view(self) -> IteratorView:
        """This iterator as :func:`fastload.debug.debug_view` shows it."""
        session = self._session
        assert session is not None
        pool = session.pool
        return IteratorView(
            num_workers=self._num_workers, pool=pool.debug_view() if pool is not None else None,
            ring=RingView(session.ring), shut_down=session.shut_down,
            hang_timeout=self._hang_timeout, held_batches=self._held_batches,
            restarts_left=session.supervisor.restarts_left, base_seed=self._base_seed)
