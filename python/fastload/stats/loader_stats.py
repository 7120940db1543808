"""What a loader says of an epoch: :class:`LoaderStats`, and what it means.

:meth:`fastload.FastLoader.stats` and :func:`fastload.stats` return a
:class:`LoaderStats`: the figures of one epoch, as the loader's
:class:`fastload.stats.meter.EpochMeter` measured them (the module says
what is measured, and where). :func:`advice` reads them: how long the loop
waited, what bounded the epoch (the workers, a straggler, the main
process), and what to try; :func:`summary` is the short line for logs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

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


def enough_batches(s: LoaderStats) -> bool:
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
    if not enough_batches(s):
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

