"""Host to device: batches from fastload's pinned ring against DataLoader's pin thread.

    python -m fastload.bench.h2d [--rounds 3] [--workers 8] [--step-ms 0,5]

(also part of ``python -m fastload.bench`` when a CUDA or ROCm device is
present). Each run is a fresh interpreter that puts a matrix product on the
GPU (the model's step), builds one loader and trains through ``--batches``
batches of ``--batch-size`` float32 images of ``--shape`` (3x224x224: 38.5 MB
a batch of 64), the first ``--warmup`` of them left out of the figures:

* ``DataLoader``: ``torch.utils.data.DataLoader(pin_memory=True)``, its
  default start method; each batch ``.to("cuda", non_blocking=True)``;
* ``fastload``: ``FastLoader(pin_memory=True)``, the same loop: the batch is
  a view of a ring slot registered with the runtime, so the copy is a DMA
  from the ring;
* ``fastload device``: ``FastLoader(device="cuda")``: the loader copies each
  batch on a side stream one batch ahead and hands out device tensors.

Each step records CUDA events on the training stream: as the host reaches
the step, after the copy, after the model's step. From them:

* **GPU waits ms/step**: the time the stream spends on anything but the
  model's step, per step: idle while the host fetches the next batch, plus
  the copy queued on it (zero for ``fastload device``, whose copies run on
  their own stream unless the step has to wait for one);
* **copy GB/s**: the batch's bytes over the copy's time on the stream (not
  measured for ``fastload device``);
* **delivered GB/s** and batches/s: bytes that reached the GPU over wall time;
* **main CPU ms/batch**: the main process's CPU time (every thread: the
  training loop, DataLoader's pin thread, the runtime's threads) per batch.

Every batch is checked on the GPU: sample ``i`` is filled with ``i`` and its
label is ``i``, and every index must arrive once, in order. Runs alternate
between the loaders (A B C, then C B A, ...), and the medians of the rounds
are reported, with ratios to DataLoader. A last child measures the limits:
one batch copied to the device from pinned and from pageable memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

from .fresh import print_and_save, run_fresh

MODES = ("DataLoader", "fastload", "fastload device")


class Frames(Dataset):
    """Sample ``i``: a float32 image of ``shape`` filled with ``i``, and ``i``."""

    def __init__(self, n: int, shape: Sequence[int]) -> None:
        self.n, self.shape = n, tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        return torch.full(self.shape, float(i)), i


@functools.lru_cache(maxsize=None)
def cuda_present() -> bool:
    """Whether a CUDA or ROCm device is there, asked once in a child process
    so that the caller's process does not initialise the runtime."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _model_step(step_ms: float, dev: torch.device) -> Tuple[Callable[[], None], float]:
    """A function queuing about ``step_ms`` of GPU work (bf16 matrix products),
    and the milliseconds it takes."""
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        torch.mm(a, a, out=c)
    start.record()
    for _ in range(20):
        torch.mm(a, a, out=c)
    end.record()
    end.synchronize()
    one_ms = start.elapsed_time(end) / 20
    reps = round(step_ms / one_ms)

    def step() -> None:
        for _ in range(reps):
            torch.mm(a, a, out=c)
    return step, one_ms * reps


def run_one(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One run, in this process: the loop described in the module's docstring."""
    from torch.utils.data import DataLoader

    from fastload import FastLoader

    dev = torch.device("cuda")
    step, step_ms = _model_step(spec["step_ms"], dev)
    n, warm, bs = spec["batches"], spec["warmup"], spec["batch_size"]
    ds = Frames(n * bs, spec["shape"])
    kw: Dict[str, Any] = dict(batch_size=bs, num_workers=spec["workers"])
    mode = spec["mode"]
    if mode == "DataLoader":
        loader: Any = DataLoader(ds, pin_memory=True, **kw)
    elif mode == "fastload":
        loader = FastLoader(ds, pin_memory=True, **kw)
    else:
        loader = FastLoader(ds, device=dev, **kw)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    labels: List[torch.Tensor] = []
    pinned: List[bool] = []
    t0 = c0 = 0.0
    for i, (x, y) in enumerate(loader):
        if i == warm:
            t0, c0 = time.perf_counter(), time.process_time()
        reached, copied, done = events[i]
        if mode != "fastload device":
            pinned.append(x.is_pinned())
        reached.record()
        if mode != "fastload device":
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        copied.record()
        step()
        bad += (x[:, 0, 0, 0] != y).sum() + (x[:, -1, -1, -1] != y).sum()
        labels.append(y)
        done.record()
        del x, y
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = n - warm
    idle = [events[i - 1][2].elapsed_time(events[i][0]) for i in range(warm + 1, n)]
    copy = [events[i][0].elapsed_time(events[i][1]) for i in range(warm + 1, n)]
    got = torch.cat(labels).cpu()
    batch_bytes = bs * math.prod(spec["shape"]) * 4 + bs * 8
    return {
        **spec,
        "model_step_ms": step_ms,
        "batches_per_s": steps / wall,
        "delivered_gb_per_s": steps * batch_bytes / wall / 1e9,
        "main_cpu_ms_per_batch": cpu / steps * 1e3,
        "gpu_idle_ms_per_step": sum(idle) / len(idle),
        "copy_ms_per_step": sum(copy) / len(copy),
        "gpu_wait_ms_per_step": (sum(idle) + sum(copy)) / len(idle),
        "copy_gb_per_s": (None if mode == "fastload device"
                          else batch_bytes / (statistics.median(copy) / 1e3) / 1e9),
        "all_pinned": all(pinned) if pinned else None,
        "correct": bool(bad.item() == 0 and torch.equal(got, torch.arange(n * bs))),
    }


def limits(shape: Sequence[int], batch_size: int) -> Dict[str, Any]:
    """Copies of one batch to the device, from pinned and from pageable memory."""
    dev = torch.device("cuda")
    numel = batch_size * math.prod(shape)
    out: Dict[str, Any] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    dst = torch.empty(numel, device=dev)
    for name, src in (("pinned_gb_per_s", torch.ones(numel).pin_memory()),
                      ("pageable_gb_per_s", torch.ones(numel))):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dst.copy_(src, non_blocking=True)
        start.record()
        for _ in range(20):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = 20 * numel * 4 / (start.elapsed_time(end) / 1e3) / 1e9
    return out


def _child(payload: Dict[str, Any]) -> Dict[str, Any]:
    return run_fresh("fastload.bench.h2d", payload, "host-to-device")


def measure_h2d(rounds: int = 3, workers: int = 8, steps_ms: Sequence[float] = (0.0, 5.0),
                batch_size: int = 64, shape: Sequence[int] = (3, 224, 224),
                batches: int = 300, warmup: int = 30) -> Dict[str, Any]:
    """Interleaved runs of every loader at every model step; medians."""
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {
        str(s): {m: [] for m in MODES} for s in steps_ms}
    for r in range(rounds):
        for s in steps_ms:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                runs[str(s)][mode].append(_child({
                    "mode": mode, "step_ms": s, "workers": workers, "batch_size": batch_size,
                    "shape": list(shape), "batches": batches, "warmup": warmup}))
    keys = ("batches_per_s", "delivered_gb_per_s", "main_cpu_ms_per_batch",
            "gpu_wait_ms_per_step", "gpu_idle_ms_per_step", "copy_ms_per_step", "copy_gb_per_s",
            "model_step_ms")
    median = {s: {m: {k: (statistics.median(x[k] for x in rs) if rs[0][k] is not None else None)
                      for k in keys}
                  for m, rs in by_mode.items()}
              for s, by_mode in runs.items()}
    return {"rounds": rounds, "workers": workers, "batch_size": batch_size, "shape": list(shape),
            "batches": batches, "warmup": warmup, "limits": _child({"limits": True,
                                                                     "shape": list(shape),
                                                                     "batch_size": batch_size}),
            "runs": runs, "median": median,
            "correct": {m: all(x["correct"] for by in runs.values() for x in by[m]) for m in MODES},
            "pinned": {m: all(x["all_pinned"] is not False for by in runs.values() for x in by[m])
                       for m in MODES}}


def report_lines(res: Dict[str, Any]) -> str:
    """The host-to-device table."""
    lim = res["limits"]
    mb = res["batch_size"] * math.prod(res["shape"]) * 4 / 1e6
    lines = [f"\nHost to device on {lim['gpu']} (torch {lim['torch']}): {res['batch_size']} float32 "
             f"{'x'.join(map(str, res['shape']))} images a batch ({mb:.1f} MB), "
             f"{res['workers']} workers, medians of {res['rounds']} rounds",
             f"one batch copied to the device: {lim['pinned_gb_per_s']:.1f} GB/s from pinned "
             f"memory, {lim['pageable_gb_per_s']:.1f} GB/s from pageable",
             f"{'model step':<12}{'loader':<17}{'batches/s':>10}{'delivered GB/s':>15}"
             f"{'copy GB/s':>10}{'main CPU ms/batch':>18}{'GPU waits ms/step':>18}"
             f"{'vs DataLoader':>14}  correct"]
    for s, by_mode in res["median"].items():
        base = by_mode["DataLoader"]["batches_per_s"]
        for k, mode in enumerate(MODES):
            m = by_mode[mode]
            copy = "-" if m["copy_gb_per_s"] is None else f"{m['copy_gb_per_s']:.1f}"
            label = f"{m['model_step_ms']:.1f} ms" if k == 0 else ""
            lines.append(f"{label:<12}{mode:<17}{m['batches_per_s']:>10.1f}"
                         f"{m['delivered_gb_per_s']:>15.1f}{copy:>10}"
                         f"{m['main_cpu_ms_per_batch']:>18.2f}{m['gpu_wait_ms_per_step']:>18.2f}"
                         f"{m['batches_per_s'] / base:>13.2f}x  "
                         f"{'yes' if res['correct'][mode] else 'NO'}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--step-ms", default="0,5",
                   help="the model's step on the GPU, ms, comma-separated (default 0,5)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shape", default="3,224,224", help="one sample's shape (default 3,224,224)")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="first batches left out (default 30)")
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        spec = json.loads(a.child)
        got = limits(spec["shape"], spec["batch_size"]) if spec.get("limits") else run_one(spec)
        print(json.dumps(got))
        return 0
    if not cuda_present():
        print("no CUDA or ROCm device: nothing to measure", file=sys.stderr)
        return 2
    res = measure_h2d(a.rounds, a.workers, [float(s) for s in a.step_ms.split(",")],
                      a.batch_size, [int(d) for d in a.shape.split(",")], a.batches, a.warmup)
    print_and_save(report_lines(res), res, a.json)
    return 0 if all(res["correct"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
