"""What the loader's own figures (``FastLoader.stats()``) cost per batch.

Everything :mod:`fastload.stats.meter` does per batch, run in a loop with
nothing else: in the main process, the four clock reads around ``next()``
and the batch's reading plus :meth:`EpochMeter.made` and
:meth:`EpochMeter.delivered`; in a worker, two clock reads. The main-process
figure is compared in the report with the main process's whole CPU time per
batch on ``tiny`` (the benchmark's "main CPU" column); the target is 1%.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from .resume_cost import _per_call_us

TARGET_SHARE = 0.01


def measure_stats_cost(workers: int = 8) -> Dict[str, Any]:
    from ..stats.meter import EpochMeter

    meter = EpochMeter()
    meter.begin(workers, "bench")
    meter.started()
    clock = time.perf_counter_ns
    count = [0]
    index = list(range(256))

    def main_side() -> None:
        t0 = clock()  # around next()
        t1 = clock()  # around the batch's reading
        n = count[0]
        count[0] = n + 1
        meter.made(n % workers, 4_000_000 + (n % 977) * 1000, n, index)
        read = clock() - t1
        meter.delivered(clock() - t0, read, 256, 4096)

    def worker_side() -> None:
        t0 = clock()
        clock() - t0

    return {"workers": workers, "main_us_per_batch": _per_call_us(main_side),
            "worker_us_per_batch": _per_call_us(worker_side)}


def report_lines(cost: Dict[str, Any], main_cpu_ms: float = 0.0) -> str:
    main = cost["main_us_per_batch"]
    share = ""
    if main_cpu_ms:
        ratio = main / (main_cpu_ms * 1e3)
        verdict = "ok" if ratio <= TARGET_SHARE else "MISS"
        share = (f" = {ratio:.2%} of fastload's main CPU per tiny batch "
                 f"(<= {TARGET_SHARE:.0%} {verdict})")
    return (f"stats() (the loader's own figures): main process {main:.2f} us/batch{share}; "
            f"each worker {cost['worker_us_per_batch']:.2f} us/batch (two clock reads)\n")
