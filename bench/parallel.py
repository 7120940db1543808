"""What the machine itself allows N workers: the aggregate rate of N plain
processes, no loader at all, each running ``dataset[i]`` + collate on one
torch thread, all started together, against one such process alone.

The ``jpeg`` target of issue 3 assumes N workers can reach N x the one-process
rate; on a VM whose cores slow each other down (shared caches, memory
bandwidth, a noisy host) they cannot, and this script measures by how much.
It is the bound quoted in the README for ``tiny`` and ``jpeg``::

    python bench/parallel.py --workloads tiny,jpeg --procs 2 --rounds 3

Each round runs 1 process, then N, each for ``--seconds`` after all have
imported and warmed up; medians over the rounds are printed, with every run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any, List, Optional


def _work(name: str, seconds: float, results: Any, start: Any) -> None:
    import torch
    from torch.utils.data import default_collate

    from fastload.bench.workloads import WORKLOADS, cache_root

    torch.set_num_threads(1)
    w = WORKLOADS[name]
    if w.prepare is not None:
        w.prepare(cache_root())
    ds, collate = w.make(cache_root())
    collate = collate or default_collate
    bs = w.batch_size
    collate([ds[i] for i in range(bs)])  # first touch: lazy opens, caches
    start.wait()  # all processes warm, then all go
    k, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        collate([ds[i] for i in range(k * bs, (k + 1) * bs)])
        k += 1
    results.put(k * bs / (time.perf_counter() - t))


def aggregate_rate(name: str, procs: int, seconds: float) -> float:
    """Samples/s summed over ``procs`` processes running at the same time."""
    ctx = mp.get_context("spawn")
    results, start = ctx.Queue(), ctx.Barrier(procs + 1)
    ps = [ctx.Process(target=_work, args=(name, seconds, results, start)) for _ in range(procs)]
    for p in ps:
        p.start()
    start.wait(timeout=120)
    rates = [results.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{name}: a measuring process exited with {p.exitcode}")
    return sum(rates)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="tiny,jpeg")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    for name in args.workloads.split(","):
        ones, many = [], []
        for _ in range(args.rounds):
            ones.append(aggregate_rate(name, 1, args.seconds))
            many.append(aggregate_rate(name, args.procs, args.seconds))
        one, agg = statistics.median(ones), statistics.median(many)
        print(f"{name}: 1 process {one:,.0f} samples/s; {args.procs} together {agg:,.0f} samples/s "
              f"= {agg / one:.2f}x one (runs: {[round(x) for x in ones]}, {[round(x) for x in many]})",
              flush=True)


if __name__ == "__main__":
    main()
