"""``python -m fastload.bench``: the command line and the order of the runs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, TextIO

from . import (auto_workers, copy_on_read, first_epoch, first_minutes, h2d, measure, report,
               resume_cost, stats_cost)
from .evaluate import evaluate
from .workloads import WORKLOADS, Workload, cache_root, missing_needs, timed_prepare, user_workload

FULL = {"rounds": 3, "seconds": 3.0, "warmup": 1.0, "raw_seconds": 2.0, "short_batches": 4,
        "min_batches": 40}
QUICK = {"rounds": 1, "seconds": 0.75, "warmup": 0.25, "raw_seconds": 0.4, "short_batches": 2,
         "min_batches": 10}
# --quick without --workloads: the two workloads that measure the loader
# itself (each run starts fresh processes that import torch: ~10 s a run on a
# slow 2-core machine, so all five would take over two minutes).
QUICK_WORKLOADS = ("transport_u8", "tiny")
# The steady state runs on past --seconds until it holds min_batches batches
# (a window of a dozen batches has a batch's worth of error at each end, ~8%
# of a slow workload's rate under load), up to this many times --seconds.
MAX_STEADY = 5
# The runs under load, beside the quiet ones (see bench/README.md): all
# workloads again with num_workers = 2 x cores, and again with one
# busy-looping process per core running beside each run.
UNDER_LOAD = ("oversubscribed", "neighbour")
# The tables after the main one (--extras); 'h2d' by default only with a GPU.
EXTRAS = ("memory", "first-epoch", "first-minutes", "auto-workers", "h2d")


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
    p.add_argument("--under-load", metavar="RUNS", default=None,
                   help="runs under load beside the quiet ones, comma-separated: 'oversubscribed' "
                        "(num_workers = 2 x cores), 'neighbour' (one busy-looping process per core "
                        "during each run), or 'none' (default: both; none with --quick)")
    p.add_argument("--extras", metavar="TABLES", default=None,
                   help="tables after the main one, comma-separated: 'memory' (copy-on-read: the "
                        "workers' memory on a dataset of 1.5M Python strings, 4 workers, against "
                        "DataLoader fork and spawn), 'first-epoch' (a training-like script's first "
                        "epoch), 'first-minutes' (the first batch of a loader built just before iter(), "
                        "after a model build, with a slow-to-import dataset module, of a second "
                        "loader, and short epochs; 8 workers, against DataLoader fork and spawn), "
                        "'h2d' (host to device: the pinned ring against DataLoader's "
                        "pin_memory; needs a CUDA or ROCm device) or 'none' (default: all, 'h2d' "
                        "where a device is present; none with --quick or --dataset)")
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


def _settings(argv: Optional[List[str]]) -> argparse.Namespace:
    """The parsed options, with --quick's or the full run's defaults filled in."""
    a = parser().parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.under_load is None:
        a.under_load = "none" if a.quick else ",".join(UNDER_LOAD)
    a.under_load = [] if a.under_load == "none" else a.under_load.split(",")
    if a.extras is None:
        a.extras = ("none" if a.quick or a.dataset else
                    ",".join(e for e in EXTRAS if e != "h2d" or h2d.cuda_present()))
    a.extras = [] if a.extras == "none" else a.extras.split(",")
    if [n for n in a.extras if n not in EXTRAS]:
        raise SystemExit(f"--extras: unknown {a.extras}; choose from {', '.join(EXTRAS)} or none")
    unknown = [n for n in a.under_load if n not in UNDER_LOAD]
    if unknown:
        raise SystemExit(f"--under-load: unknown run(s) {', '.join(unknown)}; known: "
                         f"{', '.join(UNDER_LOAD)} or none")
    if a.workers < 1:
        raise SystemExit("--workers must be >= 1: with 0 both loaders are the same code")
    if a.rounds < 1 or a.seconds <= 0 or a.warmup < 0:
        raise SystemExit("--rounds must be >= 1, --seconds > 0 and --warmup >= 0")
    return a


def load_runs(a: argparse.Namespace, cores: int) -> Dict[str, Dict[str, Any]]:
    """The machine states measured: ``quiet`` (the main table) and each run
    under load asked for, with its ``num_workers`` and busy neighbours."""
    out: Dict[str, Dict[str, Any]] = {"quiet": {"workers": a.workers, "neighbours": 0}}
    if "oversubscribed" in a.under_load:
        out["oversubscribed"] = {"workers": 2 * cores, "neighbours": 0,
                                 "what": f"{2 * cores} workers on {cores} cores (2x)"}
    if "neighbour" in a.under_load:
        out["neighbour"] = {"workers": a.workers, "neighbours": cores,
                            "what": f"{a.workers} workers + {cores} busy processes"}
    return out


class _Bench:
    """One benchmark: the chosen workloads, the machine states, the progress line."""

    def __init__(self, a: argparse.Namespace, out: TextIO) -> None:
        self.a, self.out = a, out
        self.chosen, self.skipped = _select(a, out)
        if not self.chosen:
            raise SystemExit("nothing to run")
        self.machine = measure.machine_info()
        self.cache = cache_root()
        self.states = load_runs(a, self.machine["cpus_usable"])
        self.bs_of = {w.name: a.batch_size or w.batch_size for w in self.chosen}
        self.side_by_side = not a.quick and a.workers > 1  # the N-process limit (skipped by --quick)
        per_limits = 1 + len(self.chosen) * (2 if self.side_by_side else 1)
        total = (len([w for w in self.chosen if w.prepare]) + (1 if a.quick else 2) * per_limits
                 + 2 * a.rounds * len(self.chosen) * len(self.states) + 3 + len(a.extras))
        self.prog = Progress(total, sys.stderr, enabled=a.json != "-")

    def step(self, label: str, fn: Any) -> Any:
        """Run ``fn`` as one step of the progress line."""
        self.prog.start(label)
        r, dt = measure.timed(fn)
        self.prog.done(f"{label}: {dt:.1f} s")
        return r

    def measure_limits(self, when: str) -> Dict[str, Any]:
        """memcpy bandwidth, one-process and side-by-side rates of each workload."""
        a = self.a
        lim = {"memcpy_bytes_per_s": self.step(f"memcpy bandwidth ({when})", measure.memcpy_bandwidth),
               "raw_samples_per_s": {}, "side_by_side_samples_per_s": {}}
        for w in self.chosen:
            bs = self.bs_of[w.name]
            try:
                lim["raw_samples_per_s"][w.name] = self.step(
                    f"{w.name}: one-process rate ({when})",
                    lambda w=w, bs=bs: measure.raw_rate(w, self.cache, bs, a.raw_seconds, a.seed))
                if self.side_by_side:
                    lim["side_by_side_samples_per_s"][w.name] = self.step(
                        f"{w.name}: {a.workers} processes side by side ({when})",
                        lambda w=w, bs=bs: measure.parallel_rate(w, self.cache, bs, a.raw_seconds,
                                                                 a.workers, a.seed))
            except Exception:
                self.prog.close()
                traceback.print_exc()
                raise SystemExit(f"{w.name}: making a batch without a loader failed (traceback above)")
        return lim

    def run_all(self) -> Dict[str, Dict[str, Dict[str, List[Dict[str, Any]]]]]:
        """Every run, interleaved: per round, each machine state and workload,
        fastload then DataLoader (DataLoader first in odd rounds)."""
        a = self.a
        runs = {st: {w.name: {k: [] for k in report.KINDS} for w in self.chosen} for st in self.states}
        fl_method = {None: a.start_method, "same": a.start_method, "default": None}.get(
            a.fastload_start_method, a.fastload_start_method)
        plan = [(r, st, w, kind) for r in range(a.rounds) for st in self.states for w in self.chosen
                for kind in (report.KINDS if r % 2 == 0 else report.KINDS[::-1])]  # A B, then B A
        specs = []
        for r, st, w, kind in plan:
            workers = self.states[st]["workers"]
            specs.append({"workload": w.spec or {"name": w.name}, "kind": kind,
                          "batch_size": self.bs_of[w.name], "workers": workers, "seed": a.seed,
                          "short_batches": a.short_batches * workers, "warmup": a.warmup,
                          "seconds": a.seconds, "min_batches": a.min_batches,
                          "max_seconds": MAX_STEADY * a.seconds, "gap": a.gap,
                          "neighbours": self.states[st]["neighbours"],
                          "start_method": fl_method if kind == "fastload" else a.start_method,
                          "cache": self.cache, "sys_path": sys.path})

        def label(i: int) -> str:
            r, st, w, kind = plan[i]
            return f"{w.name} {kind} round {r + 1}/{a.rounds}" + ("" if st == "quiet" else f" [{st}]")

        def done(i: int, res: Dict[str, Any]) -> None:
            res["round"] = plan[i][0]
            runs[plan[i][1]][plan[i][2].name][plan[i][3]].append(res)
            self.prog.done(f"{label(i)}: {_summary(res)}")

        measure.run_children(specs, 180 + 4 * (MAX_STEADY * a.seconds + a.warmup),
                             lambda i: self.prog.start(label(i)), done)
        return runs

    def evaluate(self, runs: Dict[str, Dict[str, Dict[str, List[Dict[str, Any]]]]],
                 limits: Dict[str, Any]) -> Dict[str, Any]:
        """The quiet table's rows, and each run under load's."""
        a = self.a
        seeds = measure.base_seeds(a.seed, 2)
        out: Dict[str, Any] = {}
        for st, cfg in self.states.items():
            rows = {}
            for w in self.chosen:
                quiet = out.get("quiet", {}).get(w.name, {}).get("targets", [{}])[0].get("value")
                rows[w.name] = evaluate(w, runs[st][w.name], workers=cfg["workers"],
                                        short_batches=a.short_batches, cache=self.cache,
                                        bs=self.bs_of[w.name], seeds=seeds, limits=limits,
                                        quiet_ratio=quiet, loaded=st != "quiet")
            out[st] = rows
        return out


def _extras(a: argparse.Namespace, b: "_Bench") -> Dict[str, Any]:
    """The tables after the main one (``--extras``), each in interleaved rounds of its own."""
    got: Dict[str, Any] = {}
    if "memory" in a.extras:
        got["copy_on_read"] = b.step("copy-on-read memory, 4 workers",
                                     lambda: copy_on_read.measure_copy_on_read(rounds=a.rounds))
    if "first-epoch" in a.extras:
        got["first_epoch"] = b.step(
            "first epoch after a model build",
            lambda: first_epoch.measure_first_epoch(rounds=a.rounds, workers=a.workers))
    if "first-minutes" in a.extras:
        got["first_minutes"] = b.step(
            "first minutes: first batches and short epochs, 8 workers",
            lambda: first_minutes.measure_first_minutes(rounds=a.rounds, workers=8))
    if "auto-workers" in a.extras:
        got["auto_workers"] = b.step(
            "num_workers='auto' against fixed counts, io and cpu datasets",
            lambda: auto_workers.measure_auto_workers(rounds=a.rounds))
    if "h2d" in a.extras:
        if h2d.cuda_present():
            got["h2d"] = b.step("host to device, pinned", lambda: h2d.measure_h2d(
                rounds=a.rounds, workers=min(8, os.cpu_count() or 1)))
        else:
            b.skipped["h2d"] = "needs a CUDA or ROCm device"
    return got


def _combine(before: Dict[str, Any], after: Dict[str, Any], cores: int,
             consumer_us: Dict[str, float]) -> Dict[str, Any]:
    """Limits measured before and after the runs: the higher kept (load from
    elsewhere can only lower them, and a low limit would flatter fastload)."""
    return {"memcpy_bytes_per_s": max(before["memcpy_bytes_per_s"], after["memcpy_bytes_per_s"]),
            **{k: {n: max(v, after[k][n]) for n, v in before[k].items()}
               for k in ("raw_samples_per_s", "side_by_side_samples_per_s")},
            "cores": cores, "before": before, "after": after, "consumer_us_per_batch": consumer_us}


def run_benchmark(argv: Optional[List[str]] = None, out: Optional[TextIO] = None) -> Dict[str, Any]:
    """Run the benchmark as the command line would and return the JSON document.
    ``out`` is where the table goes: by default stdout (stderr with ``--json -``);
    pass an ``io.StringIO()`` to keep it quiet."""
    a = _settings(argv)
    if out is None:
        out = sys.stderr if a.json == "-" else sys.stdout
    t_start = time.monotonic()
    b = _Bench(a, out)
    for w in b.chosen:
        if w.prepare:
            b.step(f"{w.name}: data under {b.cache}", lambda w=w: timed_prepare(w, b.cache))
    before = b.measure_limits("before")
    consumer_us = {w.name: measure.consumer_cost(w, b.cache, b.bs_of[w.name]) for w in b.chosen}
    runs = b.run_all()
    after = b.measure_limits("after") if not a.quick else before
    resume = b.step("resume: state_dict() and per-batch costs", resume_cost.measure_resume_cost)
    stats_costs = b.step("stats(): per-batch costs", stats_cost.measure_stats_cost)
    extras = _extras(a, b)
    limits = _combine(before, after, b.machine["cpus_usable"], consumer_us)
    b.prog.start("reference checksums, in-process")
    t_ref = time.monotonic()
    rows = b.evaluate(runs, limits)
    b.prog.done(f"reference checksums: {time.monotonic() - t_ref:.1f} s")
    b.prog.close()
    b.machine["loadavg_end"] = list(os.getloadavg())
    under_load = {st: {**b.states[st], "workloads": rows[st]}
                  for st in b.states if st != "quiet"}
    res = {"machine": b.machine, "args": vars(a), "command": "python -m fastload.bench " + " ".join(argv or []),
           "limits": limits, "workloads": rows["quiet"], "under_load": under_load,
           "skipped": b.skipped, "resume": resume, "stats_cost": stats_costs, **extras,
           "elapsed_s": time.monotonic() - t_start}
    report.print_report(res, out)
    tiny = rows["quiet"].get("tiny", {}).get("median", {}).get("fastload", {})
    out.write(resume_cost.report_lines(resume, tiny.get("main_cpu_ms_per_batch") or 0.0))
    out.write(stats_cost.report_lines(stats_costs, tiny.get("main_cpu_ms_per_batch") or 0.0))
    if "copy_on_read" in extras:
        out.write(copy_on_read.report_lines(extras["copy_on_read"]))
    if "first_epoch" in extras:
        out.write(first_epoch.report_lines(extras["first_epoch"]))
    if "first_minutes" in extras:
        out.write(first_minutes.report_lines(extras["first_minutes"]))
    if "auto_workers" in extras:
        out.write(auto_workers.report_lines(extras["auto_workers"]))
    if "h2d" in extras:
        out.write(h2d.report_lines(extras["h2d"]))
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
    rows = list(res["workloads"].values()) + [wr for st in res["under_load"].values()
                                              for wr in st["workloads"].values()]
    bad = any(c != "yes" for w in rows for c in w["correct"].values())
    bad = bad or not all(res.get("h2d", {}).get("correct", {}).values())
    return 1 if bad else 0
