"""What a loader measures of itself: is the training loop waiting for data?

Only the loader sees every wait of the training loop, every batch and every
worker, so it keeps the figures that answer "am I data-bound?" and "is one
worker a straggler?" while it runs: :class:`EpochMeter` (one per loader,
kept across its iterators) records them, :meth:`fastload.FastLoader.stats`
and :func:`stats` return them as a :class:`LoaderStats`.

What is measured, and where:

* the training loop's **wait**: the time each ``next()`` took, in the main
  process (two clock reads per batch). ``iter()`` is timed apart
  (``start_s``): it starts workers and sends the first tasks;
* the time a worker took to **make** each batch (fetch the samples,
  collate, write the batch into its slot), measured by the worker with two
  clock reads and handed to the main process in the slot's header;
* the main process's time turning a slot into the batch it hands out
  (``read_s``: unpickling its structure, the copies it had to make).

Percentiles come from a histogram with 16 buckets per power of two (a
value is known to within 3%), so memory stays constant however long the
epoch and :meth:`EpochMeter.stats` costs the same at any batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Dict, List, Optional, Tuple

from .autoscale import cores_available

log = logging.getLogger("fastload")
# One DEBUG record per epoch started and ended, carrying the meter
# (``record.fastload_meter``) and, at the end, the epoch's figures
# (``record.fastload_stats``): ``python -m fastload run --report`` reads them,
# and so may any logging handler a user adds.
stats_log = logging.getLogger("fastload.stats")

__all__ = ["LoaderStats", "Percentiles", "SlowBatch", "EpochMeter", "advice", "loader_label"]

_SUB = 16  # histogram buckets per power of two
_SUB_BITS = 4
_BUCKETS = 64 * _SUB


def _bucket(ns: int) -> int:
    """The histogram bucket of a duration in nanoseconds (integer maths only:
    this runs for every batch)."""
    bits = ns.bit_length()
    if bits <= _SUB_BITS:
        return ns
    return ((bits - _SUB_BITS) << _SUB_BITS) | ((ns >> (bits - _SUB_BITS - 1)) & (_SUB - 1))


def _bucket_middle(b: int) -> float:
    """The value (ns) a bucket stands for: the middle of its range."""
    if b < _SUB:
        return float(b)
    octave, sub = b >> _SUB_BITS, b & (_SUB - 1)
    low = (_SUB + sub) << (octave - 1)
    return low + (1 << (octave - 1)) / 2


def _quantiles(hist: List[int], count: int, qs: Tuple[float, ...]) -> List[float]:
    """Nearest-rank quantiles (ms) of the durations counted in ``hist``."""
    if count == 0:
        return [0.0] * len(qs)
    ranks = [max(1, math.ceil(q * count)) for q in qs]
    out: List[float] = []
    seen = 0
    i = 0
    for b, n in enumerate(hist):
        if not n:
            continue
        seen += n
        while i < len(ranks) and seen >= ranks[i]:
            out.append(_bucket_middle(b) / 1e6)
            i += 1
        if i == len(ranks):
            break
    return out


@dataclasses.dataclass(frozen=True)
class Percentiles:
    """p50 / p95 / p99 of a duration, in milliseconds (0.0 with no samples)."""

    p50: float
    p95: float
    p99: float


@dataclasses.dataclass(frozen=True)
class SlowBatch:
    """The batch a worker took longest to make in the epoch."""

    worker: int
    make_ms: float
    batch: int  # its number in the epoch
    indices: Any  # what the sampler gave for it (a list of indices with batch_size)


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """One epoch of a loader, as it went (the epoch in progress, or the last
    one when asked between epochs).

    ``wait_share`` is the answer to "is my training data-bound?": the share
    of the epoch's wall time the training loop spent inside ``next()``
    waiting for a batch. ``worker_busy_share`` says why: workers busy nearly
    all the time make batches as fast as they can (more workers, or cheaper
    transforms, would help); workers idle while the loop waits point at the
    main process (``read_s``, ``copied_batches``, ``pin_copied_batches``).
    """

    epoch: int  # the loader's epoch number: its iter() calls, counted from 0
    finished: bool  # the epoch's last batch was delivered
    batches: int  # batches delivered
    samples: int  # samples in them
    wall_s: float  # from the end of iter() to the last batch delivered (or now)
    samples_per_s: float
    start_s: float  # what iter() took: starting workers, sending the first tasks
    wait_s: float  # time the loop spent inside next()
    wait_share: float  # wait_s / wall_s
    wait_ms: Percentiles  # of each next()
    make_ms: Percentiles  # of each batch's making, in its worker
    read_s: float  # main-process time turning slots into batches (inside wait_s)
    workers: int  # worker processes in use (0: batches made in the main process)
    worker_busy_share: Tuple[float, ...]  # per worker: time making batches / time since its first
    worker_make_p99_ms: Tuple[float, ...]  # per worker, to spot a straggler
    slowest: Optional[SlowBatch]
    copied_batches: int  # copied out of the ring: the loop held more than held_batches
    pin_copied_batches: int  # copied to pinned memory (no host-register call to pin the ring)
    overflow_batches: int  # bigger than a slot: sent through a segment of their own
    restarts: int  # workers restarted (max_worker_restarts)
    bytes_per_batch: float

    def as_dict(self) -> Dict[str, float]:
        """Flat ``name -> number`` for loggers (TensorBoard's ``add_scalars``,
        W&B's ``log``, Lightning's ``log_dict``): percentiles as
        ``wait_ms_p50``, per-worker figures as ``worker_busy_share/3``."""
        out: Dict[str, float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Percentiles):
                for q in ("p50", "p95", "p99"):
                    out[f"{f.name}_{q}"] = getattr(value, q)
            elif isinstance(value, tuple):
                for i, v in enumerate(value):
                    out[f"{f.name}/{i}"] = v
            elif isinstance(value, SlowBatch):
                out["slowest_make_ms"] = value.make_ms
                out["slowest_worker"] = float(value.worker)
            elif isinstance(value, (bool, int, float)):
                out[f.name] = float(value)
        return out


_QS = (0.50, 0.95, 0.99)


class EpochMeter:
    """The figures of one loader's epochs (see the module's docstring).

    The iterator calls :meth:`begin` at ``iter()``, :meth:`started` when
    ``iter()`` is done, :meth:`made` for each batch a worker finished,
    :meth:`delivered` for each batch handed out, and :meth:`end` after the
    epoch's last one. Nothing here holds the loader or its workers.
    """

    def __init__(self) -> None:
        self.label = "loader"
        self.epoch = -1
        self.history: List[LoaderStats] = []  # finished epochs, the newest last (at most 1000)
        self._reset(0)

    def _reset(self, workers: int) -> None:
        self.finished = False
        self.workers = workers
        self._t_iter = self._t0 = time.perf_counter_ns()
        self._t_end: Optional[int] = None
        self._t_last: Optional[int] = None  # the last batch's delivery
        self.batches = self.samples = self.bytes = 0
        self.wait_ns = self.read_ns = 0
        self.copied = self.pin_copied = self.overflow = self.restarts = 0
        self._wait_hist = [0] * _BUCKETS
        self._make_hist = [0] * _BUCKETS
        self._made = 0
        self._busy_ns = [0] * workers
        # when each worker began its first batch of the epoch (estimated from
        # the batch's make time): a worker still starting is not idle
        self._first_ns: List[Optional[int]] = [None] * workers
        self._worker_hist = [[0] * _BUCKETS for _ in range(workers)]
        self._worker_made = [0] * workers
        self._slowest: Optional[SlowBatch] = None
        self._slowest_ns = -1

    # ---- the iterator's calls --------------------------------------------------
    def begin(self, workers: int, label: str) -> None:
        """``iter()`` was called: a new epoch with ``workers`` workers."""
        self.epoch += 1
        self.label = label
        self._reset(workers)
        stats_log.debug("fastload: %s: epoch %d begins", label, self.epoch,
                        extra={"fastload_meter": self})

    def resize(self, workers: int) -> None:
        """The worker count changed mid-epoch (``num_workers="auto"``): new
        workers get figures of their own; retired ones keep theirs."""
        for _ in range(workers - len(self._busy_ns)):
            self._busy_ns.append(0)
            self._first_ns.append(None)
            self._worker_hist.append([0] * _BUCKETS)
            self._worker_made.append(0)
        self.workers = workers

    @property
    def busy_ns(self) -> int:
        """The workers' time making batches so far this epoch, summed."""
        return sum(self._busy_ns)

    def started(self) -> None:
        """``iter()`` is done: the epoch's wall time starts."""
        self._t0 = time.perf_counter_ns()

    def made(self, worker: int, make_ns: int, batch: int, indices: Any) -> None:
        """Worker ``worker`` took ``make_ns`` to make batch ``batch``."""
        b = _bucket(make_ns)
        self._make_hist[b] += 1
        self._made += 1
        if 0 <= worker < len(self._busy_ns):  # -1: the main process (num_workers=0)
            if self._first_ns[worker] is None:
                self._first_ns[worker] = max(self._t0, time.perf_counter_ns() - make_ns)
            self._busy_ns[worker] += make_ns
            self._worker_hist[worker][b] += 1
            self._worker_made[worker] += 1
        if make_ns > self._slowest_ns:
            self._slowest_ns = make_ns
            self._slowest = SlowBatch(worker, make_ns / 1e6, batch, indices)

    def delivered(self, wait_ns: int, read_ns: int, samples: int, nbytes: int) -> None:
        """A batch of ``samples`` samples left ``next()`` after ``wait_ns``,
        ``read_ns`` of which the main process spent reading it."""
        self._wait_hist[_bucket(wait_ns)] += 1
        self.wait_ns += wait_ns
        self.read_ns += read_ns
        self.batches += 1
        self.samples += samples
        self.bytes += nbytes
        self._t_last = time.perf_counter_ns()

    def waited(self, wait_ns: int) -> None:
        """A ``next()`` that delivered nothing (the epoch's StopIteration)."""
        self.wait_ns += wait_ns

    def restarted(self) -> None:
        self.restarts += 1

    def end(self) -> LoaderStats:
        """The epoch's last batch was delivered: freeze its figures."""
        if not self.finished:
            self._t_end = time.perf_counter_ns()
            self.finished = True
            done = self.stats()
            self.history.append(done)
            del self.history[:-1000]
            stats_log.debug("fastload: %s: epoch %d: %s", self.label, self.epoch, summary(done),
                            extra={"fastload_meter": self, "fastload_stats": done})
            if done.wait_share > WAIT_SHARE_TO_REPORT and _enough(done):
                log.info("fastload: %s, epoch %d: %s", self.label, self.epoch, advice(done))
        return self.history[-1]

    # ---- reading ------------------------------------------------------------------
    def stats(self, at_last_batch: bool = False) -> LoaderStats:
        """The epoch's figures so far (final ones once it ended); with
        ``at_last_batch``, an unfinished epoch's up to its last batch
        delivered rather than up to now (a loop that broke out of it)."""
        end = self._t_end
        if end is None:
            end = self._t_last if at_last_batch and self._t_last is not None \
                else time.perf_counter_ns()
        wall_ns = max(1, end - self._t0)
        wall_s = wall_ns / 1e9
        # A worker's busy time counts from its first batch (workers get
        # their first tasks as iter() ends, and a fresh one takes a moment
        # to start) to the epoch's end.
        busy = tuple(min(1.0, ns / max(1, end - (first or end)))
                     for ns, first in zip(self._busy_ns, self._first_ns))
        worker_p99 = tuple(_quantiles(h, n, (0.99,))[0]
                           for h, n in zip(self._worker_hist, self._worker_made))
        return LoaderStats(
            epoch=self.epoch, finished=self.finished, batches=self.batches,
            samples=self.samples, wall_s=wall_s, samples_per_s=self.samples / wall_s,
            start_s=(self._t0 - self._t_iter) / 1e9, wait_s=self.wait_ns / 1e9,
            wait_share=min(1.0, self.wait_ns / wall_ns),
            wait_ms=Percentiles(*_quantiles(self._wait_hist, self.batches, _QS)),
            make_ms=Percentiles(*_quantiles(self._make_hist, self._made, _QS)),
            read_s=self.read_ns / 1e9, workers=self.workers, worker_busy_share=busy,
            worker_make_p99_ms=worker_p99, slowest=self._slowest,
            copied_batches=self.copied, pin_copied_batches=self.pin_copied,
            overflow_batches=self.overflow, restarts=self.restarts,
            bytes_per_batch=self.bytes / self.batches if self.batches else 0.0,
        )


# ---- what the figures say ----------------------------------------------------------
WAIT_SHARE_TO_REPORT = 0.10  # an epoch that waited more is reported at INFO
_BUSY = 0.80  # workers busier than this make batches as fast as they can
_STRAGGLER = 3.0  # a worker whose p99 is this many times the others' median p99


def _straggler(s: LoaderStats) -> Optional[int]:
    p99 = s.worker_make_p99_ms
    if len(p99) < 2:
        return None
    worst = max(range(len(p99)), key=p99.__getitem__)
    others = sorted(v for i, v in enumerate(p99) if i != worst)
    median = others[len(others) // 2]
    if p99[worst] > _STRAGGLER * median and p99[worst] - median > 5.0:
        return worst
    return None


def _enough(s: LoaderStats) -> bool:
    """Enough batches to tell what bounds an epoch: past the first ones,
    which wait for every worker's start (an epoch this short is not
    reported at INFO)."""
    return s.batches >= 4 * max(1, s.workers)


def advice(s: LoaderStats) -> str:
    """One line: how long the loop waited, what bounded the epoch, what to try."""
    head = (f"the training loop waited {s.wait_share:.0%} of the epoch for batches "
            f"({s.wait_s:.2f} s of {s.wall_s:.2f} s, {s.batches} batches); ")
    if s.workers == 0:
        return head + ("batches are made in the main process (num_workers=0): "
                       "worker processes (num_workers > 0) would make them meanwhile")
    if not _enough(s):
        return head + (f"too few batches ({s.batches} for {s.workers} workers) to tell what "
                       f"bounds it: the first batches wait for every worker's first one")
    busy = sum(s.worker_busy_share) / len(s.worker_busy_share)
    lagging = _straggler(s)
    if lagging is not None:
        slow = s.slowest
        where = ""
        if slow is not None and slow.worker == lagging:
            where = (f"; its slowest batch (batch {slow.batch}, samples {_short(slow.indices)}) "
                     f"took {slow.make_ms:.1f} ms")
        others = [v for i, v in enumerate(s.worker_make_p99_ms) if i != lagging]
        return head + (f"worker {lagging} is a straggler: p99 {s.worker_make_p99_ms[lagging]:.1f} ms "
                       f"to make a batch against {sorted(others)[len(others) // 2]:.1f} ms for "
                       f"the others{where}")
    if busy >= _BUSY:
        cores = cores_available()
        more = (f"more workers ({cores} cores are available to this process) or cheaper "
                f"transforms would help" if s.workers < cores else
                f"the workers already match the {cores} cores available to this process: "
                f"cheaper transforms would help, or more workers if samples wait on I/O "
                f"(network storage) rather than compute")
        return head + (f"the {s.workers} workers were busy {busy:.0%} of the time making "
                       f"batches (p50 {s.make_ms.p50:.1f} ms each): data-bound; {more}")
    causes = [f"{s.read_s:.2f} s reading batches"]
    if s.copied_batches:
        causes.append(f"{s.copied_batches} batches copied because the loop held more than "
                      f"held_batches")
    if s.pin_copied_batches:
        causes.append(f"{s.pin_copied_batches} batches copied to pinned memory")
    idle = f"the workers were busy only {busy:.0%} of the time"
    if s.read_s >= 0.25 * s.wait_s or s.copied_batches or s.pin_copied_batches:
        return head + f"{idle}, so the main process is the bound: it spent {', '.join(causes)}"
    return head + (f"{idle}, and the main process spent only {s.read_s:.2f} s reading "
                   f"batches: workers may be short of CPU (the training process's own threads "
                   f"take the cores) or of tasks (raise prefetch_factor)")


def summary(s: LoaderStats) -> str:
    """A short line of the figures that matter, for logs."""
    busy = (f", workers busy {sum(s.worker_busy_share) / len(s.worker_busy_share):.0%}"
            if s.worker_busy_share else "")
    return (f"{s.batches} batches, {s.samples_per_s:,.0f} samples/s, waited {s.wait_share:.0%} "
            f"(p50 {s.wait_ms.p50:.2f} ms, p99 {s.wait_ms.p99:.2f} ms), make p50 "
            f"{s.make_ms.p50:.2f} ms{busy}, {s.workers} workers")


def _short(indices: Any, limit: int = 8) -> str:
    try:
        items = list(indices)
    except TypeError:
        return repr(indices)
    text = ", ".join(repr(i) for i in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"


def samples_in(index: Any, auto_collation: bool) -> int:
    """How many samples the batch drawn as ``index`` holds: the batch
    sampler's list, or one sample without automatic batching."""
    if not auto_collation:
        return 1
    try:
        return len(index)
    except TypeError:  # a batch sampler's batch with no len()
        return 1


def loader_label(loader: Any, auto: bool = False) -> str:
    """How logs and reports name a loader: its class, dataset class and workers."""
    dataset = getattr(loader, "dataset", None)
    workers = "'auto'" if auto else getattr(loader, "num_workers", "?")
    return (f"{type(loader).__qualname__}({type(dataset).__qualname__}, "
            f"num_workers={workers}, batch_size={getattr(loader, 'batch_size', '?')})")
