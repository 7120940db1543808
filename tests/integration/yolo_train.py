"""Ultralytics YOLO trained on DataLoader and under ``fastload.install()``: same batches, same losses?

Ultralytics builds its loaders itself (``InfiniteDataLoader``, a DataLoader
subclass whose iterator lives across epochs), so this is fastload reaching
code the user does not own. Run by ``.ci/ultralytics`` in a venv of its own
(Ultralytics needs torchvision, which has no CPU build for the torch the
rest of the suite pins), or by hand:

    pip install torch==2.14.1 torchvision==0.29.1 ultralytics && pip install .
    python tests/integration/yolo_train.py [--epochs 3] [--images 32] [--workers 2] [--spawn]

It writes a small synthetic detection dataset in YOLO format (images with
one filled rectangle each, its box as the label, and a data yaml), then
trains ``yolov8n.yaml`` (built from the yaml: no weights are downloaded) on
it in a fresh process per loader, with the same seed and
``deterministic=True``:

1. ``plain``: DataLoader as Ultralytics builds it (its default start
   method, fork on Linux);
2. ``fastload``: the same after ``fastload.install()`` (what
   ``python -m fastload run`` does);
3. with ``--spawn``, ``spawn``: DataLoader with spawn as the start method
   for every loader, the workaround users of fork-unsafe setups write.

On a CPU, Ultralytics' trainer sets ``workers = 0`` ("faster CPU training"),
which would leave both runs on DataLoader's single-process path: a callback
sets the worker count back (``--workers``) before the loaders are built.
``close_mosaic`` switches mosaic off for the last epoch, which makes
Ultralytics rebuild its train loader's iterator after changing the dataset
(``InfiniteDataLoader.reset()``).

Compared against ``plain``: every batch's bytes (images, classes, boxes;
a hash per batch, taken in a wrapped ``preprocess_batch``), every batch's
loss items, and the iterator class the run trained on. Printed: each run's
training time (from the trainer's start to its end, loaders' start-up
included) and each epoch's. Exit status 0 only if every run's batches and
losses equal plain's and the fastload run iterated on fastload. ``--json
FILE`` writes the runs' figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

SEED = 0


def make_dataset(root: Path, images: int, size: int) -> Path:
    """``images`` images of ``size`` px, each with one filled rectangle (class
    0) on noise, labels in YOLO format (class cx cy w h, normalised); returns
    the data yaml. Training and validation use the same images."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(SEED)
    image_dir, label_dir = root / "images" / "train", root / "labels" / "train"
    image_dir.mkdir(parents=True)
    label_dir.mkdir(parents=True)
    for n in range(images):
        pixels = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
        w, h = rng.integers(size // 5, size * 5 // 8, 2)
        x0, y0 = rng.integers(0, size - w), rng.integers(0, size - h)
        pixels[y0:y0 + h, x0:x0 + w] = rng.integers(150, 255, 3, dtype=np.uint8)
        Image.fromarray(pixels).save(image_dir / f"{n:03d}.png")
        cx, cy = (x0 + w / 2) / size, (y0 + h / 2) / size
        (label_dir / f"{n:03d}.txt").write_text(f"0 {cx:.6f} {cy:.6f} {w / size:.6f} {h / size:.6f}\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames:\n  0: box\n")
    return data


def _floats(items: Any) -> List[float]:
    """Loss items as plain floats (a tensor in older Ultralytics, a dict of them in newer)."""
    if isinstance(items, dict):
        return [float(v) for v in items.values()]
    return [float(v) for v in items.flatten().tolist()]


def _batch_hash(batch: Dict[str, Any]) -> str:
    """A hash of the bytes of a batch's images, classes and boxes (and their shapes and dtypes)."""
    h = hashlib.sha256()
    for key in ("img", "cls", "bboxes", "batch_idx"):
        t = batch[key].detach().cpu().contiguous()
        h.update(f"{key} {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def train_once(mode: str, data: Path, args: argparse.Namespace, out: Path) -> None:
    """One training run in this process; writes its history to ``out`` as JSON."""
    if mode == "fastload":
        import fastload

        fastload.install()
    elif mode == "spawn":
        import torch.multiprocessing as mp

        mp.set_start_method("spawn", force=True)  # DataLoader's default context
    from ultralytics import YOLO

    history: Dict[str, Any] = {"losses": [], "hashes": [], "epoch_s": [], "iterator": None,
                               "loader": None, "train_s": None}
    clock: Dict[str, float] = {}

    def on_pretrain_routine_start(trainer: Any) -> None:
        clock["start"] = time.perf_counter()
        trainer.args.workers = args.workers  # undo "workers = 0" on a CPU
        preprocess = trainer.preprocess_batch

        def hashed_preprocess(batch: Dict[str, Any]) -> Dict[str, Any]:
            if trainer.model.training:  # a training batch, not a validation one
                history["hashes"][-1].append(_batch_hash(batch))
            return preprocess(batch)

        trainer.preprocess_batch = hashed_preprocess

    def on_train_start(trainer: Any) -> None:
        history["loader"] = type(trainer.train_loader).__qualname__

    def on_train_epoch_start(trainer: Any) -> None:
        history["losses"].append([])
        history["hashes"].append([])
        clock["epoch"] = time.perf_counter()

    def on_train_batch_end(trainer: Any) -> None:
        history["losses"][-1].append(_floats(trainer.loss_items))
        it = trainer.train_loader.iterator
        history["iterator"] = f"{type(it).__module__}.{type(it).__qualname__}"

    def on_train_epoch_end(trainer: Any) -> None:
        history["epoch_s"].append(round(time.perf_counter() - clock["epoch"], 3))

    def on_train_end(trainer: Any) -> None:
        history["train_s"] = round(time.perf_counter() - clock["start"], 3)

    model = YOLO("yolov8n.yaml")
    for event, callback in [("on_pretrain_routine_start", on_pretrain_routine_start),
                            ("on_train_start", on_train_start),
                            ("on_train_epoch_start", on_train_epoch_start),
                            ("on_train_batch_end", on_train_batch_end),
                            ("on_train_epoch_end", on_train_epoch_end),
                            ("on_train_end", on_train_end)]:
        model.add_callback(event, callback)
    model.train(
        data=str(data), epochs=args.epochs, imgsz=args.imgsz, batch=args.batch,
        workers=args.workers, device=args.device, seed=SEED, deterministic=True, amp=False,
        plots=False, val=False, close_mosaic=1, project=str(out.parent / "runs"), name=mode,
        exist_ok=True, verbose=False,
    )
    out.write_text(json.dumps(history))


def _compare(plain: Dict[str, Any], other: Dict[str, Any]) -> List[str]:
    """What differs between two runs' batches and losses (empty: nothing)."""
    problems = []
    if len(plain["hashes"]) != len(other["hashes"]):
        problems.append(f"{len(other['hashes'])} epochs against {len(plain['hashes'])}")
    for e, (a, b) in enumerate(zip(plain["hashes"], other["hashes"])):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(f"epoch {e + 1}: batches differ from batch {first} "
                            f"({len(b)} batches against {len(a)})")
    if plain["losses"] != other["losses"]:
        problems.append("loss items differ")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--imgsz", type=int, default=64, help="image size in px (default 64)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--spawn", action="store_true", help="also run the spawn workaround")
    parser.add_argument("--json", type=Path, help="write the runs' figures here")
    parser.add_argument("--keep", type=Path, help="write the dataset and runs here (kept)")
    parser.add_argument("--child", choices=["plain", "fastload", "spawn"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        train_once(args.child, args.data, args, args.out)
        return 0

    modes = ["plain", "fastload"] + (["spawn"] if args.spawn else [])
    child_args = ["--epochs", str(args.epochs), "--imgsz", str(args.imgsz), "--batch",
                  str(args.batch), "--workers", str(args.workers), "--device", args.device]
    with tempfile.TemporaryDirectory(prefix="yolo_fastload_") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        data = make_dataset(root / "dataset", args.images, max(args.imgsz, 32))
        runs = {}
        for mode in modes:
            out = root / f"{mode}.json"
            print(f"--- training with {mode} ...", flush=True)
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", mode, "--data", str(data),
                 "--out", str(out)] + child_args,
                check=True, timeout=3600,
            )
            runs[mode] = json.loads(out.read_text())

    plain = runs["plain"]
    ok = runs["fastload"]["iterator"] == "fastload.iterator.multi_process.FastLoaderIter"
    print()
    for mode, run in runs.items():
        batches = sum(len(h) for h in run["hashes"])
        print(f"{mode:9s} {run['loader']} on {run['iterator']}: {batches} batches, "
              f"training {run['train_s']:.2f} s, epochs {run['epoch_s']} s")
        if mode != "plain":
            problems = _compare(plain, run)
            ok = ok and not problems
            print(f"          against plain: " + ("every batch and loss identical" if not problems
                                                  else "; ".join(problems)))
    print(f"fastload run iterated on fastload: {runs['fastload']['iterator']}")
    for mode in modes[1:]:
        print(f"training time {mode} / plain: {runs[mode]['train_s'] / plain['train_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
