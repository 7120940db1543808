"""The ``num_workers="auto"`` half of :class:`fastload.iterator.FastLoaderIter`.

The rule lives in :mod:`fastload.autoscale`; this mixin applies it to the
iterator: it sets the count an iterator starts with and the most it may
reach, closes a window of the epoch every few tenths of a second (from the
loader's meter and the workers' CPU clocks), and grows or shrinks the pool
between batches, keeping DataLoader's order (round-robin goes on over the
new count; tasks beyond a shrinking count's share wait, their indices drawn
in DataLoader's order). A mixin, so that the iterator's own module keeps to
DataLoader's iterator; the state it reads and sets is the iterator's.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Optional, Tuple

from torch.utils.data import DataLoader, _DatasetKind

from . import _core
from .autoscale import (WindowClock, WorkerCountPolicy, cores_available, initial_workers,
                        worker_cap)
from .loader_state import LoaderState, forced_shm

log = logging.getLogger("fastload")


class AutoCountMixin:
    """The iterator's worker-count methods (mixed into FastLoaderIter only)."""

    def _choose_count(self, loader: DataLoader, state: LoaderState,
                      saved: Optional[dict]) -> int:
        """Set the worker count to start with; returns the most workers this
        iterator may use. ``num_workers="auto"`` starts from the count saved
        with a resumed state, or the one its last epoch ended with, or the CPU
        budget; an IterableDataset's replicas shard by the count, so its
        count stays as it starts."""
        self._auto: Optional[Tuple[WorkerCountPolicy, WindowClock]] = None
        if not state.options.auto_workers:
            return self._num_workers
        cores = cores_available()
        start = (saved.get("workers_in_use") if saved is not None else None) \
            or state.auto_count or initial_workers(cores)
        self._num_workers = start
        if self._dataset_kind != _DatasetKind.Map:
            return start
        force_shm = forced_shm()
        memory = None
        if force_shm:  # the /dev/shm fallback reserves every slot's pages up front
            st = os.statvfs("/dev/shm")
            memory = st.f_bavail * st.f_frsize
        cap = max(start, worker_cap(cores, state.slot_bytes(force_shm), self._prefetch_factor,
                                    state.options.held_batches, _core.MAX_SLOTS, memory))
        self._auto = (WorkerCountPolicy(cores, cap), WindowClock())
        return cap

    def _start_windows(self) -> None:
        if self._auto is not None and self._pool is not None:
            meter = self._meter
            self._auto[1].restart(time.perf_counter_ns(), meter.batches, meter.wait_ns,
                                  meter.read_ns, meter.busy_ns, self._pool.pids)

    def _rescale(self, now: int) -> None:
        """A window of the epoch ended: let the policy change the count."""
        assert self._auto is not None
        policy, clock = self._auto
        pool, meter = self._pool, self._meter
        if pool is None or self._retiring or self._fatal is not None:
            return
        window = clock.take(now, meter.batches, meter.wait_ns, meter.read_ns, meter.busy_ns,
                            pool.pids, self._num_workers)
        if window is None:
            return
        n = self._num_workers
        new = policy.decide(window)
        if new == n:
            return
        policy.changed()
        log.info("fastload: %s: num_workers='auto' goes from %d to %d workers (last %.1f s: the "
                 "loop waited %.0f%%, workers busy %.0f%%, using %.2f cores)", meter.label, n, new,
                 window.wall_s, 100 * window.wait_s / window.wall_s,
                 100 * window.busy_s / (n * window.wall_s), window.workers_cpu_s / window.wall_s)
        if new > n:
            self._grow(new)
        else:
            self._shrink(new)
        state = self._state_ref()
        if state is not None:
            state.auto_count = self._num_workers

    def _grow(self, new: int) -> None:
        """Start workers up to ``new`` and give them tasks at once."""
        pool = self._pool
        assert pool is not None
        n = self._num_workers
        try:
            added = pool.grow(new)
        except (OSError, RuntimeError) as e:  # out of processes or memory: keep the count
            log.warning("fastload: num_workers='auto' could not start more workers (%s); "
                        "staying at %d", str(e), n)  # not e: its traceback holds the pool
            pool.shrink(n)
            assert self._auto is not None
            self._auto[0].cap = n
            return
        pool.start_session(self._session_blob, self._base_seed, added,
                           resume=[None] * self._capacity)
        self._num_workers = new
        self._meter.resize(new)
        for w in added:
            self._workers_status[w] = True
        self._rebuild_cycle()
        self._pay_refills()
        for _ in range(self._prefetch_factor * (new - n)):
            if self._tasks_outstanding >= self._prefetch_factor * new:
                break
            self._try_put_index()

    def _shrink(self, new: int) -> None:
        """Give no more tasks to the workers past ``new``; they are retired
        once their batches are delivered (:meth:`_retire_idle`)."""
        self._retiring = list(range(new, self._num_workers))
        self._num_workers = new
        assert self._pool is not None
        self._pool.num_workers = new  # the count its next session starts (reuse_workers)
        self._meter.resize(new)
        self._rebuild_cycle()
        self._retire_idle()

    def _retire_idle(self) -> None:
        if any(self._workers_num_tasks[w] for w in self._retiring):
            return
        if self._pool is not None:
            self._pool.shrink(self._num_workers)
        self._retiring = []
        self._pay_refills()

    def _rebuild_cycle(self) -> None:
        """Round-robin over the workers in use, going on where it was."""
        n = self._num_workers
        first = self._cycle_next % n
        self._worker_queue_idx_cycle = itertools.cycle([*range(first, n), *range(first)])
