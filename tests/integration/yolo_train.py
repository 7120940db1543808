"""Ultralytics YOLO trained with DataLoader, then under ``fastload.install()``: same losses?

Not a pytest test (it needs ``ultralytics``, hence torchvision built for your
torch, and takes minutes); run it by hand:

    pip install ultralytics
    python tests/integration/yolo_train.py [--epochs 2] [--images 16] [--keep DIR]

It writes a small synthetic detection dataset in YOLO format (images with one
filled rectangle each, its box as the label, and a data yaml), then trains
``yolov8n.yaml`` (built from the yaml: no weights are downloaded) on it twice,
each in a fresh process with the same seed, ``workers=2``, ``device="cpu"``,
``deterministic=True``:

1. plain: Ultralytics' own ``InfiniteDataLoader`` (a DataLoader subclass);
2. fastload: the same, after ``fastload.install()``, so that loader iterates
   on fastload (the same as running the child under ``python -m fastload run``).

It prints both loss histories (every batch's loss items), whether they are
identical, the class of the iterator each run trained on, and each epoch's
time. Exit status 0 only if the histories are identical and the second run
did iterate on fastload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEED = 0


def make_dataset(root: Path, images: int) -> Path:
    """``images`` 64x64 images, each with one filled rectangle (class 0) on
    noise, labels in YOLO format (class cx cy w h, normalised); returns the
    data yaml. Training and validation use the same images."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(SEED)
    image_dir, label_dir = root / "images" / "train", root / "labels" / "train"
    image_dir.mkdir(parents=True)
    label_dir.mkdir(parents=True)
    size = 64
    for n in range(images):
        pixels = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
        w, h = rng.integers(12, 40, 2)
        x0, y0 = rng.integers(0, size - w), rng.integers(0, size - h)
        pixels[y0:y0 + h, x0:x0 + w] = rng.integers(150, 255, 3, dtype=np.uint8)
        Image.fromarray(pixels).save(image_dir / f"{n:03d}.png")
        cx, cy = (x0 + w / 2) / size, (y0 + h / 2) / size
        (label_dir / f"{n:03d}.txt").write_text(f"0 {cx:.6f} {cy:.6f} {w / size:.6f} {h / size:.6f}\n")
    data = root / "data.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames:\n  0: box\n")
    return data


def _floats(items) -> list:
    """Loss items as plain floats (a tensor in older Ultralytics, a dict of them in newer)."""
    if isinstance(items, dict):
        return [float(v) for v in items.values()]
    return [float(v) for v in items.flatten().tolist()]


def train_once(loader: str, data: Path, epochs: int, out: Path) -> None:
    """One training run in this process; writes its history to ``out`` as JSON."""
    if loader == "fastload":
        import fastload

        fastload.install()
    from ultralytics import YOLO

    history = {"losses": [], "epoch_s": [], "iterator": None, "loader": None}
    started = {}

    def on_train_start(trainer):
        it = trainer.train_loader.iterator
        history["loader"] = type(trainer.train_loader).__qualname__
        history["iterator"] = f"{type(it).__module__}.{type(it).__qualname__}"

    def on_train_epoch_start(trainer):
        history["losses"].append([])
        started["t"] = time.perf_counter()

    def on_train_batch_end(trainer):
        history["losses"][-1].append(_floats(trainer.loss_items))

    def on_train_epoch_end(trainer):
        history["epoch_s"].append(round(time.perf_counter() - started["t"], 2))

    model = YOLO("yolov8n.yaml")
    for event, callback in [("on_train_start", on_train_start),
                            ("on_train_epoch_start", on_train_epoch_start),
                            ("on_train_batch_end", on_train_batch_end),
                            ("on_train_epoch_end", on_train_epoch_end)]:
        model.add_callback(event, callback)
    model.train(
        data=str(data), epochs=epochs, imgsz=64, batch=4, workers=2, device="cpu",
        seed=SEED, deterministic=True, amp=False, plots=False, val=False, close_mosaic=0,
        project=str(out.parent / "runs"), name=loader, exist_ok=True, verbose=False,
    )
    out.write_text(json.dumps(history))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--keep", type=Path, help="write the dataset and runs here (kept)")
    parser.add_argument("--child", choices=["plain", "fastload"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        train_once(args.child, args.data, args.epochs, args.out)
        return 0

    with tempfile.TemporaryDirectory(prefix="yolo_fastload_") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        data = make_dataset(root / "dataset", args.images)
        runs = {}
        for loader in ("plain", "fastload"):
            out = root / f"{loader}.json"
            print(f"--- training with {loader} ...", flush=True)
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", loader, "--data", str(data),
                 "--epochs", str(args.epochs), "--out", str(out)],
                check=True, timeout=3600,
            )
            runs[loader] = json.loads(out.read_text())

    plain, fast = runs["plain"], runs["fastload"]
    identical = plain["losses"] == fast["losses"]
    on_fastload = fast["iterator"] == "fastload.iterator.FastLoaderIter"
    for loader, run in runs.items():
        print(f"\n{loader}: {run['loader']} iterating on {run['iterator']}")
        for epoch, (losses, seconds) in enumerate(zip(run["losses"], run["epoch_s"])):
            print(f"  epoch {epoch + 1}: {seconds:.2f} s, loss items per batch:")
            for items in losses:
                print("    " + "  ".join(f"{v:.6f}" for v in items))
    print(f"\nloss histories identical: {identical}")
    print(f"fastload run iterated on fastload: {on_fastload}")
    print(f"epoch times, plain: {plain['epoch_s']} s; fastload: {fast['epoch_s']} s")
    return 0 if identical and on_fastload else 1


if __name__ == "__main__":
    sys.exit(main())
