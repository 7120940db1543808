"""What resume support costs, measured on the ``tiny`` workload.

* ``state_dict_ms``: ``FastLoader.state_dict()`` called between batches of a
  live epoch (8 workers, ``prefetch_factor=4``: the most captures and batches
  in flight a usual configuration has), median and max over many calls.
* ``main_us_per_batch``: what the main process does per batch for resume:
  cut the worker's capture off the batch's meta and book it
  (``split_trailer`` + ``ResumeBook.taken``), on real captures.
* ``worker_us_per_batch``: what a worker does per batch: capture its
  generators and pickle the capture, with numpy's generator untouched by the
  batch and drawn from by it (the slow case, see ``fastload.resume.capture.Capturer``).

The main-process figure is compared with the main process's whole CPU time
per batch on ``tiny`` in the report (the benchmark's "main CPU" column).
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Callable, Dict


def _per_call_us(fn: Callable[[], Any], seconds: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def measure_resume_cost(workers: int = 8, prefetch: int = 4, calls: int = 200) -> Dict[str, Any]:
    import numpy as np

    from ..resume import book, capture
    from .. import FastLoader
    from ..transport.format import split_trailer, trailer
    from .workloads import WORKLOADS

    ds, collate = WORKLOADS["tiny"].make("")
    with warnings.catch_warnings():  # more workers than cores: DataLoader's warning, expected
        warnings.simplefilter("ignore", UserWarning)
        loader = FastLoader(ds, batch_size=WORKLOADS["tiny"].batch_size, num_workers=workers,
                            prefetch_factor=prefetch, collate_fn=collate)
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        it = iter(loader)
    for _ in range(calls):
        next(it)
        t0 = time.perf_counter()
        sd = loader.state_dict()
        times.append((time.perf_counter() - t0) * 1e3)
    size = len(__import__("pickle").dumps(sd))
    del it, loader

    cap = capture.Capturer()
    meta = b"\0" * 600 + trailer(cap.capture(0))  # a tiny batch's meta is a few hundred bytes
    resume_book = book.ResumeBook(workers)
    resume_book.new_epoch({})
    count = [0]

    def main_side() -> None:
        _meta, snap = split_trailer(meta)
        resume_book.taken(count[0] % workers, count[0], snap, count[0])
        count[0] += 1

    def numpy_used() -> bytes:
        np.random.random()
        return trailer(cap.capture(0))

    return {
        "workers": workers, "prefetch_factor": prefetch, "calls": calls,
        "state_dict_ms": {"median": statistics.median(times), "max": max(times)},
        "state_bytes": size,
        "main_us_per_batch": _per_call_us(main_side),
        "worker_us_per_batch": {"numpy_idle": _per_call_us(lambda: trailer(cap.capture(0))),
                                "numpy_used": _per_call_us(numpy_used)},
    }


def report_lines(cost: Dict[str, Any], main_cpu_ms: float = 0.0) -> str:
    sd = cost["state_dict_ms"]
    w = cost["worker_us_per_batch"]
    main = cost["main_us_per_batch"]
    share = f" = {main / (main_cpu_ms * 1e3):.1%} of fastload's main CPU per tiny batch" \
        if main_cpu_ms else ""
    return (f"resume (tiny, {cost['workers']} workers, prefetch {cost['prefetch_factor']}): "
            f"state_dict() {sd['median']:.2f} ms median, {sd['max']:.2f} ms max "
            f"({cost['state_bytes'] / 1024:.1f} KiB); main process {main:.1f} us/batch{share}; "
            f"each worker {w['numpy_idle']:.0f} us/batch ({w['numpy_used']:.0f} us when the batch "
            f"drew from numpy's global generator)\n")
