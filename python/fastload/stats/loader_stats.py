"""What a loader says of an epoch: :class:`LoaderStats`, and what it means.

:meth:`fastload.FastLoader.stats` and :func:`fastload.stats` return a
:class:`LoaderStats`: the figures of one epoch, as the loader's
:class:`fastload.stats.meter.EpochMeter` measured them (the module says
what is measured, and where). :func:`advice` reads them: how long the loop
waited, what bounded the epoch (the workers, a straggler, the main
process, workers without tasks), and what to try; :func:`summary` is the short line for logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from .autoscale import cores_available

__all__ = ["LoaderStats", "Percentiles", "SlowBatch", "advice", "summary"]


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

    def __repr__(self) -> str:
        return (f"SlowBatch(worker={self.worker}, make_ms={self.make_ms:.2f}, batch={self.batch}, "
                f"indices={_short(self.indices)})")


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """One epoch of a loader, as it went (the epoch in progress, or the last
    one when asked between epochs).

    ``wait_share`` is the answer to "is my training data-bound?": the share
    of the epoch's wall time the training loop spent inside ``next()``
    waiting for a batch. ``worker_busy_share`` says why: workers busy nearly
    all the time make batches as fast as they can (more workers, or cheaper
    samples, would help); workers idle while the loop waits point at the
    main process when ``read_s`` is a good part of the wait
    (``copied_batches``, ``pin_copied_batches``, ``overflow_batches`` say
    what it copied), and at workers left without tasks when it is not.
    :func:`advice` says which, in a line. ``print(stats)`` shows a few
    lines; every figure is an attribute.
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

    def __repr__(self) -> str:
        """A few lines of the figures (``print(loader.stats())``); every
        figure in full is an attribute, the slowest batch's indices in
        ``slowest.indices``."""
        busy = _each(self.worker_busy_share, "{:.0%}")
        p99 = _each(self.worker_make_p99_ms, "{:.2f}")
        slow = "none" if self.slowest is None else (
            f"batch {self.slowest.batch} by worker {self.slowest.worker}, "
            f"{self.slowest.make_ms:.2f} ms, samples {_short(self.slowest.indices)}")
        return "\n".join([
            f"LoaderStats(epoch {self.epoch}{'' if self.finished else ' (unfinished)'}: "
            f"{self.batches} batches, {self.samples:,} samples in {self.wall_s:.2f} s "
            f"({self.samples_per_s:,.0f} samples/s); iter() took {self.start_s:.3f} s",
            f"  the loop waited {self.wait_share:.0%} of it ({self.wait_s:.3f} s); next() ms "
            f"p50/p95/p99 {_pct(self.wait_ms)}; reading batches {self.read_s:.3f} s",
            f"  {self.workers} workers, busy {busy}; make ms p50/p95/p99 {_pct(self.make_ms)}, "
            f"p99 per worker {p99}",
            f"  slowest: {slow}",
            f"  copied {self.copied_batches}, pin-copied {self.pin_copied_batches}, overflow "
            f"{self.overflow_batches}, restarts {self.restarts}, "
            f"{self.bytes_per_batch:,.0f} bytes a batch)"])

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


# ---- what the figures say ----------------------------------------------------------
WAIT_SHARE_TO_REPORT = 0.10  # an epoch that waited more is reported at INFO
_BUSY = 0.80  # workers busier than this make batches as fast as they can
_STRAGGLER = 3.0  # a worker whose p99 is this many times the others' median p99


def _made_any(s: LoaderStats) -> List[int]:
    """The workers that made a batch this epoch (a p99 of 0.0 means none: a
    worker ``num_workers="auto"`` added near the epoch's end)."""
    return [i for i, v in enumerate(s.worker_make_p99_ms) if v > 0.0]


def _straggler(s: LoaderStats) -> Optional[int]:
    made = _made_any(s)
    if len(made) < 2:
        return None
    p99 = s.worker_make_p99_ms
    worst = max(made, key=p99.__getitem__)
    median = _others_median(s, worst)
    if p99[worst] > _STRAGGLER * median and p99[worst] - median > 5.0:
        return worst
    return None


def _others_median(s: LoaderStats, worker: int) -> float:
    others = sorted(s.worker_make_p99_ms[i] for i in _made_any(s) if i != worker)
    return others[len(others) // 2]


def enough_batches(s: LoaderStats) -> bool:
    """Enough batches to tell what bounds an epoch: past the first ones,
    which wait for every worker's start (an epoch this short is not
    reported at INFO)."""
    return s.batches >= 4 * max(1, s.workers)


def advice(s: LoaderStats, auto: bool = False, started_with: Optional[int] = None) -> str:
    """One line: how long the loop waited, the one cause the figures point
    to, and what to try. ``auto``: the loader picks its worker count
    (``num_workers="auto"``), so the count is not the user's to raise;
    ``started_with``: the count the epoch began with (an epoch whose count
    changed mixes counts, and is not judged).

    The figures tell the causes apart as follows: a worker whose p99 is far
    above the others' is a straggler; workers busy nearly all the time are
    the bound (more of them, if the cores allow, or cheaper samples); idle
    workers while the loop waits mean that either the main process spent
    that time turning slots into batches (``read_s``: copies, pinning,
    unpickling) or, when it did not, that the workers had no task: every
    batch the loop waited for was still being made while the others
    waited, done, for their turn to be delivered in order."""
    head = (f"the training loop waited {s.wait_share:.0%} of the epoch for batches "
            f"({s.wait_s:.2f} s of {s.wall_s:.2f} s, {s.batches} batches); ")
    if s.workers == 0:
        return head + ("batches are made in the main process (num_workers=0), between the "
                       "loop's steps: worker processes would make them meanwhile "
                       "(num_workers=\"auto\" picks how many)")
    if not enough_batches(s):
        return head + (f"too few batches ({s.batches} for {s.workers} workers) to tell what "
                       f"bounds it: the first batches wait for every worker's first one")
    if auto and started_with is not None and started_with != s.workers:
        return head + (f"num_workers=\"auto\" changed the count during the epoch, from "
                       f"{started_with} to {s.workers} workers, so its figures mix counts: the "
                       f"next epoch starts with {s.workers} and tells what bounds the loader")
    working = _made_any(s) or list(range(len(s.worker_busy_share)))
    busy = sum(s.worker_busy_share[i] for i in working) / max(1, len(working))
    lagging = _straggler(s)
    if lagging is not None:
        slow = s.slowest
        where = ""
        if slow is not None and slow.worker == lagging:
            where = (f"; its slowest batch (batch {slow.batch}, samples {_short(slow.indices)}) "
                     f"took {slow.make_ms:.1f} ms")
        return head + (f"worker {lagging} is a straggler: p99 {s.worker_make_p99_ms[lagging]:.1f} ms "
                       f"to make a batch against {_others_median(s, lagging):.1f} ms for "
                       f"the others{where}")
    if busy >= _BUSY:
        cores = cores_available()
        bound = (f"the {s.workers} workers were busy {busy:.0%} of the time making batches "
                 f"(p50 {s.make_ms.p50:.1f} ms each): data-bound, the workers are the bound; ")
        if auto:
            return head + bound + (
                f"num_workers=\"auto\" had {s.workers} workers at the epoch's end, on {cores} "
                f"cores: it adds workers while the loop waits and the CPU they are measured to "
                f"use fits beside the training loop's (up to its caps), so once the count "
                f"stops growing, cheaper samples (transforms, decoding) or faster storage would "
                f"help")
        if s.workers < cores:
            return head + bound + (
                f"more workers would make batches faster ({cores} cores are available to this "
                f"process): num_workers=\"auto\" picks the count as the loader runs, leaving the "
                f"training loop its CPU")
        return head + bound + (
            f"they already match the {cores} cores available to this process: "
            f"num_workers=\"auto\" measures the workers' CPU use and adds workers past the cores "
            f"if they wait on I/O (network storage); if they compute, cheaper samples "
            f"(transforms, decoding) would help")
    idle = f"the workers were busy only {busy:.0%} of the time"
    if s.read_s >= 0.25 * s.wait_s:
        read = (f"{idle}: the main process is the bound, turning slots into batches "
                f"({s.read_s:.2f} s of the {s.wait_s:.2f} s waited): ")
        if s.copied_batches:
            return head + read + (
                f"{s.copied_batches} of {s.batches} batches were copied out of the ring because "
                f"the loop held more than held_batches batches at once: let go of batches "
                f"sooner, or raise held_batches")
        if s.pin_copied_batches:
            return head + read + (
                f"{s.pin_copied_batches} batches were copied into pinned memory because the ring "
                f"could not be registered with the GPU runtime (a warning said why at the start)")
        if s.overflow_batches:
            return head + read + (
                f"{s.overflow_batches} batches were bigger than a ring slot and came through "
                f"shared memory of their own: raise slot_bytes")
        return head + read + (
            "unpickling each batch's Python objects and drawing the sampler's next indices: "
            "batches of many small Python objects (strings, lists, dicts per sample) cost "
            "most, tensors least")
    return head + (
        f"{idle} and the main process spent only {s.read_s:.2f} s turning slots into "
        f"batches: the workers ran out of tasks (batches are delivered in order, so a worker "
        f"whose batches are done waits while the loop waits for another's; make time "
        f"p50 {s.make_ms.p50:.1f} ms, p99 {s.make_ms.p99:.1f} ms): a larger prefetch_factor "
        f"gives each worker more batches ahead")


def summary(s: LoaderStats) -> str:
    """A short line of the figures that matter, for logs."""
    busy = (f", workers busy {sum(s.worker_busy_share) / len(s.worker_busy_share):.0%}"
            if s.worker_busy_share else "")
    return (f"{s.batches} batches, {s.samples_per_s:,.0f} samples/s, waited {s.wait_share:.0%} "
            f"(p50 {s.wait_ms.p50:.2f} ms, p99 {s.wait_ms.p99:.2f} ms), make p50 "
            f"{s.make_ms.p50:.2f} ms{busy}, {s.workers} workers")


def _each(values: Tuple[float, ...], fmt: str) -> str:
    """Per-worker figures: each of up to 8, else the least, median and most."""
    if len(values) <= 8:
        return ", ".join(fmt.format(v) for v in values) or "-"
    v = sorted(values)
    return (f"{fmt.format(v[0])} to {fmt.format(v[-1])} "
            f"(median {fmt.format(v[len(v) // 2])})")


def _pct(p: Percentiles) -> str:
    return f"{p.p50:.2f} / {p.p95:.2f} / {p.p99:.2f}"


def _short(indices: Any, limit: int = 8) -> str:
    """At most ``limit`` indices, then how many there are in all."""
    try:
        items = list(indices)
    except TypeError:
        return repr(indices)
    text = ", ".join(repr(i) for i in items[:limit])
    return f"[{text}, ... {len(items)} in all]" if len(items) > limit else f"[{text}]"

