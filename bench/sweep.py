"""Sweep ``num_workers`` x batch size: fastload against DataLoader at each point.

Each point is one ``python -m fastload.bench`` run (interleaved rounds,
medians, correctness checked), so a point is as trustworthy as the main
table. Writes ``OUT.json`` (every run's figures) and ``OUT.md`` (one table
per workload: samples/s of both loaders, the ratio, correctness)::

    python bench/sweep.py --workloads transport_u8,tiny,tokens --workers 1,2,4 \\
        --batch-sizes 16,64,256 --seconds 2 --rounds 3 --out bench/results/sweep

About 10 s per point and workload with these settings on 2 cores (most of it
starting processes); ``--seconds 1 --rounds 1`` for a first look.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from typing import Any, Dict, List

from fastload.bench import run_benchmark


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(points: List[Dict[str, Any]], machine: Dict[str, Any]) -> str:
    lines = [f"Machine: {machine.get('cpu_model', machine['machine'])}, {machine['cpus_usable']} cores, "
             f"torch {machine['torch']}, Python {machine['python']}; start method "
             f"{points[0]['start_method'] if points else '?'}; medians of interleaved rounds.", ""]
    for name in dict.fromkeys(p["workload"] for p in points):
        lines += [f"### {name}", "", "| workers | batch | fastload samples/s | DataLoader samples/s | ratio "
                  "| fastload main ms/batch | DataLoader main ms/batch | correct |",
                  "|---:|---:|---:|---:|---:|---:|---:|:--|"]
        for p in (p for p in points if p["workload"] == name):
            fl, dl = p["median"]["fastload"], p["median"]["DataLoader"]
            ratio = fl["samples_per_s"] / dl["samples_per_s"] if fl["samples_per_s"] and dl["samples_per_s"] else None
            lines.append(f"| {p['workers']} | {p['batch_size']} | {_fmt(fl['samples_per_s'], ',.0f')} | "
                         f"{_fmt(dl['samples_per_s'], ',.0f')} | {_fmt(ratio, '.2f')}x | "
                         f"{_fmt(fl['main_cpu_ms_per_batch'], '.3f')} | {_fmt(dl['main_cpu_ms_per_batch'], '.3f')} | "
                         f"{p['correct']['fastload']}/{p['correct']['DataLoader']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="transport_u8,tiny,tokens")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--batch-sizes", default="16,64,256")
    ap.add_argument("--seconds", default="2")
    ap.add_argument("--rounds", default="3")
    ap.add_argument("--start-method", default="spawn")
    ap.add_argument("--out", default="bench/results/sweep", help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    points: List[Dict[str, Any]] = []
    machine: Dict[str, Any] = {}
    bad = False
    for w in a.workers.split(","):
        for b in a.batch_sizes.split(","):
            print(f"workers {w}, batch size {b} ...", file=sys.stderr, flush=True)
            res = run_benchmark(["--workloads", a.workloads, "--workers", w, "--batch-size", b,
                                 "--seconds", a.seconds, "--rounds", a.rounds,
                                 "--start-method", a.start_method, "--under-load", "none"],
                                out=io.StringIO())
            machine = res["machine"]
            for name, wr in res["workloads"].items():
                points.append({"workload": name, "workers": int(w), "batch_size": int(b),
                               "start_method": a.start_method, "median": wr["median"],
                               "correct": wr["correct"], "problems": wr["problems"],
                               "limits": {"raw_samples_per_s": res["limits"]["raw_samples_per_s"][name],
                                          "memcpy_bytes_per_s": res["limits"]["memcpy_bytes_per_s"]}})
                bad |= any(c != "yes" for c in wr["correct"].values())
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": machine, "args": vars(a), "points": points}, f, indent=1)
    md = markdown(points, machine)
    with open(a.out + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    print(f"written: {a.out}.json, {a.out}.md", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
