"""What the benchmark measures and how.

One *run* is one loader (fastload or DataLoader) in a fresh child process
(``python -c``, so a spawned worker imports nothing of the bench but the
dataset's module), two epochs of the same loader, ``persistent_workers=False``:

* epoch 1, short (``4 x workers`` batches, ``2 x`` with ``--quick``), read to its end: the COLD time to
  first batch (loader construction to first batch, in a process that has
  never started a worker) and a full-epoch check: every index exactly once,
  in order, and each batch's checksum equal to the in-process reference.
* epoch 2, long: the WARM time to first batch (``iter()`` to first batch;
  DataLoader spawns its workers again, fastload reuses its pool), a warm-up
  (``--warmup`` seconds and at least ``2 x workers`` batches), then
  ``--seconds`` of steady state (longer, up to 5 x, until it holds 40
  batches; 10 with ``--quick``): samples/s, batches/s and the main process's
  CPU time per batch (``time.process_time``, all threads of the main
  process), and the same checks on every batch read.

Runs never overlap: the next run's process is started (interpreter, torch,
dataset) once this run has written its result, but told to go only when this
run's process and all its workers are gone (:mod:`.runner`, which also starts
the busy neighbours of the loaded runs). The child's code is
:mod:`fastload.bench.child`.

The consumer loop does the same cheap work for both loaders: it checks the
batch's indices (``batch["y"]`` for dicts, else ``batch[-1]``) against the
expected range and computes :func:`fastload.bench.checks.checksum`.

Peak memory (:mod:`.memory`): the PSS total of the child and all its
descendants between loader construction and the end of the steady state;
RSS where the kernel has no smaps_rollup.

The limits printed with the table are in :mod:`.limits`; this module keeps
the in-process reference checksums and the machine's description, and
re-exports what the command line uses from the modules above.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.utils.data import default_collate

from .checks import checksum, slice_sample
from .limits import _WorkerLike, consumer_cost, memcpy_bandwidth, parallel_rate, raw_rate
from .memory import MemSampler
from .runner import Child, Neighbours, run_children
from .workloads import Workload

__all__ = ["Child", "MemSampler", "Neighbours", "base_seeds", "consumer_cost", "machine_info",
           "memcpy_bandwidth", "parallel_rate", "raw_rate", "reference", "run_children", "timed"]


def base_seeds(seed: int, epochs: int) -> List[int]:
    """The ``base_seed`` DataLoader draws from ``generator`` at each ``iter()``."""
    g = torch.Generator()
    g.manual_seed(seed)
    return [int(torch.empty((), dtype=torch.int64).random_(generator=g).item()) for _ in range(epochs)]


def _big(sample: Any) -> bool:
    """Whether a sample holds a tensor large enough that collating only the
    checksummed elements (:func:`slice_sample`) beats collating it whole."""
    if isinstance(sample, dict):
        return any(_big(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return any(_big(v) for v in sample)
    return isinstance(sample, torch.Tensor) and sample.numel() > 16384


def reference(w: Workload, cache: str, base_seed: int, workers: int, batch_size: int,
              epoch_len: int, n_batches: int) -> List[int]:
    """Checksums of batches ``0 .. n_batches-1`` of an epoch of ``epoch_len``
    samples, made in-process by replaying each worker: batch ``b`` is made by
    worker ``b % workers``, whose RNGs were seeded with ``base_seed + worker``.
    With the default collate and large samples only the elements the checksum
    reads are collated (:func:`slice_sample`)."""
    ds, collate = w.make(cache)
    n_batches = min(n_batches, -(-epoch_len // batch_size))
    out: List[int] = [0] * n_batches
    for wid in range(workers):
        with _WorkerLike(base_seed, wid, workers, ds) as wl:
            for b in range(wid, n_batches, workers):
                samples = wl.fetch(range(b * batch_size, min((b + 1) * batch_size, epoch_len)))
                if collate is None and _big(samples[0]):
                    out[b] = checksum(default_collate([slice_sample(s) for s in samples]), sliced=True)
                else:
                    out[b] = checksum((collate or default_collate)(samples))
    return out


def _decoder() -> str:
    """The JPEG decoder Pillow uses here (``jpeg`` figures depend on it)."""
    try:
        import PIL
        from PIL import features
    except ImportError:
        return "none (Pillow not installed)"
    turbo = features.check_feature("libjpeg_turbo")
    ver = features.version_feature("libjpeg_turbo") if turbo else features.version("jpg")
    simd = "post" in PIL.__version__  # pillow-simd versions read like 9.0.0.post1
    return (f"{'pillow-simd' if simd else 'Pillow'} {PIL.__version__}, "
            f"{'libjpeg-turbo' if turbo else 'libjpeg'} {ver}")


def machine_info() -> Dict[str, Any]:
    """The machine, the software and the load average, for the report."""
    import platform

    info: Dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "loadavg_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[1:2] and ln.split()[1].isdigit()}
        info["mem_total_gib"] = round(kb["MemTotal"] / 2**20, 1)
        info["mem_available_gib"] = round(kb["MemAvailable"] / 2**20, 1)
    except (OSError, KeyError):
        pass
    info["decoder"] = _decoder()
    try:
        import fastload

        info["fastload"] = fastload.__version__
    except ImportError:
        pass
    return info


def timed(fn: Callable[[], Any]) -> Tuple[Any, float]:
    """``fn()`` and the seconds it took."""
    t = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t
