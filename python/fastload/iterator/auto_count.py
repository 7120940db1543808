"""The worker count of an iterator under ``num_workers="auto"``.

The rule lives in :mod:`fastload.stats.autoscale`; :class:`AutoCount`
applies it to one iterator: it sets the count the iterator starts with and
the most it may reach, and closes a window of the epoch every few tenths of
a second (from the loader's meter and the workers' CPU clocks), saying when
the count should change. The iterator then grows or shrinks its pool and
its schedule between batches, keeping DataLoader's order (round-robin goes
on over the new count; tasks beyond a shrinking count's share wait, their
indices drawn in DataLoader's order).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence, Tuple

from torch.utils.data import _DatasetKind

from .. import _core
from ..stats.autoscale import (WindowClock, WorkerCountPolicy, cores_available, initial_workers,
                               worker_cap)
from ..stats.meter import EpochMeter
from ..pool.keeper import forced_shm
from .loader_runtime import LoaderOptions

log = logging.getLogger("fastload")


class AutoCount:
    """The count controller of one ``num_workers="auto"`` iterator."""

    def __init__(self, cores: int, cap: int) -> None:
        self._policy = WorkerCountPolicy(cores, cap)
        self._clock = WindowClock()

    @classmethod
    def choose(cls, options: LoaderOptions, num_workers: int, dataset_kind: Any,
               prefetch_factor: int, slot_bytes: Any, saved: Optional[dict],
               last_count: Optional[int]) -> Tuple[int, int, Optional["AutoCount"]]:
        """The count an iterator starts with, the most it may use, and its
        controller (None: the count is fixed). ``num_workers="auto"``
        starts from the count saved with a resumed state, or the one its
        loader's last epoch ended with (``last_count``), or the CPU budget;
        an IterableDataset's replicas shard by the count, so its count
        stays as it starts. ``slot_bytes(force_shm)``: the slot size."""
        if not options.auto_workers:
            return num_workers, num_workers, None
        cores = cores_available()
        start = (saved.get("workers_in_use") if saved is not None else None) \
            or last_count or initial_workers(cores)
        if dataset_kind != _DatasetKind.Map:
            return start, start, None
        force_shm = forced_shm()
        memory = None
        if force_shm:  # the /dev/shm fallback reserves every slot's pages up front
            st = os.statvfs("/dev/shm")
            memory = st.f_bavail * st.f_frsize
        cap = max(start, worker_cap(cores, slot_bytes(force_shm), prefetch_factor,
                                    options.held_batches, _core.MAX_SLOTS, memory))
        return start, cap, cls(cores, cap)

    def restart(self, meter: EpochMeter, pids: Sequence[int]) -> None:
        """An epoch starts: its first window starts now."""
        self._clock.restart(time.perf_counter_ns(), meter.batches, meter.wait_ns,
                            meter.read_ns, meter.busy_ns, pids)

    def due(self, now: int) -> bool:
        """Whether a window of the epoch has ended by ``now`` (ns)."""
        return now >= self._clock.due_ns

    def decide(self, now: int, meter: EpochMeter, pids: Sequence[int], n: int) -> Optional[int]:
        """A window ended: the count to change to, or None to keep ``n``."""
        window = self._clock.take(now, meter.batches, meter.wait_ns, meter.read_ns,
                                  meter.busy_ns, pids, n)
        if window is None:
            return None
        new = self._policy.decide(window)
        if new == n:
            return None
        self._policy.changed()
        log.info("fastload: %s: num_workers='auto' goes from %d to %d workers (last %.1f s: the "
                 "loop waited %.0f%%, workers busy %.0f%%, using %.2f cores)", meter.label, n, new,
                 window.wall_s, 100 * window.wait_s / window.wall_s,
                 100 * window.busy_s / (n * window.wall_s), window.workers_cpu_s / window.wall_s)
        return new

    def cap_at(self, n: int) -> None:
        """More workers could not be started: ``n`` is the most from now on."""
        self._policy.cap = n
