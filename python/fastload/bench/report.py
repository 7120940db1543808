"""Medians, the performance targets, the table, the JSON and the plot."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional, TextIO

from .workloads import Workload

KINDS = ("fastload", "DataLoader")
METRICS = ("samples_per_s", "batches_per_s", "ttfb_cold_s", "ttfb_warm_s",
           "main_cpu_ms_per_batch", "workers_cpu_ms_per_batch", "peak_mem_mb")


def medians(runs: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    ok = [r for r in runs if "error" not in r]
    out: Dict[str, Optional[float]] = {}
    for m in METRICS:
        vals = [r[m] for r in ok if r.get(m) is not None]
        out[m] = statistics.median(vals) if vals else None
    out["runs"] = len(ok)
    return out


def _t(what: str, value: Optional[float], need: Optional[float], ok: Optional[bool], text: str) -> Dict[str, Any]:
    return {"what": what, "value": value, "need": need, "ok": ok, "text": text}


def _mark(ok: Optional[bool]) -> str:
    return "-" if ok is None else "ok" if ok else "MISS"


def targets(w: Workload, fl: Dict[str, Any], dl: Dict[str, Any], limits: Dict[str, Any],
            workers: int, batch_size: int) -> List[Dict[str, Any]]:
    """The performance targets for one workload, from the medians of this run."""
    out: List[Dict[str, Any]] = []

    def ratio(m: str) -> Optional[float]:
        a, b = fl.get(m), dl.get(m)
        return a / b if a is not None and b else None

    r = ratio("samples_per_s")
    fs, ds = fl.get("samples_per_s"), dl.get("samples_per_s")
    if w.rule in ("tiny", "tokens"):
        out.append(_t("samples/s", r, 3.0, None if r is None else r >= 3.0, ">=3x"))
    elif w.rule == "transport":
        bound = limits["memcpy_bytes_per_s"] / w.sample_bytes  # one memcpy per sample
        if ds is not None and 3 * ds > bound:
            need = 0.8 * bound
            out.append(_t("samples/s", r, need / ds, None if fs is None else fs >= need,
                          f">=80% memcpy={need:,.0f}/s"))
        else:
            out.append(_t("samples/s", r, 3.0, None if r is None else r >= 3.0, ">=3x"))
    elif w.rule == "jpeg":
        raw = limits["raw_samples_per_s"].get(w.name)
        cap = min(workers, limits["cores"])
        need = 0.95 * cap * raw if raw else None
        ok = None if fs is None or need is None or ds is None else (fs >= need and fs >= ds)
        out.append(_t("samples/s", r, need / ds if need and ds else None, ok,
                      f">=95% of {cap}x1proc={need or 0:,.0f}/s & >=1x"))
    else:
        out.append(_t("samples/s", r, None, None, "(none)"))
    rc = ratio("ttfb_cold_s")
    out.append(_t("cold 1st batch", rc, 0.5, None if rc is None else rc <= 0.5, "<=0.5x"))
    ww = fl.get("ttfb_warm_s")
    out.append(_t("warm 1st batch", ww, 0.2, None if ww is None else ww <= 0.2, "<=0.2 s"))
    raw = limits["raw_samples_per_s"].get(w.name)
    out[-1]["floor_s"] = batch_size / raw if raw else None  # one batch made by one process
    rm = ratio("peak_mem_mb")
    out.append(_t("peak memory", rm, 1.0, None if rm is None else rm <= 1.0, "<=1x"))
    if w.rule == "tiny":
        rcpu = ratio("main_cpu_ms_per_batch")
        out.append(_t("main CPU/batch", rcpu, 0.3, None if rcpu is None else rcpu <= 0.3, "<=0.3x"))
    return out


def load_target(w: Workload, fl: Dict[str, Any], dl: Dict[str, Any],
                quiet_ratio: Optional[float]) -> Dict[str, Any]:
    """The samples/s target of a run under load: at least DataLoader's rate
    and, for ``tiny`` (the loader's own per-batch cost), at least 0.8 x the
    ratio fastload reached on the quiet machine in the same benchmark."""
    a, b = fl.get("samples_per_s"), dl.get("samples_per_s")
    r = a / b if a is not None and b else None
    need, text = 1.0, ">=1x"
    if w.rule == "tiny" and quiet_ratio:
        need = max(1.0, 0.8 * quiet_ratio)
        text = f">=1x & >=0.8x quiet={0.8 * quiet_ratio:.2f}x"
    return _t("samples/s", r, need, None if r is None else r >= need, text)


def _num(v: Optional[float], fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def _header(res: Dict[str, Any], p: Any) -> None:
    """The run's settings and the limits measured in it."""
    m, lim, a = res["machine"], res["limits"], res["args"]
    p()
    p(f"fastload {m.get('fastload', '?')} against torch.utils.data.DataLoader: {a['workers']} "
      f"worker{'s' if a['workers'] != 1 else ''}, "
      f"start method {a['start_method']}"
      + ({"default": " (fastload: its default, workers forked from a spawn-started zygote)"}.get(
          a.get("fastload_start_method"), f" (fastload: {a.get('fastload_start_method')})")
         if a.get("fastload_start_method") not in (None, "same") else "")
      + (f", cold 1st batch timed from iter() {a['gap']:g} s after construction"
         if a.get("gap") else "")
      + f", {a['rounds']} round(s) of {a['seconds']:g} s steady state "
      f"(after {a['warmup']:g} s warm-up), medians; loaders interleaved in one run")
    p(f"limits ({'measured before the runs' if a['quick'] else 'measured before and after the runs, higher kept'}): "
      f"memcpy, one thread: "
      f"{lim['memcpy_bytes_per_s'] / 1e9:.2f} GB/s; one process, dataset[i] + collate, samples/s: "
      + ", ".join(f"{k} {v:,.0f}" for k, v in lim["raw_samples_per_s"].items()))
    side = lim.get("side_by_side_samples_per_s") or {}
    if side:
        def share(name: str) -> str:
            med = res["workloads"][name]["median"]
            return ", ".join(f"{k} {100 * med[k]['samples_per_s'] / side[name]:.0f}%" for k in KINDS
                             if med[k].get("samples_per_s") is not None)
        p(f"{a['workers']} plain processes side by side, no loader (what {a['workers']} workers could "
          "make at best here), samples/s: "
          + "; ".join(f"{k} {v:,.0f} ({share(k)} of it)" for k, v in side.items()))
    p("the loop's own work per batch (index check + checksum, both loaders): "
      + ", ".join(f"{k} {v:,.0f} us" for k, v in lim.get("consumer_us_per_batch", {}).items()))


def _main_table(res: Dict[str, Any], p: Any, nw: int) -> List[str]:
    """The quiet machine's rows; returns the correctness problems to print."""
    mem_kind = next((r.get("mem_kind") for w in res["workloads"].values()
                     for runs in w["runs"].values() for r in runs if r.get("mem_kind")), "PSS")
    hdr = (f"{'workload':<{nw}}{'loader':<11}{'samples/s':>10}{'batches/s':>10}  {'vs DataLoader':<40}"
           f"{'1st batch':>10}{'warm 1st':>9}{'main CPU':>9}{'wkrs CPU':>9}{'peak ' + mem_kind:>10}  correct")
    p()
    p(hdr)
    p(f"{'':<{nw}}{'':<11}{'':>10}{'':>10}  {'(target) met?':<40}{'cold, s':>10}{'batch, s':>9}"
      f"{'ms/batch':>9}{'ms/batch':>9}{'MB':>10}")
    p("-" * len(hdr))
    notes: List[str] = []
    for name, wr in res["workloads"].items():
        for kind in KINDS:
            md = wr["median"][kind]
            vs = ""
            if kind == "fastload":
                t = wr["targets"][0]
                vs = f"{_num(t['value'], '.2f', 'x')} ({t['text']}) {_mark(t['ok'])}"
            p(f"{name if kind == 'fastload' else '':<{nw}}{kind:<11}{_num(md['samples_per_s'], ',.0f'):>10}"
              f"{_num(md['batches_per_s'], ',.1f'):>10}  {vs:<40}{_num(md['ttfb_cold_s'], '.2f'):>10}"
              f"{_num(md['ttfb_warm_s'], '.3f'):>9}{_num(md['main_cpu_ms_per_batch'], '.3f'):>9}"
              f"{_num(md.get('workers_cpu_ms_per_batch'), '.3g'):>9}"
              f"{_num(md['peak_mem_mb'], ',.0f'):>10}  {wr['correct'][kind]}")
        notes += [f"{name} {kind}: {prob}" for kind in KINDS for prob in wr["problems"][kind]]
    for name, why in res.get("skipped", {}).items():
        p(f"{name:<{nw}}skipped: {why}")
    return notes


def _cores(m: Dict[str, Any]) -> Optional[float]:
    """The cores a loader's processes kept busy in the steady state (CPU
    seconds of main and workers per second), from its median figures: beside
    busy neighbours, the share of the machine the scheduler gave it."""
    per_batch = [m.get("main_cpu_ms_per_batch"), m.get("workers_cpu_ms_per_batch"), m.get("batches_per_s")]
    if any(v is None for v in per_batch):
        return None
    return (per_batch[0] + per_batch[1]) * per_batch[2] / 1000


def _under_load_table(res: Dict[str, Any], p: Any, nw: int) -> List[str]:
    """The rows of the runs under load; returns the correctness problems to print."""
    notes: List[str] = []
    if not res.get("under_load"):
        return notes
    p()
    p("under load (same interleaving; samples/s medians):")
    p(f"  {'workload':<{nw}}{'run':<40}{'fastload':>10}{'DataLoader':>11}  {'ratio (target) met?':<44}"
      f"{'CPU ms/batch, main+workers':>28}{'cores used':>13}  correct")
    for st, cfg in res["under_load"].items():
        for name, wr in cfg["workloads"].items():
            fl, dl = wr["median"]["fastload"], wr["median"]["DataLoader"]
            t = wr["targets"][0]
            vs = f"{_num(t['value'], '.2f', 'x')} ({t['text']}) {_mark(t['ok'])}"
            cpu = " / ".join(f"{_num(m['main_cpu_ms_per_batch'], '.3g')}+"
                             f"{_num(m.get('workers_cpu_ms_per_batch'), '.3g')}" for m in (fl, dl))
            cores = " / ".join(_num(_cores(m), '.2f') for m in (fl, dl))
            p(f"  {name:<{nw}}{st + ': ' + cfg['what']:<40}{_num(fl['samples_per_s'], ',.0f'):>10}"
              f"{_num(dl['samples_per_s'], ',.0f'):>11}  {vs:<44}{cpu:>28}{cores:>13}  "
              f"{wr['correct']['fastload']}/{wr['correct']['DataLoader']}")
            notes += [f"{name} [{st}] {kind}: {prob}" for kind in KINDS for prob in wr["problems"][kind]]
    return notes


def _other_targets(res: Dict[str, Any], p: Any, nw: int) -> None:
    """Cold and warm first batch, memory and main CPU against their targets."""
    p()
    p("other targets (fastload against DataLoader, same run):")
    whats = ["cold 1st batch", "warm 1st batch", "peak memory", "main CPU/batch"]
    p(f"  {'workload':<{nw}}" + "".join(f"{w:<26}" for w in whats))
    for name, wr in res["workloads"].items():
        cells = []
        for what in whats:
            t = next((t for t in wr["targets"] if t["what"] == what), None)
            if t is None:
                cells.append("-")
            else:
                unit = " s" if what == "warm 1st batch" else "x"
                fmt = ".3f" if unit == " s" else ".2f"
                cells.append(f"{_num(t['value'], fmt, unit)} ({t['text']}) {_mark(t['ok'])}")
        p(f"  {name:<{nw}}" + "".join(f"{c:<26}" for c in cells).rstrip())
    for name, wr in res["workloads"].items():
        t = next(t for t in wr["targets"] if t["what"] == "warm 1st batch")
        if t.get("floor_s") and t["floor_s"] > 0.2:
            p(f"  note: {name}: one process takes about {t['floor_s']:.2f} s to make one batch "
              f"(batch size / one-process rate): <=0.2 s is out of reach for any loader here")
    every = [(name, wr) for name, wr in res["workloads"].items()] + [
        (f"{name} [{st}]", wr) for st, cfg in res.get("under_load", {}).items()
        for name, wr in cfg["workloads"].items()]
    logged = [f"{name} {kind} round {r.get('round', 0) + 1}" for name, wr in every
              for kind, runs in wr["runs"].items() for r in runs if r.get("log", "").strip()]
    if logged:
        p(f"  note: {len(logged)} run(s) wrote to stderr ({', '.join(logged[:4])}"
          f"{', ...' if len(logged) > 4 else ''}): see 'log' in --json")


def print_report(res: Dict[str, Any], out: TextIO) -> None:
    """The whole report: settings and limits, the quiet table, the runs under
    load, the other targets, problems, the machine and its load average."""
    m = res["machine"]
    p = lambda *s: print(*s, file=out)  # noqa: E731
    _header(res, p)
    nw = max([14] + [len(n) + 2 for n in res["workloads"]])
    notes = _main_table(res, p, nw)
    notes += _under_load_table(res, p, nw)
    _other_targets(res, p, nw)
    if notes:
        p()
        p("correctness problems:")
        for n in notes:
            p("  " + n)
    p()
    p(f"machine: {m.get('cpu_model', m['machine'])}, {m['cpus']} cpus ({m['cpus_usable']} usable), "
      f"{m.get('mem_total_gib', '?')} GiB, {m['kernel']}; Python {m['python']}, torch {m['torch']}; "
      f"decoder {m['decoder']}")
    p(f"load average at start {m['loadavg_start'][0]:.2f}, at end {m.get('loadavg_end', [0])[0]:.2f}; "
      f"took {res['elapsed_s']:.0f} s")


def plot(res: Dict[str, Any], path: str, out: TextIO) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written",
              file=out)
        return False
    names = list(res["workloads"])
    groups = [("samples/s", "samples/s (higher is better)"), ("cold 1st batch", "cold 1st batch (lower)"),
              ("peak memory", "peak memory (lower)")]
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8))
    for ax, (what, title) in zip(axes, groups):
        vals, needs = [], []
        for n in names:
            t = next((t for t in res["workloads"][n]["targets"] if t["what"] == what), None)
            vals.append((t or {}).get("value") or 0.0)
            needs.append((t or {}).get("need"))
        xs = range(len(names))
        bars = ax.bar(xs, vals, color=["#4c72b0" if v else "#bbbbbb" for v in vals])
        for x, nd in zip(xs, needs):
            if nd is not None:
                ax.plot([x - 0.4, x + 0.4], [nd, nd], color="#c44e52", lw=2)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("fastload / DataLoader", fontsize=8)
    m, a = res["machine"], res["args"]
    fig.suptitle(f"fastload vs DataLoader, {a['workers']} workers, {a['start_method']}; "
                 f"{m['cpus_usable']} cores, torch {m['torch']} (red: target)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}", file=out)
    return True
