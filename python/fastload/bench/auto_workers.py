"""``num_workers="auto"`` against a sweep of fixed counts, in one run.

    python -m fastload.bench.auto_workers [--rounds 2] [--seconds 6]

(also a table of ``python -m fastload.bench``, ``--extras auto-workers``).
Two datasets, each run with ``num_workers`` fixed at every count of a sweep
and with ``"auto"``, the configurations alternating from round to round
(forwards, then backwards); medians are reported.

* ``io``: each sample sleeps 5 ms (a network file system: waiting, not
  computing), batch 16, and the loop does nothing else. The count that wins
  is far past the cores.
* ``cpu``: each sample computes for about 1 ms in pure Python, batch 16,
  and the training loop computes for about 5 ms a step in pure Python too
  (it needs a core of its own). The count that wins is at most the cores
  left to the workers, and more only slows the loop's steps.

Each configuration is one loader, one epoch long enough never to end,
read for ``seconds`` seconds from ``iter()``; its rate is the samples per
second of the second half of that time, so ``"auto"`` is judged on where it
got to within its first epoch (the first half is its ramp). For ``cpu`` the
median time of the loop's own step over the same half is reported too: a
count that takes the loop's core shows there.

Targets: ``"auto"`` at >= 0.9x the best fixed count on both, >= 3x
``num_workers=2`` on ``io``, and on ``cpu`` a step time within 5% of the
step time at the best fixed count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.data import Dataset

from .fresh import print_and_save

IO_SWEEP = (1, 2, 4, 8, 16, 32)
CPU_SWEEP = (1, 2, 3, 4)


class Sleepy(Dataset):
    """Each sample waits ``delay`` seconds (I/O), then is a small tensor."""

    def __init__(self, n: int = 10**7, delay: float = 0.005) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((16,), float(i))


def _compute(n: int) -> int:
    s = 0
    for k in range(n):
        s += k * k
    return s


class Busy(Dataset):
    """Each sample computes ``work`` iterations of a pure-Python loop (~1 ms)."""

    def __init__(self, n: int = 10**7, work: int = 20_000) -> None:
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        _compute(self.work)
        return torch.full((16,), float(i))


def _run(kind: str, workers: Any, seconds: float, step_work: int) -> Dict[str, Any]:
    from .. import FastLoader

    ds = Sleepy() if kind == "io" else Busy()
    with warnings.catch_warnings():  # more workers than cores: DataLoader's warning, expected
        warnings.simplefilter("ignore", UserWarning)
        loader = FastLoader(ds, batch_size=16, num_workers=workers)
        it = iter(loader)
    t0 = time.perf_counter()
    half = t0 + seconds / 2
    end = t0 + seconds
    counted, steps = 0, []
    t_half: Optional[float] = None
    while True:
        batch = next(it)
        now = time.perf_counter()
        if now >= end:
            break
        if now >= half:
            if t_half is None:
                t_half = now
            else:
                counted += len(batch)
        if step_work:
            s0 = time.perf_counter()
            _compute(step_work)
            if now >= half:
                steps.append(time.perf_counter() - s0)
        del batch
    rate = counted / (time.perf_counter() - t_half) if t_half is not None else 0.0
    st = loader.stats()
    used = st.workers if st is not None else workers
    del it, loader
    return {"rate": rate, "workers": used,
            "step_ms": statistics.median(steps) * 1e3 if steps else None}


def measure_auto_workers(rounds: int = 2, seconds: float = 6.0) -> Dict[str, Any]:
    """Both tables' runs and medians (see the module's docstring)."""
    out: Dict[str, Any] = {"rounds": rounds, "seconds": seconds, "tables": {}}
    for kind, sweep, step_work in (("io", IO_SWEEP, 0), ("cpu", CPU_SWEEP, 100_000)):
        configs: List[Any] = [*sweep, "auto"]
        runs: Dict[str, List[Dict[str, Any]]] = {str(c): [] for c in configs}
        for r in range(rounds):
            for c in (configs if r % 2 == 0 else configs[::-1]):
                runs[str(c)].append(_run(kind, c, seconds, step_work))
        med = {c: {"rate": statistics.median(x["rate"] for x in rs),
                   "workers": statistics.median(x["workers"] for x in rs),
                   "step_ms": (statistics.median(x["step_ms"] for x in rs)
                               if rs[0]["step_ms"] is not None else None)}
               for c, rs in runs.items()}
        out["tables"][kind] = {"runs": runs, "median": med}
    return out


def _best(med: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    fixed = {c: m for c, m in med.items() if c != "auto"}
    c = max(fixed, key=lambda k: fixed[k]["rate"])
    return c, fixed[c]


def report_lines(res: Dict[str, Any]) -> str:
    """The table printed after the benchmark's main one."""
    lines = [f"\nnum_workers='auto' against fixed counts: medians of {res['rounds']} rounds, "
             f"samples/s over the second half of {res['seconds']:g} s from iter()"]
    for kind, table in res["tables"].items():
        med = table["median"]
        best_c, best = _best(med)
        auto = med["auto"]
        desc = ("io: 5 ms sleep a sample, batch 16" if kind == "io" else
                "cpu: ~1 ms of Python a sample, batch 16, a ~5 ms Python step in the loop")
        lines.append(f"  {desc}")
        row = "    " + "  ".join(f"{c}: {m['rate']:,.0f}" + (f" ({m['step_ms']:.2f} ms step)"
                                                           if m["step_ms"] else "")
                                 for c, m in med.items() if c != "auto")
        lines.append(row)
        ratio = auto["rate"] / best["rate"] if best["rate"] else 0.0
        verdict = "ok" if ratio >= 0.9 else "MISS"
        text = (f"    auto: {auto['rate']:,.0f} with {auto['workers']:g} workers = {ratio:.2f}x "
                f"the best fixed count ({best_c}) (>= 0.9x {verdict})")
        if kind == "io" and med.get("2", {}).get("rate"):
            r2 = auto["rate"] / med["2"]["rate"]
            text += f"; {r2:.1f}x num_workers=2 (>= 3x {'ok' if r2 >= 3 else 'MISS'})"
        if kind == "cpu" and auto["step_ms"] and best["step_ms"]:
            slower = auto["step_ms"] / best["step_ms"] - 1
            text += (f"; the loop's step {auto['step_ms']:.2f} ms, {slower:+.1%} against the best "
                     f"count's (<= +5% {'ok' if slower <= 0.05 else 'MISS'})")
        lines.append(text)
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    a = p.parse_args(argv)
    res = measure_auto_workers(a.rounds, a.seconds)
    print_and_save(report_lines(res), res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
