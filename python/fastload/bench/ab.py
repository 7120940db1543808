"""``python -m fastload.bench.ab REV``: this tree's loader against another
commit's, run for run, on this machine.

The way to check a change to the batch path. Both sides run the same
workloads through their own benchmark child (:mod:`fastload.bench.child`,
whose interface is stable: a JSON spec in, a JSON result out), in fresh
processes, alternating (A B, then B A) for ``--rounds`` rounds, one run at a
time; each run's epoch 2 is measured as ``python -m fastload.bench``
measures it (a warm-up, then the steady window of ``--seconds``). Printed
per workload: each side's median and per-round values of samples/s, the
main process's CPU per batch and the workers' CPU per batch, and the ratio
of this tree to ``REV`` (per round, paired by round: its median and its
range over the rounds).

``REV`` is built once into a virtual environment of its own under
``$FASTLOAD_AB_CACHE`` (default ``~/.cache/fastload-ab``), keyed by commit
id: ``git archive`` of the commit, a venv that sees this interpreter's
packages (torch is shared, not installed again) and ``pip install
--no-build-isolation --no-deps`` of the commit. ``--base REV2`` measures ``REV2`` in place of this tree, built the
same way; without it, this side is the fastload the running interpreter
imports (an editable install must be rebuilt after a change to ``src/`` or
``csrc/``: ``pip install --no-build-isolation -e .``).

The figures of a shared or busy machine are noisy: read the per-round
ratios' range before the median, and add rounds until it is narrow enough
to decide.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from . import runner
from .options import QUICK, QUICK_WORKLOADS

# What a run reports, as the A/B table shows it: (key, label, format).
METRICS = (("samples_per_s", "samples/s", "{:,.0f}"),
           ("main_cpu_ms_per_batch", "main CPU ms/batch", "{:.3f}"),
           ("workers_cpu_ms_per_batch", "workers' CPU ms/batch", "{:.3f}"))
# The benchmark's child may run past --seconds up to this many times it
# (to hold min_batches batches), as python -m fastload.bench lets it.
MAX_STEADY = 5


def cache_dir() -> str:
    """Where the venvs of built commits live."""
    return os.environ.get("FASTLOAD_AB_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fastload-ab")


def repo_root(start: Optional[str] = None) -> str:
    """The git checkout holding ``start`` (default: this package's source,
    which an editable install runs from; else the current directory)."""
    here = start or os.path.dirname(os.path.abspath(__file__))
    for cwd in (here, os.getcwd()):
        got = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd,
                             capture_output=True, text=True)
        if got.returncode == 0:
            return got.stdout.strip()
    raise SystemExit("fastload.bench.ab: not in a git checkout of fastload (run it from one)")


def resolve(rev: str, root: str) -> str:
    """The full commit id ``rev`` names in the checkout at ``root``."""
    got = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         cwd=root, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"fastload.bench.ab: {rev!r} names no commit in {root}")
    return got.stdout.strip()


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (two A/B runs building one commit
    wait for each other rather than build it twice into one directory)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_python(sha: str, root: str, cache: Optional[str] = None,
                 log: TextIO = sys.stderr) -> str:
    """The interpreter of a venv with commit ``sha`` of ``root`` installed;
    built on first use (a minute or two: the C++ extension compiles)."""
    cache = cache or cache_dir()
    home = os.path.join(cache, sha)
    python = os.path.join(home, "venv", "bin", "python")
    ready = os.path.join(home, "ready")
    os.makedirs(cache, exist_ok=True)
    with _locked(os.path.join(cache, f"{sha}.lock")):
        if os.path.exists(ready):
            return python
        shutil.rmtree(home, ignore_errors=True)  # a build that did not finish
        src = os.path.join(home, "src")
        os.makedirs(src)
        print(f"fastload.bench.ab: building {sha[:10]} into {home}", file=log, flush=True)
        archive = subprocess.Popen(["git", "archive", "--format=tar", sha], cwd=root,
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", src], stdin=archive.stdout, check=True)
        assert archive.stdout is not None
        archive.stdout.close()
        if archive.wait() != 0:
            raise SystemExit(f"fastload.bench.ab: git archive {sha} failed")
        _make_venv(os.path.join(home, "venv"), python)
        with open(os.path.join(home, "build.log"), "w") as out:
            got = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation",
                                  "--no-deps", src], stdout=out, stderr=subprocess.STDOUT)
        if got.returncode != 0:
            raise SystemExit(f"fastload.bench.ab: building {sha[:10]} failed; see "
                             f"{os.path.join(home, 'build.log')}")
        where = subprocess.run([python, "-c", "import fastload; print(fastload.__file__)"],
                               capture_output=True, text=True, cwd=tempfile.gettempdir())
        if not where.stdout.strip().startswith(os.path.join(home, "venv")):
            raise SystemExit(f"fastload.bench.ab: the venv of {sha[:10]} imports fastload "
                             f"from {where.stdout.strip() or where.stderr.strip()!r}")
        with open(ready, "w") as f:
            f.write(sha + "\n")
    return python


def _make_venv(venv: str, python: str) -> None:
    """A venv that sees this interpreter's packages (torch, numpy, the build
    tools) but runs its own fastload. Not ``--system-site-packages``: the
    ``.pth`` files there run at start-up, and an editable install of
    fastload in the base interpreter puts a finder on ``sys.meta_path`` that
    would win over the venv's own copy. The directories are added by a
    ``.pth`` of the venv's instead, after its own site-packages, and their
    ``.pth`` files are not run."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", venv], check=True)
    dirs = [d for d in sys.path if d.endswith("site-packages") and os.path.isdir(d)]
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "_fastload_ab_shared.pth"), "w") as f:
        f.write("".join(d + "\n" for d in dirs))


class Side:
    """One side of the comparison: a label and the interpreter that runs it."""

    def __init__(self, label: str, python: str, sys_path: Sequence[str]) -> None:
        self.label, self.python, self.sys_path = label, python, list(sys_path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastload.bench.ab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(__doc__ or "").split("\n\n")[0].replace("``", ""),
        epilog="example: python -m fastload.bench.ab HEAD~3 --rounds 6\n"
               "         python -m fastload.bench.ab 87fd86b --base main --seconds 2 "
               "--workloads transport_u8")
    p.add_argument("rev", help="the commit to compare against (any git revision)")
    p.add_argument("--base", metavar="REV2", default=None,
                   help="measure commit REV2 in place of this tree (built the same way)")
    p.add_argument("--workloads", default=",".join(QUICK_WORKLOADS),
                   help=f"comma-separated (default {','.join(QUICK_WORKLOADS)})")
    p.add_argument("--rounds", type=int, default=5, help="runs of each side per workload (default 5)")
    p.add_argument("--seconds", type=float, default=QUICK["seconds"],
                   help=f"steady window of epoch 2, after the warm-up (default {QUICK['seconds']:g}, "
                        "the window of python -m fastload.bench --quick)")
    p.add_argument("--warmup", type=float, default=QUICK["warmup"],
                   help=f"warm-up seconds at epoch 2's start (default {QUICK['warmup']:g})")
    p.add_argument("--min-batches", type=int, default=QUICK["min_batches"],
                   help="the steady window runs on until it holds this many batches "
                        f"(default {QUICK['min_batches']})")
    p.add_argument("--workers", type=int, default=2, help="num_workers (default 2)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size (default: each workload's own)")
    p.add_argument("--start-method", default=None,
                   choices=["spawn", "forkserver", "fork"],
                   help="multiprocessing_context (default: none, fastload's zygote)")
    p.add_argument("--neighbours", type=int, default=0,
                   help="busy-looping processes beside each run (default 0), as a machine "
                        "shared with other people's work: an epoch's start-up then reaches "
                        "further into the window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures here")
    return p


def _specs(a: argparse.Namespace, sides: Sequence[Side], cache: str) -> List[Tuple[int, str, int, Dict[str, Any]]]:
    """(round, workload, side, spec) of every run, in the order they run:
    per round and workload, A then B in even rounds, B then A in odd ones."""
    from .workloads import WORKLOADS

    plan = []
    for r in range(a.rounds):
        for name in a.workloads:
            w = WORKLOADS[name]
            bs = a.batch_size or w.batch_size
            for s in ((0, 1) if r % 2 == 0 else (1, 0)):
                plan.append((r, name, s, {
                    "workload": w.spec or {"name": w.name}, "kind": "fastload",
                    "batch_size": bs, "workers": a.workers, "seed": a.seed,
                    "short_batches": QUICK["short_batches"] * a.workers, "warmup": a.warmup,
                    "seconds": a.seconds, "min_batches": a.min_batches,
                    "max_seconds": MAX_STEADY * a.seconds, "gap": 0.0,
                    "neighbours": a.neighbours,
                    "start_method": a.start_method, "cache": cache,
                    "sys_path": sides[s].sys_path}))
    return plan


def ratio_summary(a_values: Sequence[Optional[float]],
                  b_values: Sequence[Optional[float]]) -> Dict[str, Any]:
    """The per-round ratios a/b (rounds where both sides have a figure),
    their median, smallest and largest."""
    ratios = [x / y for x, y in zip(a_values, b_values) if x is not None and y]
    if not ratios:
        return {"ratios": [], "median": None, "min": None, "max": None}
    return {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios)}


def summarise(results: Dict[str, List[List[Dict[str, Any]]]]) -> Dict[str, Any]:
    """Per workload and metric: each side's per-round values and median, and
    the ratio of side 0 to side 1."""
    out: Dict[str, Any] = {}
    for name, per_side in results.items():
        row: Dict[str, Any] = {"errors": [[r["error"] for r in runs if "error" in r]
                                          for runs in per_side],
                               "order_errors": [[r["epoch2"]["order_error"] for r in runs
                                                 if r.get("epoch2", {}).get("order_error")]
                                                for runs in per_side]}
        for key, _label, _fmt in METRICS:
            values = [[r.get(key) for r in runs] for runs in per_side]
            present = [[v for v in vs if v is not None] for vs in values]
            row[key] = {"values": values,
                        "median": [statistics.median(p) if p else None for p in present],
                        "ratio": ratio_summary(values[0], values[1])}
        out[name] = row
    return out


def _fmt(fmt: str, v: Optional[float]) -> str:
    return "-" if v is None else fmt.format(v)


def report(summary: Dict[str, Any], sides: Sequence[Side], out: TextIO) -> None:
    """The A/B table: per workload and metric, medians, ratio and its range, rounds."""
    a, b = sides[0].label, sides[1].label
    w0 = 12
    out.write(f"\nA = {a}\nB = {b}\nratio = A/B per round (median, min-max)\n")
    for name, row in summary.items():
        out.write(f"\n{name}\n")
        out.write(f"  {'':<22} {'A median':>{w0}} {'B median':>{w0}}   ratio A/B\n")
        for key, label, fmt in METRICS:
            m, rs = row[key]["median"], row[key]["ratio"]
            spread = ("-" if rs["median"] is None else
                      f"{rs['median']:.3f}x ({rs['min']:.3f}-{rs['max']:.3f}, "
                      f"{len(rs['ratios'])} rounds)")
            out.write(f"  {label:<22} {_fmt(fmt, m[0]):>{w0}} {_fmt(fmt, m[1]):>{w0}}   {spread}\n")
            for s, side_label in enumerate(("A", "B")):
                vals = " ".join(_fmt(fmt, v) for v in row[key]["values"][s])
                out.write(f"  {'':<4}{side_label} rounds: {vals}\n")
        for s, errs in enumerate(row["errors"]):
            for e in errs:
                out.write(f"  {'AB'[s]} ERROR: {e.strip().splitlines()[-1]}\n")
        for s, errs in enumerate(row["order_errors"]):
            for e in errs:
                out.write(f"  {'AB'[s]} WRONG BATCHES: {e}\n")


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    from .workloads import WORKLOADS, cache_root, timed_prepare

    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    unknown = [w for w in a.workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"fastload.bench.ab: unknown workloads {unknown}; "
                         f"known: {', '.join(WORKLOADS)}")
    if a.rounds < 1:
        raise SystemExit("fastload.bench.ab: --rounds must be at least 1")
    root = repo_root()
    sha_b = resolve(a.rev, root)
    side_b = Side(f"{a.rev} ({sha_b[:10]})", built_python(sha_b, root), [])
    if a.base is not None:
        sha_a = resolve(a.base, root)
        side_a = Side(f"{a.base} ({sha_a[:10]})", built_python(sha_a, root), [])
    else:
        import fastload

        side_a = Side(f"this tree ({os.path.dirname(fastload.__file__)})", sys.executable, sys.path)
    sides = (side_a, side_b)
    cache = cache_root()
    for name in a.workloads:
        timed_prepare(WORKLOADS[name], cache)
    plan = _specs(a, sides, cache)
    results: Dict[str, List[List[Dict[str, Any]]]] = {n: [[], []] for n in a.workloads}

    def started(i: int) -> None:
        r, name, s, _spec = plan[i]
        print(f"[{i + 1}/{len(plan)}] {name} {'AB'[s]} round {r + 1}/{a.rounds} ...",
              end="", file=sys.stderr, flush=True)

    def done(i: int, res: Dict[str, Any]) -> None:
        r, name, s, _spec = plan[i]
        results[name][s].append(res)
        sps = res.get("samples_per_s")
        print(" ERROR" if "error" in res else f" {sps or 0:,.0f} samples/s",
              file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as quiet_cwd:  # no stray module shadows fastload
        runner.run_children([spec for _r, _n, _s, spec in plan],
                            180 + 4 * (MAX_STEADY * a.seconds + a.warmup), started, done,
                            python_of=lambda i: sides[plan[i][2]].python, cwd=quiet_cwd)
    summary = summarise(results)
    report(summary, sides, sys.stdout)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sides": [s.label for s in sides], "args": vars(a), "summary": summary,
                       "runs": results}, f, indent=1, default=str)
            f.write("\n")
    bad = any(any(errs) for row in summary.values() for errs in row["errors"] + row["order_errors"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
