"""The first epoch of a training-like script: loader built, then the model, then iter().

    python -m fastload.bench.first_epoch [--rounds 3] [--build-s 2.0] [--workers 2]

(also part of ``python -m fastload.bench``). Each run is a fresh interpreter
running the same script with one loader:

* ``fork`` / ``spawn``: ``torch.utils.data.DataLoader`` with that start method;
* ``fastload``: ``FastLoader`` (its zygote starts when the loader is built);
* ``install``: ``fastload.install()`` at the top of the script, then a plain
  ``DataLoader`` (its zygote starts at ``install()``).

The script builds its model between the loader and ``iter()`` (a stack of
layers initialised for about ``build_s`` seconds, as a real model build or
checkpoint load would take), then trains one epoch of 32 batches (64 float
tensors of 3x64x64 per batch, a linear step). It reports the time from
``iter()`` to the end of the epoch and from the start of the script (after
its imports: torch is imported by every variant alike) to the end of the
epoch. Runs alternate between the loaders (A B C D, then D C B A, ...);
medians are reported, and ratios of DataLoader(fork)'s time to each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Any, Dict, List, Optional

from .fresh import print_and_save

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset


    class Images(Dataset):
        def __len__(self):
            return 32 * 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.rand(3, 64, 64, generator=g), i % 10


    def main(t_start):
        mode, build_s, workers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
        kw = dict(batch_size=64, shuffle=True, num_workers=workers)
        if mode in ("fork", "spawn"):
            loader = DataLoader(Images(), multiprocessing_context=mode, **kw)
        elif mode == "fastload":
            from fastload import FastLoader
            loader = FastLoader(Images(), **kw)
        else:
            loader = DataLoader(Images(), **kw)
        t_build = time.perf_counter()
        layers = []
        while time.perf_counter() - t_build < build_s:  # the model build
            layers.append(nn.Linear(512, 512))
        model = nn.Linear(3 * 64 * 64, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        t_iter = time.perf_counter()
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x.flatten(1)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        t_end = time.perf_counter()
        print(json.dumps({"epoch_s": t_end - t_iter, "script_s": t_end - t_start}))


    if __name__ == "__main__":  # DataLoader's spawn re-imports this file in its workers
        t0 = time.perf_counter()
        if sys.argv[1] == "install":
            import fastload
            fastload.install()
        main(t0)
""")

MODES = ("fork", "spawn", "fastload", "install")


def measure_first_epoch(rounds: int = 3, build_s: float = 2.0, workers: int = 2) -> Dict[str, Any]:
    """Interleaved runs of the script with every loader; medians in seconds."""
    runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                out = subprocess.run([sys.executable, script, mode, str(build_s), str(workers)],
                                     check=True, capture_output=True, text=True, cwd=tmp).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    median = {m: {k: statistics.median(x[k] for x in runs[m]) for k in ("epoch_s", "script_s")}
              for m in MODES}
    return {"rounds": rounds, "build_s": build_s, "workers": workers, "runs": runs,
            "median": median,
            "vs_fork": {m: median["fork"]["epoch_s"] / median[m]["epoch_s"] for m in MODES}}


def report_lines(res: Dict[str, Any]) -> str:
    """The first-epoch table printed after the benchmark's main one."""
    lines = [f"\nFirst epoch after a {res['build_s']:g} s model build, {res['workers']} workers, "
             f"medians of {res['rounds']} rounds",
             f"{'loader':<10}{'iter() to epoch end s':>24}{'script start to epoch end s':>30}"
             f"{'vs fork':>10}"]
    for mode in MODES:
        m = res["median"][mode]
        lines.append(f"{mode:<10}{m['epoch_s']:>24.2f}{m['script_s']:>30.2f}"
                     f"{res['vs_fork'][mode]:>9.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--build-s", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    a = p.parse_args(argv)
    res = measure_first_epoch(a.rounds, a.build_s, a.workers)
    print_and_save(report_lines(res), res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
