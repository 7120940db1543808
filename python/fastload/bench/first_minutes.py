"""The first minutes of a run: how soon each loader delivers, against DataLoader fork and spawn.

    python -m fastload.bench.first_minutes [--rounds 3] [--workers 8] [--build-s 2.0]

(also a table of ``python -m fastload.bench``, ``--extras first-minutes``).
Users judge a loader by the first minutes of a real run, where start-up
costs show and the steady state has not begun. Each measure is a fresh
interpreter running a small training-like script, once per loader
(``fork`` and ``spawn``: ``torch.utils.data.DataLoader`` with that start
method; ``fastload``: ``FastLoader`` with its defaults), the loaders
alternating from round to round (A B C, then C B A, ...); medians are
reported, and each loader's time over fork's and over spawn's:

* ``cold``: a loader built just before ``iter()``: its first batch, timed
  from construction (the floor for fastload: one interpreter importing
  torch, its fork server);
* ``after-build``: the loader built, then a model built for ``build_s``
  seconds (a real model build or checkpoint load), then ``iter()``: its
  first batch, timed from ``iter()``;
* ``heavy-import``: as ``after-build``, with the dataset class defined in
  a module of the user's that takes 1 s to import (as one importing a big
  library does): fastload's zygote imports it while the model is built;
* ``second``: a validation loader (4 workers) built after the training
  loader ran an epoch: its first batch, timed from construction;
* ``later``: a loader built after the training loader ran an epoch and
  was dropped (a loader per evaluation, a notebook cell run again): its
  first batch, timed from construction (fastload's fork server lives on);
* ``import-top``: a newcomer's script: ``import fastload`` at its top
  (fastload's fork server starts there), ``build_s`` seconds of set-up,
  then the loader built and iterated: its first batch, timed from
  construction;
* ``short-epochs``: persistent workers, epochs of 16 batches of 64
  images of 3x64x64 made from a seed (a little work per sample): the median
  time of epochs 2 to 6, from ``iter()`` to the epoch's last batch (the
  turnaround at the epoch boundary weighs on short epochs).

The Ultralytics training time (fastload.install() against DataLoader fork
and the spawn workaround) is measured by ``tests/integration/yolo_train.py``
in a venv of its own (``bash .ci/ultralytics``): Ultralytics needs
torchvision, which the benchmark's environment may not have.
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

# The dataset, in a module of its own (importable by name, as a user's is).
IMAGES_MODULE = textwrap.dedent("""
    import torch
    from torch.utils.data import Dataset


    class Images(Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return torch.rand(3, 64, 64, generator=g), i % 10
""")

# The same dataset, defined in a module that takes 1 s to import.
HEAVY_MODULE = textwrap.dedent("""
    import time
    from images import Images

    time.sleep(1.0)  # what importing a big library costs


    class SlowImages(Images):
        pass
""")

SCRIPT = textwrap.dedent("""
    import gc, json, statistics, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from images import Images


    def make(mode, n, workers, cls=Images, **kw):
        kw = dict(batch_size=64, num_workers=workers, **kw)
        if mode == "fastload":
            from fastload import FastLoader
            return FastLoader(cls(n), **kw)
        return DataLoader(cls(n), multiprocessing_context=mode, **kw)


    def first_batch(loader):
        it = iter(loader)
        next(it)
        return it


    def main():
        what, mode, workers, build_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        if what == "import-top" and mode == "fastload":
            import fastload  # at the script's top, as a user's script has it
        out = {}
        if what == "cold":
            t0 = time.perf_counter()
            loader = make(mode, 64 * 8, workers)
            it = first_batch(loader)
            out["s"] = time.perf_counter() - t0
        elif what in ("after-build", "heavy-import"):
            if what == "heavy-import":
                from heavymod import SlowImages  # the module takes 1 s to import
                loader = make(mode, 64 * 8, workers, cls=SlowImages)
            else:
                loader = make(mode, 64 * 8, workers)
            t_build = time.perf_counter()
            layers = []
            while time.perf_counter() - t_build < build_s:
                layers.append(nn.Linear(512, 512))
            t0 = time.perf_counter()
            it = first_batch(loader)
            out["s"] = time.perf_counter() - t0
        elif what == "second":
            train = make(mode, 64 * 8, workers)
            for _ in train:
                pass
            t0 = time.perf_counter()
            val = make(mode, 64 * 4, 4)
            it = first_batch(val)
            out["s"] = time.perf_counter() - t0
            for _ in it:
                pass
        elif what == "later":
            train = make(mode, 64 * 8, workers)
            for _ in train:
                pass
            del train
            gc.collect()
            t0 = time.perf_counter()
            val = make(mode, 64 * 4, workers)
            it = first_batch(val)
            out["s"] = time.perf_counter() - t0
            for _ in it:
                pass
        elif what == "import-top":
            t_build = time.perf_counter()
            layers = []
            while time.perf_counter() - t_build < build_s:
                layers.append(nn.Linear(512, 512))
            t0 = time.perf_counter()
            loader = make(mode, 64 * 8, workers)
            it = first_batch(loader)
            out["s"] = time.perf_counter() - t0
        elif what == "short-epochs":
            loader = make(mode, 64 * 16, workers, persistent_workers=True, shuffle=True)
            times = []
            for epoch in range(6):
                t0 = time.perf_counter()
                for x, y in loader:
                    pass
                times.append(time.perf_counter() - t0)
            out["s"] = statistics.median(times[1:])
            out["epochs_s"] = times
        print(json.dumps(out), flush=True)


    if __name__ == "__main__":  # DataLoader's spawn re-imports this file in its workers
        main()
""")

MODES = ("fork", "spawn", "fastload")
MEASURES = ("cold", "after-build", "heavy-import", "second", "later", "import-top",
            "short-epochs")
LABELS = {
    "cold": "built just before iter(): 1st batch from construction",
    "after-build": "built, model built, iter(): 1st batch from iter()",
    "heavy-import": "the same, dataset's module takes 1 s to import",
    "second": "2nd loader (4 workers) after an epoch: 1st batch",
    "later": "a loader after the 1st ran and was dropped: 1st batch",
    "import-top": "script: import at top, set-up, loader: 1st batch",
    "short-epochs": "persistent, 16-batch epochs: epoch time",
}


def measure_first_minutes(rounds: int = 3, workers: int = 8, build_s: float = 2.0,
                          measures: tuple = MEASURES) -> Dict[str, Any]:
    """Interleaved runs of every measure with every loader; medians in seconds."""
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {w: {m: [] for m in MODES} for w in measures}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for name, text in (("images.py", IMAGES_MODULE), ("heavymod.py", HEAVY_MODULE)):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        for r in range(rounds):
            for what in measures:
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    out = subprocess.run([sys.executable, script, what, mode, str(workers),
                                          str(build_s)], check=True, capture_output=True,
                                         text=True, cwd=tmp, timeout=600).stdout
                    runs[what][mode].append(json.loads(out.strip().splitlines()[-1]))
    median = {w: {m: statistics.median(x["s"] for x in runs[w][m]) for m in MODES} for w in measures}
    return {"rounds": rounds, "workers": workers, "build_s": build_s, "measures": list(measures),
            "runs": runs, "median": median}


def report_lines(res: Dict[str, Any]) -> str:
    """The first-minutes table printed after the benchmark's main one."""
    lines = [f"\nFirst minutes: {res['workers']} workers (the 2nd loader 4), model build "
             f"{res['build_s']:g} s, medians of {res['rounds']} rounds, seconds (lower is better)",
             f"{'measure':<52}{'fork':>8}{'spawn':>8}{'fastload':>10}{'/fork':>8}{'/spawn':>8}"]
    for what in res["measures"]:
        m = res["median"][what]
        lines.append(f"{LABELS[what]:<52}{m['fork']:>8.3f}{m['spawn']:>8.3f}{m['fastload']:>10.3f}"
                     f"{m['fastload'] / m['fork']:>7.2f}x{m['fastload'] / m['spawn']:>7.2f}x")
    lines.append("Ultralytics training time: bash .ci/ultralytics (a venv with torchvision)")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--build-s", type=float, default=2.0)
    p.add_argument("--measures", default=",".join(MEASURES),
                   help=f"comma-separated, default all ({','.join(MEASURES)})")
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    a = p.parse_args(argv)
    res = measure_first_minutes(a.rounds, a.workers, a.build_s, tuple(a.measures.split(",")))
    print_and_save(report_lines(res), res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
