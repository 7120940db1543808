"""Short epochs on a GPU: the turnaround at the epoch boundary, many workers, pinned batches.

    python -m fastload.bench.short_epochs [--rounds 2] [--workers 12] [--epoch-batches 16,64]

A training loop whose epochs are short (a validation pass, a small
fine-tuning set, an epoch cut by ``limit_train_batches``) spends a larger
share of its time at the boundary: the pipeline is empty when ``iter()``
starts the next epoch, and every worker starts at once. Each run is a fresh
interpreter that builds one loader with persistent workers, ``pin_memory``
and ``prefetch_factor`` 4 over the ``jpeg`` workload's files (PIL decode, a
random crop resized to 224, uint8), and trains a torchvision ResNet-18 (bf16
autocast, channels-last, SGD) on each batch after ``.to("cuda",
non_blocking=True)``, through ``--epochs`` epochs of ``--epoch-batches``
batches of ``--batch-size``:

* ``DataLoader``: ``torch.utils.data.DataLoader``, its default start method
  (fork on Linux);
* ``fastload``: ``FastLoader``, the same arguments.

Reported per run, from the second epoch on (the first holds the workers'
start): the median epoch's time and images/s, and the time ``iter()`` took
and the first batch's wait after it, per epoch (medians). For fastload, also
what its own ``stats()`` says of the epochs, and the time the main process
spent registering ring slots with the runtime and waiting on device copies
before reusing a slot (both measured by wrapping fastload's own methods).
Runs alternate between the loaders, and the medians of the rounds are
reported with fastload's ratio to DataLoader. Without a GPU (``--device
cpu``) the same loop runs with a small convolution on the CPU and no
pinning, which checks the harness, not the boundary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .fresh import print_and_save, run_fresh

MODES = ("DataLoader", "fastload")


def _model(device: torch.device) -> Callable[[torch.Tensor], None]:
    """One training step on a batch of uint8 images already on ``device``."""
    if device.type == "cuda":
        import torchvision

        net: torch.nn.Module = torchvision.models.resnet18(num_classes=1000)
        net = net.to(device, memory_format=torch.channels_last)
    else:
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=8), torch.nn.Flatten(),
                                  torch.nn.LazyLinear(10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def step(x: torch.Tensor) -> None:
        x = x.float().div_(255)
        if device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class _Timer:
    """Wraps a method of a class to add up its calls' wall time."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        setattr(owner, name, timed)


def run_one(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One run, in this process: the loop the module's docstring describes."""
    from torch.utils.data import DataLoader

    from fastload import FastLoader, stats
    from fastload.bench.workloads import JpegFolder, cache_root, prepare_jpeg

    device = torch.device(spec["device"])
    step = _model(device)
    bs, per_epoch = spec["batch_size"], spec["epoch_batches"]
    ds = JpegFolder(prepare_jpeg(cache_root()), n=bs * per_epoch)
    kw: Dict[str, Any] = dict(batch_size=bs, num_workers=spec["workers"], shuffle=True,
                              persistent_workers=True, prefetch_factor=4,
                              pin_memory=device.type == "cuda")
    timers: Dict[str, _Timer] = {}
    if spec["mode"] == "fastload":
        from fastload.device import pinning

        timers = {"register": _Timer(pinning.PinnedRing, "_register"),
                  "copy_wait": _Timer(pinning.ReleaseGate, "wait_one")}
        loader: Any = FastLoader(ds, **kw)
    else:
        loader = DataLoader(ds, **kw)
    epochs: List[Dict[str, Any]] = []
    seen = 0
    for _e in range(spec["epochs"]):
        before = {k: (t.seconds, t.calls) for k, t in timers.items()}
        t0 = time.perf_counter()
        it = iter(loader)
        t_iter = time.perf_counter()
        first_wait = None
        n = 0
        for x, y in it:
            if first_wait is None:
                first_wait = time.perf_counter() - t_iter
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            step(x)
            seen += int(y.numel())
            n += 1
            del x, y
        if device.type == "cuda":
            torch.cuda.synchronize()  # the epoch's steps done: times are comparable
        wall = time.perf_counter() - t0
        row: Dict[str, Any] = {"s": wall, "iter_s": t_iter - t0, "first_wait_s": first_wait,
                               "batches": n, "images_per_s": n * bs / wall}
        for k, t in timers.items():
            row[f"{k}_s"] = t.seconds - before[k][0]
            row[f"{k}_calls"] = t.calls - before[k][1]
        if spec["mode"] == "fastload":
            st = stats(loader)
            if st is not None:
                row.update(wait_share=st.wait_share, start_s=st.start_s, read_s=st.read_s)
        epochs.append(row)
    del loader
    later = epochs[1:] or epochs
    med = {k: statistics.median(r[k] for r in later)
           for k in later[0] if isinstance(later[0][k], (int, float))}
    return {**spec, "epochs_seen": epochs, "median": med,
            "correct": seen == spec["epochs"] * per_epoch * bs,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def _child(payload: Dict[str, Any]) -> Dict[str, Any]:
    return run_fresh("fastload.bench.short_epochs", payload, "short-epoch")


def measure(rounds: int, workers: int, epoch_batches: List[int], epochs: int,
            batch_size: int, device: str) -> Dict[str, Any]:
    """Interleaved runs of both loaders at each epoch length; medians."""
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {
        str(b): {m: [] for m in MODES} for b in epoch_batches}
    for r in range(rounds):
        for b in epoch_batches:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                got = _child({"mode": mode, "workers": workers, "epoch_batches": b,
                              "epochs": epochs, "batch_size": batch_size, "device": device})
                runs[str(b)][mode].append(got)
                print(f"  {b}-batch epochs, {mode}: epochs "
                      f"{[round(e['s'], 3) for e in got['epochs_seen']]} s", file=sys.stderr,
                      flush=True)
    median = {b: {m: {k: statistics.median(x["median"][k] for x in rs)
                      for k in rs[0]["median"]}
                  for m, rs in by_mode.items()}
              for b, by_mode in runs.items()}
    first = next(iter(next(iter(runs.values())).values()))[0]
    return {"rounds": rounds, "workers": workers, "epochs": epochs, "batch_size": batch_size,
            "device": device, "gpu": first["gpu"], "torch": torch.__version__, "runs": runs,
            "median": median,
            "correct": all(x["correct"] for by in runs.values() for rs in by.values() for x in rs)}


def report_lines(res: Dict[str, Any]) -> str:
    lines = [f"\nShort epochs on {res['gpu']} (torch {res['torch']}): {res['workers']} workers, "
             f"prefetch 4, persistent, batch {res['batch_size']}, {res['epochs']} epochs, "
             f"medians of epochs 2-{res['epochs']} and of {res['rounds']} rounds",
             f"{'epoch':<8}{'loader':<12}{'epoch s':>9}{'img/s':>9}{'iter() s':>10}"
             f"{'1st wait s':>11}{'register s':>11}{'copy wait s':>12}{'vs DataLoader':>15}"]
    for b, by_mode in res["median"].items():
        base = by_mode["DataLoader"]["images_per_s"]
        for k, mode in enumerate(MODES):
            m = by_mode[mode]
            reg = f"{m['register_s']:.4f}" if "register_s" in m else "-"
            cw = f"{m['copy_wait_s']:.4f}" if "copy_wait_s" in m else "-"
            lines.append(f"{(b + ' b') if k == 0 else '':<8}{mode:<12}{m['s']:>9.3f}"
                         f"{m['images_per_s']:>9.0f}{m['iter_s']:>10.4f}{m['first_wait_s']:>11.3f}"
                         f"{reg:>11}{cw:>12}{m['images_per_s'] / base:>14.2f}x")
    lines.append(f"every image delivered: {'yes' if res['correct'] else 'NO'}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--epoch-batches", default="16,64",
                   help="batches per epoch, comma-separated (default 16,64)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(run_one(json.loads(a.child))))
        return 0
    res = measure(a.rounds, a.workers, [int(b) for b in a.epoch_batches.split(",")], a.epochs,
                  a.batch_size, a.device)
    print_and_save(report_lines(res), res, a.json)
    return 0 if res["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
