"""``python -m fastload.bench``: the order of the runs, as the options
(:mod:`.options`) ask for them, and the JSON document they make."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, TextIO

from . import (auto_workers, copy_on_read, first_epoch, first_minutes, h2d, held_data, measure, report,
               resume_cost, stats_cost)
from .evaluate import evaluate
from .fresh import miss_note
from .options import load_runs, select_workloads, settings
from .workloads import cache_root, timed_prepare

# The steady state runs on past --seconds until it holds min_batches batches
# (a window of a dozen batches has a batch's worth of error at each end, ~8%
# of a slow workload's rate under load), up to this many times --seconds.
MAX_STEADY = 5


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



class _Bench:
    """One benchmark: the chosen workloads, the machine states, the progress line."""

    def __init__(self, a: argparse.Namespace, out: TextIO) -> None:
        self.a, self.out = a, out
        self.chosen, self.skipped = select_workloads(a, out)
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
    if "held-data" in a.extras:
        got["held_data"] = b.step(
            f"datasets that hold their data, {a.data_gib:g} GiB, 4 workers",
            lambda: held_data.measure_held_data(data_gib=a.data_gib, rounds=a.rounds))
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
    a = settings(argv)
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
    printed, out = out, io.StringIO()  # the report, kept to say what a MISS in it means
    report.print_report(res, out)
    tiny = rows["quiet"].get("tiny", {}).get("median", {}).get("fastload", {})
    out.write(resume_cost.report_lines(resume, tiny.get("main_cpu_ms_per_batch") or 0.0))
    out.write(stats_cost.report_lines(stats_costs, tiny.get("main_cpu_ms_per_batch") or 0.0))
    if "copy_on_read" in extras:
        out.write(copy_on_read.report_lines(extras["copy_on_read"]))
    if "held_data" in extras:
        out.write(held_data.report_lines(extras["held_data"]))
    if "first_epoch" in extras:
        out.write(first_epoch.report_lines(extras["first_epoch"]))
    if "first_minutes" in extras:
        out.write(first_minutes.report_lines(extras["first_minutes"]))
    if "auto_workers" in extras:
        out.write(auto_workers.report_lines(extras["auto_workers"]))
    if "h2d" in extras:
        out.write(h2d.report_lines(extras["h2d"]))
    text = out.getvalue()
    printed.write(text + miss_note(text))
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
