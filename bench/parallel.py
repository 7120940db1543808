"""What the machine itself allows N workers: the aggregate rate of N plain
processes, no loader at all, each running ``dataset[i]`` + collate on one
torch thread, all started together, against one such process alone.

The ``jpeg`` target assumes N workers can reach N x the one-process rate;
on a VM whose cores slow each other down (shared caches, memory bandwidth, a
noisy host) they cannot, and this script measures by how much,
over several rounds (the README quotes the same figure from the benchmark's
own run, where it is measured beside the loaders)::

    python bench/parallel.py --workloads tiny,jpeg --procs 2 --rounds 3

Each round runs 1 process, then N (``fastload.bench.measure.parallel_rate``:
each measures for ``--seconds`` as the benchmark's one-process limit does, all
starting together once every process has imported torch); medians over the
rounds are printed, with every run. ``python -m fastload.bench`` measures the
same N-process figure in its own run (its "side by side" limit); this script
repeats it alone, over several rounds. ``--into-ring 5`` adds the same N
processes stacking their batches into 5 memfd slots in turn, as fastload's
workers stack into the ring (the default collate otherwise stacks into fresh
memory that malloc hands back warm)::

    python bench/parallel.py --workloads jpeg --rounds 5 --into-ring 5
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
    ap.add_argument("--into-ring", type=int, default=0, metavar="N",
                    help="also measure N processes that stack each batch into N shared-memory "
                         "slots in turn, as fastload's workers do (5: what 2 workers with "
                         "prefetch_factor=2 use)")
    args = ap.parse_args(argv)
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        if w.prepare is not None:
            w.prepare(cache_root())  # generate the data once, before the clock
        ones, many, ring = [], [], []
        for _ in range(args.rounds):
            ones.append(parallel_rate(w, cache_root(), w.batch_size, args.seconds, 1))
            many.append(parallel_rate(w, cache_root(), w.batch_size, args.seconds, args.procs))
            if args.into_ring:
                ring.append(parallel_rate(w, cache_root(), w.batch_size, args.seconds, args.procs,
                                          into_ring=args.into_ring))
        one, agg = statistics.median(ones), statistics.median(many)
        print(f"{name}: 1 process {one:,.0f} samples/s; {args.procs} together {agg:,.0f} samples/s "
              f"= {agg / one:.2f}x one (runs: {[round(x) for x in ones]}, {[round(x) for x in many]})",
              flush=True)
        if ring:
            r = statistics.median(ring)
            print(f"{name}: {args.procs} together, stacking into {args.into_ring} shared slots in "
                  f"turn: {r:,.0f} samples/s = {r / agg:.2f}x fresh memory (runs: "
                  f"{[round(x) for x in ring]})", flush=True)


if __name__ == "__main__":
    main()
