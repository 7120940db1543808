"""``num_workers="auto"``: how many workers a loader uses, chosen as it runs.

No count suits every dataset and machine: a dataset that decodes JPEGs is
bound by cores, one that reads from network storage waits on I/O and wants
more workers than cores, and a training loop that keeps the cores busy
itself wants fewer. A loader with ``num_workers="auto"`` starts from the
CPU budget and then, between batches, looks at the last window of the
epoch (a few tenths of a second and a few batches):

* the loop waited for batches and the workers were busy making them: add
  workers, as many as the cores left over can run (a worker's share of CPU
  is measured, so workers that sleep on I/O are cheap and the count goes
  past the core count, and CPU-bound ones stop at it). The CPU the
  training process itself uses while it is not waiting is counted as
  taken; the count is rounded to the nearest whole worker, so it may take
  up to half a core more than is left over when that makes more batches;
* the loop hardly waited and one worker fewer could make the batches the
  others made, for several windows in a row: retire one.

A change is followed by a window that is not judged (new workers start).
:class:`WorkerCountPolicy` is only the rule: the iterator measures the
windows and changes the count (see ``iterator/auto_count.py``); :class:`CpuClock`
reads the workers' CPU time from ``/proc``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Dict, Iterable, Optional

__all__ = ["Window", "WorkerCountPolicy", "WindowClock", "CpuClock", "AUTO", "cores_available",
           "initial_workers", "worker_cap"]

AUTO = "auto"

WINDOW_S = 0.3  # a window lasts at least this long...
WINDOW_BATCHES = 2  # ...and holds at least this many batches
_WAITING = 0.05  # the loop waited more than this share of the window: worth a worker
_BUSY = 0.80  # workers busier than this make batches as fast as they can
_IDLE_BUSY = 0.70  # a loop that hardly waited, and workers that one fewer could keep
# this busy: one worker too many
_IDLE_WINDOWS = 3  # ...for this many windows in a row
_MIN_CPU = 0.05  # the least CPU a worker is assumed to take (a sleeping one takes ~0)


def cores_available() -> int:
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def initial_workers(cores: int) -> int:
    """Where ``"auto"`` starts: half the cores (the training loop keeps some),
    at least 2 and at most 8; the windows take it from there."""
    return max(2, min(8, cores // 2))


def worker_cap(cores: int, slot_bytes: int, prefetch_factor: int, held_batches: int,
               max_slots: int, memory_bytes: Optional[int] = None) -> int:
    """The most workers ``"auto"`` may reach: 16 per core (workers that wait
    on I/O go far past the cores; CPU-bound ones stop at them by the rule),
    at most 64, within the ring's slot limit, and with every slot's worth of
    memory (each worker owns ``prefetch_factor + 1``) within a quarter of
    the machine's memory."""
    cap = min(64, 16 * cores, (max_slots - held_batches) // (prefetch_factor + 1))
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover
            memory_bytes = 0
    if memory_bytes:
        cap = min(cap, (memory_bytes // 4) // max(1, slot_bytes * (prefetch_factor + 1)))
    return max(1, cap)


@dataclasses.dataclass(frozen=True)
class Window:
    """What happened in one window of an epoch (seconds)."""

    wall_s: float
    wait_s: float  # the loop's time inside next()...
    read_s: float  # ...of which the main process spent reading batches (not waiting on workers)
    busy_s: float  # the workers' time making batches, summed over workers
    workers_cpu_s: float  # the workers' CPU time, summed
    main_cpu_s: float  # the training process's CPU time (all its threads)
    workers: int  # the count through the window


class WorkerCountPolicy:
    """The rule of ``num_workers="auto"`` (see the module's docstring)."""

    def __init__(self, cores: int, cap: int, minimum: int = 1) -> None:
        self.cores = cores
        self.cap = max(minimum, cap)
        self.minimum = minimum
        self._idle_windows = 0
        self._skip = 0  # windows not judged after a change

    def changed(self) -> None:
        """The count changed: the next window shows workers starting."""
        self._skip = 1
        self._idle_windows = 0

    def decide(self, w: Window) -> int:
        """The count for the next window, given the last one."""
        n = w.workers
        if self._skip:
            self._skip -= 1
            return n
        if w.wall_s <= 0 or n <= 0:
            return n
        # What the loop waited for workers; reading the batch is the main
        # process's own work, which more workers would not shorten.
        wait_share = max(0.0, w.wait_s - w.read_s) / w.wall_s
        busy = w.busy_s / (n * w.wall_s)
        if wait_share > _WAITING and busy > _BUSY and n < self.cap:
            self._idle_windows = 0
            per_worker = max(_MIN_CPU, w.workers_cpu_s / (n * w.wall_s))
            # The loop's CPU per second it is not waiting: what it needs to
            # step at full speed, kept for it.
            stepping = max(0.1 * w.wall_s, w.wall_s - w.wait_s)
            loop_needs = min(float(self.cores), w.main_cpu_s / stepping)
            room = self.cores - loop_needs - per_worker * n
            add = min(n, self.cap - n, math.floor(room / per_worker + 0.5))
            return n + max(0, add)
        if (wait_share < _WAITING and n > self.minimum
                and busy * n / (n - 1) < _IDLE_BUSY):
            self._idle_windows += 1
            if self._idle_windows >= _IDLE_WINDOWS:
                self._idle_windows = 0
                return n - 1
            return n
        self._idle_windows = 0
        return n


class CpuClock:
    """CPU time (user + system) of processes by pid, read from
    ``/proc/<pid>/stat`` (in clock ticks, 10 ms on most kernels)."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK")
        self._last: Dict[int, float] = {}

    def used(self, pids: Iterable[int]) -> float:
        """CPU seconds ``pids`` used since the last call (a new pid: since
        it started; one that is gone counts nothing more)."""
        total = 0.0
        now: Dict[int, float] = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                value = (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime
            except (OSError, IndexError, ValueError):
                value = self._last.get(pid, 0.0)
            now[pid] = value
            total += max(0.0, value - self._last.get(pid, 0.0))
        self._last = now
        return total


class WindowClock:
    """Cuts an epoch into windows for :class:`WorkerCountPolicy`, from the
    loader's running totals (the meter's) and the processes' CPU clocks."""

    def __init__(self) -> None:
        self._cpu = CpuClock()
        self.due_ns = 0
        self.due_batches = 0
        self._start: Optional[tuple] = None

    def restart(self, now_ns: int, batches: int, wait_ns: int, read_ns: int, busy_ns: int,
                pids: Iterable[int]) -> None:
        """A window begins now (at ``iter()``, and after each window)."""
        self._cpu.used(pids)
        self._start = (now_ns, batches, wait_ns, read_ns, busy_ns, time.process_time())
        self.due_ns = now_ns + int(WINDOW_S * 1e9)
        self.due_batches = batches + WINDOW_BATCHES

    def take(self, now_ns: int, batches: int, wait_ns: int, read_ns: int, busy_ns: int,
             pids: Iterable[int], workers: int) -> Optional[Window]:
        """The window that ends now, and a new one begun; None if it is too
        short to judge (call again after the next batch)."""
        if self._start is None or now_ns < self.due_ns or batches < self.due_batches:
            return None
        t0, _b0, wait0, read0, busy0, cpu0 = self._start
        window = Window(wall_s=(now_ns - t0) / 1e9, wait_s=(wait_ns - wait0) / 1e9,
                        read_s=(read_ns - read0) / 1e9, busy_s=(busy_ns - busy0) / 1e9,
                        workers_cpu_s=self._cpu.used(pids),
                        main_cpu_s=time.process_time() - cpu0, workers=workers)
        self._start = (now_ns, batches, wait_ns, read_ns, busy_ns, time.process_time())
        self.due_ns = now_ns + int(WINDOW_S * 1e9)
        self.due_batches = batches + WINDOW_BATCHES
        return window
