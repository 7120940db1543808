"""From a workload's runs to its row of the report: medians, targets, and
whether every batch was right (against references computed in-process)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import measure, report
from .workloads import BIG, Workload


def check_run(res: Dict[str, Any], n_short: int, seeds: List[int], ref1: List[int],
              ref2: List[int]) -> List[str]:
    """What is wrong with one run's deliveries, if anything."""
    if "error" in res:
        return ["run failed: " + res["error"].strip().splitlines()[-1]]
    probs = []
    for k, (seed, ep) in enumerate(zip(seeds, ("epoch1", "epoch2")), 1):
        e = res[ep]
        if res[f"base_seed_{k}"] != seed:
            probs.append(f"epoch {k}: base_seed {res[f'base_seed_{k}']} is not DataLoader's draw {seed}")
        if e["order_error"]:
            probs.append(f"epoch {k}: {e['order_error']}")
        ref = ref1 if k == 1 else ref2
        bad = next((b for b, (x, y) in enumerate(zip(e["checksums"], ref)) if x != y), None)
        if bad is not None:
            probs.append(f"epoch {k}: batch {bad} content differs from the in-process reference")
        if len(e["checksums"]) > len(ref):
            probs.append(f"epoch {k}: {len(e['checksums'])} batches, {len(ref)} expected")
    if res["epoch1"]["samples"] != n_short:
        probs.append(f"epoch 1: {res['epoch1']['samples']} of {n_short} samples delivered")
    return probs


def evaluate(w: Workload, runs: Dict[str, List[Dict[str, Any]]], *, workers: int, short_batches: int,
             cache: str, bs: int, seeds: List[int], limits: Dict[str, Any],
             quiet_ratio: Optional[float] = None, loaded: bool = False) -> Dict[str, Any]:
    """One workload's medians, targets and correctness (against references
    computed here, in-process, for as many batches as the longest run read).
    ``loaded``: a run under load (oversubscribed or beside busy neighbours),
    whose only target is :func:`report.load_target` (``quiet_ratio``: the
    quiet machine's samples/s ratio of the same workload)."""
    n_short = short_batches * workers * bs
    n_short = n_short if w.length is None else min(n_short, w.length)
    ok_runs = [x for k in report.KINDS for x in runs[k] if "error" not in x]
    need2 = max((len(x["epoch2"]["checksums"]) for x in ok_runs), default=0)
    ref1 = measure.reference(w, cache, seeds[0], workers, bs, n_short, -(-n_short // bs))
    ref2 = measure.reference(w, cache, seeds[1], workers, bs, BIG, need2)
    med = {k: report.medians(runs[k]) for k in report.KINDS}
    problems: Dict[str, List[str]] = {}
    correct: Dict[str, str] = {}
    for k in report.KINDS:
        probs: List[str] = []
        for x in runs[k]:
            probs += [pr for pr in check_run(x, n_short, seeds, ref1, ref2) if pr not in probs]
            for ep in ("epoch1", "epoch2"):  # keep the JSON small: counts, not every checksum
                if ep in x:
                    x[ep]["checksums"] = len(x[ep]["checksums"])
        problems[k] = probs
        correct[k] = "ERR" if not med[k]["runs"] else "NO" if probs else "yes"
    if loaded:
        targets = [report.load_target(w, med["fastload"], med["DataLoader"], quiet_ratio)]
    else:
        targets = report.targets(w, med["fastload"], med["DataLoader"], limits, workers, bs)
    return {"desc": w.desc, "batch_size": bs, "workers": workers, "epoch1_samples": n_short,
            "checked_batches": {"epoch1": len(ref1), "epoch2": len(ref2)},
            "runs": runs, "median": med, "problems": problems, "correct": correct,
            "targets": targets}
