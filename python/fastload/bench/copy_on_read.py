"""Copy-on-read memory: what a dataset of many Python objects costs the workers.

A dataset holding a big Python list (file paths and labels, as most image
datasets do) is cheap for DataLoader's forked workers: they share the
training process's pages, and only the pages whose reference counts a
worker touches get copied. A spawned worker unpickles a copy of its own,
and imports torch anew. fastload's zygote unpickles each session's dataset
once and forks the workers from it, so they share that copy as forked
workers share the training process's.

Each run is a fresh interpreter that builds ``ManyPaths(n)``, makes one
epoch with ``workers`` workers (and, for fastload, a second epoch of the
warm pool's fresh workers), and reads the workers' memory once the last
batch is in, from ``/proc/<pid>/smaps_rollup``:

* ``pss_mb``: the workers' proportional set size, summed: each shared page
  counts once in all;
* ``uss_mb``: the median worker's unique set size (its private pages).

Runs alternate between the loaders (fork, spawn, fastload; then reversed);
medians are reported, and fastload's as ratios to DataLoader(fork)'s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List, Sequence

import torch
from torch.utils.data import Dataset

MODES = ("fork", "spawn", "fastload")
MB = 1 << 20


class ManyPaths(Dataset):
    """``n`` short path strings and their labels in plain Python lists;
    sample ``i`` reads both (touching their reference counts)."""

    def __init__(self, n: int) -> None:
        self.paths = [f"/data/train/{i % 1000:03d}/img_{i:08d}.jpg" for i in range(n)]
        self.labels = [i % 1000 for i in range(n)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        return len(self.paths[i]) + self.labels[i]


def int_collate(batch: List[int]) -> torch.Tensor:
    """A batch of Python ints as one tensor (the samples are what is measured, not the batch)."""
    return torch.tensor(batch)


def _rollup(pid: int) -> Dict[str, int]:
    """``Pss`` and ``Private_*`` of ``/proc/<pid>/smaps_rollup``, in bytes."""
    out: Dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Private_Clean", "Private_Dirty"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _worker_memory(pids: Sequence[int]) -> Dict[str, float]:
    rolls = [_rollup(p) for p in pids]
    return {"pss_mb": sum(r["Pss"] for r in rolls) / MB,
            "uss_mb": statistics.median(r["Private_Clean"] + r["Private_Dirty"] for r in rolls) / MB,
            "workers": len(rolls)}


def _children() -> List[int]:
    """This process's child pids, less multiprocessing's resource tracker."""
    pids: List[int] = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    keep = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except FileNotFoundError:
            continue
        keep.append(pid)
    return keep


def _epoch(loader: Any, pids_of: Any) -> Dict[str, float]:
    """One epoch; the workers' memory once the next-to-last batch is in
    (every worker has made all its batches but that last one, and all still
    run: fastload's end with the last batch, DataLoader's at StopIteration)."""
    it = iter(loader)
    last = len(loader) - 1
    got: Dict[str, float] = {}
    pids: Sequence[int] = ()
    for k, _batch in enumerate(it):
        if k == 0:
            pids = pids_of(it)
        if k == last - 1:
            got = _worker_memory(pids)
    del it
    return got


def child(mode: str, n: int, workers: int) -> None:
    """One run (in a fresh interpreter): prints a JSON line of the figures."""
    from torch.utils.data import DataLoader

    ds = ManyPaths(n)
    kw: Dict[str, Any] = dict(batch_size=max(1, n // (8 * workers)), num_workers=workers,
                              collate_fn=int_collate)
    if mode == "fastload":
        from fastload import FastLoader
        from fastload.debug import debug_view
        loader: Any = FastLoader(ds, **kw)
        pids_of: Any = lambda it: debug_view(it).worker_pids  # noqa: E731
        out = {"epoch1": _epoch(loader, pids_of), "epoch2": _epoch(loader, pids_of)}
    else:
        loader = DataLoader(ds, multiprocessing_context=mode, **kw)
        out = {"epoch1": _epoch(loader, lambda _it: _children())}
    print(json.dumps(out), flush=True)


def measure_copy_on_read(n: int = 1_500_000, workers: int = 4, rounds: int = 3) -> Dict[str, Any]:
    """Interleaved runs of every loader; their medians and fastload's ratios to fork's."""
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    code = "import sys; from fastload.bench.copy_on_read import child; child(sys.argv[1], {n}, {w})"
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            # No fork server at import: beside DataLoader it would count as a
            # child (a worker) of the run; fastload's starts with its loader.
            proc = subprocess.run([sys.executable, "-c", code.format(n=n, w=workers), mode],
                                  check=True, capture_output=True, text=True,
                                  env=dict(os.environ, FASTLOAD_SERVER_AT_IMPORT="0"))
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    median: Dict[str, Dict[str, float]] = {}
    for mode in MODES:
        for epoch in ("epoch1", "epoch2"):
            got = [x[epoch] for x in runs[mode] if epoch in x]
            if got:
                median[f"{mode}_{epoch}" if mode == "fastload" else mode] = {
                    k: statistics.median(g[k] for g in got) for k in ("pss_mb", "uss_mb")}
    fork = median["fork"]
    ratios = {k: {"pss_vs_fork": v["pss_mb"] / fork["pss_mb"], "uss_vs_fork": v["uss_mb"] / fork["uss_mb"]}
              for k, v in median.items()}
    return {"n": n, "workers": workers, "rounds": rounds, "runs": runs, "median": median,
            "ratios": ratios}


def report_lines(res: Dict[str, Any]) -> str:
    """The memory table printed after the benchmark's main one."""
    lines = [f"\nCopy-on-read memory: a dataset of {res['n']:,} path strings + labels, "
             f"{res['workers']} workers, medians of {res['rounds']} rounds",
             f"{'loader':<20}{'workers PSS MB':>16}{'median USS MB':>16}{'PSS vs fork':>13}"
             f"{'USS vs fork':>13}"]
    for name, m in res["median"].items():
        r = res["ratios"][name]
        verdict = ""
        if name.startswith("fastload"):
            if r["uss_vs_fork"] > 1.5 or r["pss_vs_fork"] > 1.05:
                verdict = "  missed"
            else:  # PSS moves by a few % between rounds: within 5% is parity, not a miss
                verdict = "  met" if r["pss_vs_fork"] <= 1.0 else "  at parity (<= 1.05x)"
        lines.append(f"{name:<20}{m['pss_mb']:>16.0f}{m['uss_mb']:>16.0f}{r['pss_vs_fork']:>12.2f}x"
                     f"{r['uss_vs_fork']:>12.2f}x{verdict}")
    lines.append("target: fastload's workers' total PSS <= fork's, their median USS <= 1.5x fork's")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(report_lines(measure_copy_on_read(rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 3)))
