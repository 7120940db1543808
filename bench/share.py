"""Where a loader's time goes beside busy neighbours: per delivered batch, the
CPU its main process and workers ran, the time they waited on a run queue for
a core, their context switches, and the cores they kept busy, for fastload
and DataLoader in turn, from the kernel's per-thread accounting
(``/proc/<pid>/task/<tid>/schedstat``: time on a CPU, time runnable but
waiting; ``/proc/<pid>/status``: voluntary and involuntary switches)::

    python bench/share.py --workload tiny --neighbours 2 --rounds 3
    python bench/share.py --workload tiny --neighbours 0 --rounds 1   # quiet

Each round measures fastload, then DataLoader (``multiprocessing_context=
"spawn"``), each for ``--seconds`` after a warm-up, in this one process,
beside ``--neighbours`` busy-looping processes (each in a session of its own,
as in ``python -m fastload.bench``'s neighbour run). The figures are the
kernel's, summed over all threads of each process; the neighbours are not
counted.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional, Tuple

from torch.utils.data import DataLoader

from fastload import FastLoader
from fastload.bench.runner import Neighbours
from fastload.bench.workloads import WORKLOADS, cache_root


def _schedstat(pid: int) -> Tuple[int, int]:
    """(ns on a CPU, ns runnable and waiting) over all threads of ``pid``."""
    run = wait = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    a = f.read().split()
            except OSError:
                continue
            run, wait = run + int(a[0]), wait + int(a[1])
    except OSError:
        pass
    return run, wait


def _switches(pid: int) -> Tuple[int, int]:
    """(voluntary, involuntary) context switches of ``pid``'s main thread."""
    vol = inv = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv = int(line.split()[1])
    except OSError:
        pass
    return vol, inv


def _descendants(root: int, exclude: set) -> List[int]:
    parent: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in exclude]
        out += kids
        todo += kids
    return out


def measure(kind: str, workload: str, workers: int, seconds: float, neighbours: set) -> Dict[str, float]:
    """One loader's figures per batch (microseconds and switches) and cores used."""
    w = WORKLOADS[workload]
    ds, collate = w.make(cache_root())
    extra = {} if kind == "fastload" else {"multiprocessing_context": "spawn"}
    cls = FastLoader if kind == "fastload" else DataLoader
    loader = cls(ds, batch_size=w.batch_size, num_workers=workers, collate_fn=collate, **extra)
    it = iter(loader)
    t_w = time.perf_counter()
    while time.perf_counter() - t_w < 1.0:
        next(it)
    me, kids = os.getpid(), _descendants(os.getpid(), neighbours)
    procs = [me, *kids]
    before = {p: (_schedstat(p), _switches(p)) for p in procs}
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or n < 20:
        next(it)
        n += 1
    wall = time.perf_counter() - t0
    after = {p: (_schedstat(p), _switches(p)) for p in procs}
    del it, loader

    def per_batch(group: List[int], part: int, i: int, scale: float) -> float:
        return sum(after[p][part][i] - before[p][part][i] for p in group) / n / scale

    out = {"batches_per_s": n / wall, "wall_us": wall / n * 1e6}
    for name, group in (("main", [me]), ("workers", kids)):
        out[f"{name}_run_us"] = per_batch(group, 0, 0, 1e3)
        out[f"{name}_wait_us"] = per_batch(group, 0, 1, 1e3)
        out[f"{name}_vol"] = per_batch(group, 1, 0, 1)
        out[f"{name}_invol"] = per_batch(group, 1, 1, 1)
    out["cores"] = (out["main_run_us"] + out["workers_run_us"]) / out["wall_us"]
    return out


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args(argv)
    w = WORKLOADS[a.workload]
    if w.prepare is not None:
        w.prepare(cache_root())  # generate the data once, before any clock
    print(f"{a.workload}, {a.workers} workers, {a.neighbours} busy neighbours; per batch, "
          "us on a CPU / us waiting for one, switches voluntary/involuntary")
    with Neighbours(a.neighbours) as nb:
        for r in range(a.rounds):
            for kind in ("fastload", "DataLoader"):
                m = measure(kind, a.workload, a.workers, a.seconds, set(nb.pids))
                print(f"round {r + 1} {kind:<10} {m['batches_per_s']:9.1f} batches/s  "
                      f"wall {m['wall_us']:8.0f}  main {m['main_run_us']:7.0f}/{m['main_wait_us']:<7.0f} "
                      f"{m['main_vol']:.2f}/{m['main_invol']:.2f}  workers {m['workers_run_us']:7.0f}/"
                      f"{m['workers_wait_us']:<7.0f} {m['workers_vol']:.2f}/{m['workers_invol']:.2f}  "
                      f"cores {m['cores']:.2f}", flush=True)


if __name__ == "__main__":
    main()
