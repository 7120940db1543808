"""``python -m fastload.bench``: fastload against DataLoader, interleaved, on this machine.

Each workload runs with fastload and with ``torch.utils.data.DataLoader`` at
the same ``num_workers``, batch size and start method (spawn), alternating
A B A B for several rounds; the table gives medians. Every run also checks
that each index arrived exactly once, in order, with the right content.

This is the first cut (issue #3 carries the full workload list and the
targets); the figures it prints are measured, never assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from .loader import FastLoader


class TransportU8(Dataset):
    """A preallocated 3x224x224 uint8 image per index: pure loader overhead."""

    def __init__(self, n: int = 4096) -> None:
        self.n = n
        self.img = torch.arange(3 * 224 * 224, dtype=torch.int64).remainder(251).to(torch.uint8)
        self.img = self.img.view(3, 224, 224)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        return self.img, i


class Tiny(Dataset):
    """16 floats and a label per index: per-batch overhead."""

    def __init__(self, n: int = 200_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"x": torch.full((16,), float(i % 997)), "y": i}


WORKLOADS: Dict[str, Tuple[Callable[[], Dataset], int]] = {
    "transport_u8": (TransportU8, 64),
    "tiny": (Tiny, 256),
}


def _labels(batch: Any) -> torch.Tensor:
    return batch[1] if isinstance(batch, (list, tuple)) else batch["y"]


def _run_once(kind: str, ds: Dataset, batch_size: int, workers: int, seconds: float) -> Dict[str, float]:
    cls = FastLoader if kind == "fastload" else DataLoader
    loader = cls(ds, batch_size=batch_size, num_workers=workers, multiprocessing_context="spawn",
                 persistent_workers=False)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter() - t0
    ok = bool(torch.equal(_labels(first), torch.arange(len(_labels(first)))))
    expected = len(_labels(first))
    del first  # the loop below holds one batch at a time, as a training loop does
    n_batches, n_samples = 0, 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    for batch in it:
        y = _labels(batch)
        ok = ok and int(y[0]) == expected and int(y[-1]) == expected + len(y) - 1
        expected += len(y)
        n_batches += 1
        n_samples += len(y)
        if time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    del it, loader
    return {
        "samples_per_s": n_samples / elapsed,
        "batches_per_s": n_batches / elapsed,
        "first_batch_s": t_first,
        "main_cpu_ms_per_batch": 1000 * cpu / max(n_batches, 1),
        "ok": float(ok),
    }


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastload.bench", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="one short round of each: under a minute")
    p.add_argument("--json", default=None, help="write the results to this path")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.seconds = 1, 2.0
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"torch {torch.__version__}")
    print(f"command: python -m fastload.bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    results: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    for name in a.workloads.split(","):
        make, bs = WORKLOADS[name]
        ds = make()
        results[name] = {"fastload": [], "DataLoader": []}
        for r in range(a.rounds):
            for kind in ("fastload", "DataLoader"):
                print(f"  {name} round {r + 1}/{a.rounds} {kind} ...", flush=True)
                results[name][kind].append(_run_once(kind, ds, bs, a.workers, a.seconds))
    print()
    hdr = f"{'workload':<14}{'loader':<12}{'samples/s':>12}{'batches/s':>11}{'ratio':>7}{'1st batch s':>12}{'main ms/b':>10}{'ok':>4}"
    print(hdr)
    print("-" * len(hdr))
    for name, by in results.items():
        med = {k: {m: statistics.median(r[m] for r in runs) for m in runs[0]} for k, runs in by.items()}
        base = med["DataLoader"]["samples_per_s"]
        for kind in ("fastload", "DataLoader"):
            m = med[kind]
            ok = all(r["ok"] for r in by[kind])
            print(f"{name:<14}{kind:<12}{m['samples_per_s']:>12.0f}{m['batches_per_s']:>11.1f}"
                  f"{m['samples_per_s'] / base:>7.2f}{m['first_batch_s']:>12.2f}"
                  f"{m['main_cpu_ms_per_batch']:>10.2f}{'yes' if ok else 'NO':>4}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [n for n, by in results.items() for runs in by.values() for r in runs if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
