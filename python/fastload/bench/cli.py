"""``python -m fastload.bench``: the command line and the order of the runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, TextIO

from . import measure, report, resume_cost
from .workloads import BIG, WORKLOADS, Workload, cache_root, missing_needs, timed_prepare, user_workload

FULL = {"rounds": 3, "seconds": 3.0, "warmup": 1.0, "raw_seconds": 2.0, "short_batches": 4}
QUICK = {"rounds": 1, "seconds": 0.75, "warmup": 0.25, "raw_seconds": 0.4, "short_batches": 2}
# --quick without --workloads: the two workloads that measure the loader
# itself (each run starts fresh processes that import torch: ~10 s a run on a
# slow 2-core machine, so all five would take over two minutes).
QUICK_WORKLOADS = ("transport_u8", "tiny")


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(
        prog="python -m fastload.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(doc or "").split("\n\n")[0],
        epilog="workloads:\n" + "".join(f"  {w.name:<14}{w.desc}\n" for w in WORKLOADS.values()) +
        "\nyour dataset: python -m fastload.bench --dataset mymodule:make_dataset "
        "[--batch-size N] [--workers N]\n"
        "exit status: 1 when a run failed or a loader delivered wrong batches, else 0 "
        "(targets missed included)")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated, default all ({','.join(WORKLOADS)}); only your "
                        "dataset when --dataset is given")
    p.add_argument("--dataset", metavar="MODULE:CALLABLE", default=None,
                   help="measure your own map-style dataset: the callable returns a Dataset or "
                        "{'dataset': ds, 'batch_size': n, 'collate_fn': fn}")
    p.add_argument("--workers", type=int, default=2, help="num_workers of both loaders (default 2)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size of every workload (default: each workload's own)")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"steady-state seconds per run (default {FULL['seconds']:g}, quick {QUICK['seconds']:g})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"runs of each loader, interleaved (default {FULL['rounds']}, quick {QUICK['rounds']})")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds before the steady state")
    p.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver", "fork"],
                   help="multiprocessing_context of both loaders (default spawn)")
    p.add_argument("--fastload-start-method", default="default",
                   choices=["same", "default", "spawn", "forkserver", "fork"],
                   help="fastload's multiprocessing_context: 'default' (None: what a user gets by "
                        "swapping the import: workers forked from a spawn-started zygote, which "
                        "inherit nothing from the main process, as with spawn) or 'same' as "
                        "--start-method (real spawn for both)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between constructing each loader and iter() in the cold run, as "
                        "a script builds its model in between; the cold 1st batch is then timed "
                        "from iter() (default 0: from construction)")
    p.add_argument("--seed", type=int, default=0, help="seed of the loaders' generator (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"one short round of {' and '.join(QUICK_WORKLOADS)} (unless --workloads): "
                        "about a minute")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG bar chart of the ratios (needs matplotlib)")
    return p


class Progress:
    """One redrawn line on a terminal; one line per finished step otherwise."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = enabled and stream.isatty()
        self.n, self.t0 = 0, time.monotonic()

    def _clock(self, s: float) -> str:
        return f"{int(s) // 60}:{int(s) % 60:02d}"

    def start(self, label: str) -> None:
        if self.tty:
            el = time.monotonic() - self.t0
            left = f", ~{self._clock(el / self.n * (self.total - self.n))} left" if self.n else ""
            fill = int(24 * self.n / max(self.total, 1))
            self.stream.write(f"\r\x1b[K[{'#' * fill}{'.' * (24 - fill)}] {self.n}/{self.total} "
                              f"{self._clock(el)}{left}  {label}")
            self.stream.flush()

    def done(self, label: str) -> None:
        self.n += 1
        if self.enabled:  # on a terminal the bar is drawn again under this line by start()
            print(f"{chr(13) + chr(27) + '[K' if self.tty else ''}"
                  f"[{self.n}/{self.total} {self._clock(time.monotonic() - self.t0)}] {label}",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _summary(r: Dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR " + r["error"].strip().splitlines()[-1]
    sps = r.get("samples_per_s")
    return (f"{sps or 0:,.0f} samples/s, 1st batch {r['ttfb_cold_s']:.2f} s cold / "
            f"{r['ttfb_warm_s']:.3f} s warm, {r.get('peak_mem_mb', 0):,.0f} MB")


def _check(res: Dict[str, Any], n_short: int, seeds: List[int], ref1: List[int], ref2: List[int]) -> List[str]:
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


def _select(a: argparse.Namespace, out: TextIO) -> tuple:
    if a.workloads:
        names = a.workloads.split(",")
    elif a.dataset:
        names = []
    elif a.quick:
        names = list(QUICK_WORKLOADS)
        print(f"--quick: {' and '.join(names)} only (loader overhead); without --quick all "
              f"five workloads are measured, or choose with --workloads", file=out)
    else:
        names = list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    chosen: List[Workload] = []
    skipped: Dict[str, str] = {}
    for n in names:
        miss = missing_needs(WORKLOADS[n])
        if miss:
            skipped[n] = f"needs {', '.join(miss)} (pip install {' '.join(miss)})"
            print(f"{n}: skipped, {skipped[n]}", file=out)
        else:
            chosen.append(WORKLOADS[n])
    if a.dataset:
        chosen.append(user_workload(a.dataset, a.batch_size))
    return chosen, skipped


def _evaluate(w: Workload, runs: Dict[str, List[Dict[str, Any]]], a: argparse.Namespace, cache: str,
              bs: int, seeds: List[int], limits: Dict[str, Any]) -> Dict[str, Any]:
    """One workload's medians, targets and correctness (against references
    computed here, in-process, for as many batches as the longest run read)."""
    n_short = a.short_batches * a.workers * bs
    n_short = n_short if w.length is None else min(n_short, w.length)
    ok_runs = [x for k in report.KINDS for x in runs[k] if "error" not in x]
    need2 = max((len(x["epoch2"]["checksums"]) for x in ok_runs), default=0)
    ref1 = measure.reference(w, cache, seeds[0], a.workers, bs, n_short, -(-n_short // bs))
    ref2 = measure.reference(w, cache, seeds[1], a.workers, bs, BIG, need2)
    med = {k: report.medians(runs[k]) for k in report.KINDS}
    problems: Dict[str, List[str]] = {}
    correct: Dict[str, str] = {}
    for k in report.KINDS:
        probs: List[str] = []
        for x in runs[k]:
            probs += [pr for pr in _check(x, n_short, seeds, ref1, ref2) if pr not in probs]
            for ep in ("epoch1", "epoch2"):  # keep the JSON small: counts, not every checksum
                if ep in x:
                    x[ep]["checksums"] = len(x[ep]["checksums"])
        problems[k] = probs
        correct[k] = "ERR" if not med[k]["runs"] else "NO" if probs else "yes"
    return {"desc": w.desc, "batch_size": bs, "epoch1_samples": n_short,
            "checked_batches": {"epoch1": len(ref1), "epoch2": len(ref2)},
            "runs": runs, "median": med, "problems": problems, "correct": correct,
            "targets": report.targets(w, med["fastload"], med["DataLoader"], limits, a.workers, bs)}


def run_benchmark(argv: Optional[List[str]] = None, out: Optional[TextIO] = None) -> Dict[str, Any]:
    """Run the benchmark as the command line would and return the JSON document.
    ``out`` is where the table goes: by default stdout (stderr with ``--json -``);
    pass an ``io.StringIO()`` to keep it quiet."""
    a = parser().parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.workers < 1:
        raise SystemExit("--workers must be >= 1: with 0 both loaders are the same code")
    if a.rounds < 1 or a.seconds <= 0 or a.warmup < 0:
        raise SystemExit("--rounds must be >= 1, --seconds > 0 and --warmup >= 0")
    if out is None:
        out = sys.stderr if a.json == "-" else sys.stdout
    t_start = time.monotonic()
    chosen, skipped = _select(a, out)
    if not chosen:
        raise SystemExit("nothing to run")
    machine = measure.machine_info()
    cache = cache_root()
    rounds = a.rounds
    side_by_side = not a.quick and a.workers > 1  # the N-process limit (skipped by --quick)
    per_limits = 1 + len(chosen) * (2 if side_by_side else 1)
    total = (len([w for w in chosen if w.prepare]) + (1 if a.quick else 2) * per_limits
             + 2 * rounds * len(chosen) + 2)
    prog = Progress(total, sys.stderr, enabled=a.json != "-")

    def step(label: str, fn: Any) -> Any:
        prog.start(label)
        r, dt = measure.timed(fn)
        prog.done(f"{label}: {dt:.1f} s")
        return r

    for w in chosen:
        if w.prepare:
            step(f"{w.name}: data under {cache}", lambda w=w: timed_prepare(w, cache))
    bs_of = {w.name: a.batch_size or w.batch_size for w in chosen}

    def measure_limits(when: str) -> Dict[str, Any]:
        lim = {"memcpy_bytes_per_s": step(f"memcpy bandwidth ({when})", measure.memcpy_bandwidth),
               "raw_samples_per_s": {}, "side_by_side_samples_per_s": {}}
        for w in chosen:
            try:
                lim["raw_samples_per_s"][w.name] = step(
                    f"{w.name}: one-process rate ({when})",
                    lambda w=w: measure.raw_rate(w, cache, bs_of[w.name], a.raw_seconds, a.seed))
                if side_by_side:
                    lim["side_by_side_samples_per_s"][w.name] = step(
                        f"{w.name}: {a.workers} processes side by side ({when})",
                        lambda w=w: measure.parallel_rate(w, cache, bs_of[w.name], a.raw_seconds,
                                                          a.workers, a.seed))
            except Exception:
                prog.close()
                traceback.print_exc()
                raise SystemExit(f"{w.name}: making a batch without a loader failed (traceback above)")
        return lim

    # Limits are measured before and after the runs and the higher kept (once
    # with --quick): load from elsewhere can only lower them, and a low limit
    # would flatter fastload.
    limits_before = measure_limits("before")
    consumer_us = {w.name: measure.consumer_cost(w, cache, bs_of[w.name]) for w in chosen}
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {w.name: {k: [] for k in report.KINDS} for w in chosen}
    fl_method = {None: a.start_method, "same": a.start_method, "default": None}.get(
        a.fastload_start_method, a.fastload_start_method)
    plan = [(r, w, kind) for r in range(rounds) for w in chosen
            for kind in (report.KINDS if r % 2 == 0 else report.KINDS[::-1])]  # A B, then B A
    specs = [{"workload": w.spec or {"name": w.name}, "kind": kind, "batch_size": bs_of[w.name],
              "workers": a.workers, "seed": a.seed, "short_batches": a.short_batches * a.workers,
              "warmup": a.warmup, "seconds": a.seconds, "gap": a.gap,
              "start_method": fl_method if kind == "fastload" else a.start_method,
              "cache": cache, "sys_path": sys.path} for r, w, kind in plan]
    label = lambda i: f"{plan[i][1].name} {plan[i][2]} round {plan[i][0] + 1}/{rounds}"  # noqa: E731

    def done(i: int, res: Dict[str, Any]) -> None:
        res["round"] = plan[i][0]
        runs[plan[i][1].name][plan[i][2]].append(res)
        prog.done(f"{label(i)}: {_summary(res)}")

    measure.run_children(specs, 180 + 4 * (a.seconds + a.warmup), lambda i: prog.start(label(i)), done)

    limits_after = measure_limits("after") if not a.quick else limits_before
    resume = step("resume: state_dict() and per-batch costs", resume_cost.measure_resume_cost)
    limits = {"memcpy_bytes_per_s": max(limits_before["memcpy_bytes_per_s"], limits_after["memcpy_bytes_per_s"]),
              **{k: {n: max(v, limits_after[k][n]) for n, v in limits_before[k].items()}
                 for k in ("raw_samples_per_s", "side_by_side_samples_per_s")},
              "cores": machine["cpus_usable"], "before": limits_before, "after": limits_after,
              "consumer_us_per_batch": consumer_us}
    prog.start("reference checksums, in-process")
    seeds = measure.base_seeds(a.seed, 2)
    t_ref = time.monotonic()
    workloads = {w.name: _evaluate(w, runs[w.name], a, cache, bs_of[w.name], seeds, limits) for w in chosen}
    prog.done(f"reference checksums: {time.monotonic() - t_ref:.1f} s")
    prog.close()
    machine["loadavg_end"] = list(os.getloadavg())
    res = {"machine": machine, "args": vars(a), "command": "python -m fastload.bench " + " ".join(argv or []),
           "limits": limits, "workloads": workloads, "skipped": skipped, "resume": resume,
           "elapsed_s": time.monotonic() - t_start}
    report.print_report(res, out)
    tiny = workloads.get("tiny", {}).get("median", {}).get("fastload", {})
    out.write(resume_cost.report_lines(resume, tiny.get("main_cpu_ms_per_batch") or 0.0))
    return res


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    res = run_benchmark(argv)
    a = res["args"]
    out = sys.stderr if a["json"] == "-" else sys.stdout
    if a["json"]:
        text = json.dumps(res, indent=1, default=str)
        if a["json"] == "-":
            sys.stdout.write(text + "\n")
        else:
            with open(a["json"], "w") as f:
                f.write(text + "\n")
            print(f"JSON written to {a['json']}", file=out)
    if a["plot"]:
        report.plot(res, a["plot"], out)
    bad = any(c != "yes" for w in res["workloads"].values() for c in w["correct"].values())
    return 1 if bad else 0
