"""What the machine itself allows N workers: the aggregate rate of N plain
processes, no loader at all, each running ``dataset[i]`` + collate on one
torch thread, all started together, against one such process alone.

The ``jpeg`` target of issue 3 assumes N workers can reach N x the one-process
rate; on a VM whose cores slow each other down (shared caches, memory
bandwidth, a noisy host) they cannot, and this script measures by how much,
over several rounds (the README quotes the same figure from the benchmark's
own run, where it is measured beside the loaders)::

    python bench/parallel.py --workloads tiny,jpeg --procs 2 --rounds 3

Each round runs 1 process, then N (``fastload.bench.measure.parallel_rate``:
each measures for ``--seconds`` as the benchmark's one-process limit does, all
starting together once every process has imported torch); medians over the
rounds are printed, with every run. ``python -m fastload.bench`` measures the
same N-process figure in its own run (its "side by side" limit); this script
repeats it alone, over several rounds.
"""

from __future__ import annotations

import argparse
import statistics
from typing import List, Optional

from fastload.bench.measure import parallel_rate
from fastload.bench.workloads import WORKLOADS, cache_root


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="tiny,jpeg")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        if w.prepare is not None:
            w.prepare(cache_root())  # generate the data once, before the clock
        ones, many = [], []
        for _ in range(args.rounds):
            ones.append(parallel_rate(w, cache_root(), w.batch_size, args.seconds, 1))
            many.append(parallel_rate(w, cache_root(), w.batch_size, args.seconds, args.procs))
        one, agg = statistics.median(ones), statistics.median(many)
        print(f"{name}: 1 process {one:,.0f} samples/s; {args.procs} together {agg:,.0f} samples/s "
              f"= {agg / one:.2f}x one (runs: {[round(x) for x in ones]}, {[round(x) for x in many]})",
              flush=True)


if __name__ == "__main__":
    main()
