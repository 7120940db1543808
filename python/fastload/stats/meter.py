"""What a loader measures of itself, as it runs: :class:`EpochMeter`.

Only the loader sees every wait of the training loop, every batch and every
worker. Each loader keeps one meter across its iterators; the iterator tells
it what happened, and :meth:`EpochMeter.stats` turns that into the
:class:`fastload.stats.loader_stats.LoaderStats` that
:meth:`fastload.FastLoader.stats` returns.

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

import logging
import math
import time
from typing import Any, List, Optional, Tuple

from .loader_stats import (WAIT_SHARE_TO_REPORT, LoaderStats, Percentiles, SlowBatch, advice,
                           enough_batches, summary)

log = logging.getLogger("fastload")
# One DEBUG record per epoch started and ended, carrying the meter
# (``record.fastload_meter``) and, at the end, the epoch's figures
# (``record.fastload_stats``): ``python -m fastload run --report`` reads them,
# and so may any logging handler a user adds.
stats_log = logging.getLogger("fastload.stats")

__all__ = ["EpochMeter", "loader_label", "samples_in", "stats_log"]

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
        self.auto = False  # the worker count is num_workers="auto"'s (advice() says so)
        self.epoch = -1
        self.history: List[LoaderStats] = []  # finished epochs, the newest last (at most 1000)
        self._reset(0)

    def _reset(self, workers: int) -> None:
        self.finished = False
        self.workers = workers
        self.started_with = workers  # the count the epoch began with (resize() changes workers)
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
    def begin(self, workers: int, label: str, auto: bool = False) -> None:
        """``iter()`` was called: a new epoch with ``workers`` workers
        (``auto``: the loader picks the count, ``num_workers="auto"``)."""
        self.epoch += 1
        self.label = label
        self.auto = auto
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
            if done.wait_share > WAIT_SHARE_TO_REPORT and enough_batches(done):
                log.info("fastload: %s, epoch %d: %s", self.label, self.epoch, advice(done, self.auto, self.started_with))
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
