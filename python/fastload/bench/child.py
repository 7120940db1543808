"""The child process of one run: see :mod:`fastload.bench.measure` for what
it measures; this is the code that runs in it (``python -c``, so spawned
workers import nothing of the bench but the dataset's module)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Sampler

from .checks import batch_indices, checksum
from .memory import MemSampler
from .workloads import BIG, Workload, rebuild


class EpochSampler(Sampler[int]):
    """Indices ``0 .. lengths[e]-1`` in epoch ``e`` (the last length repeats).
    Lives in the main process only; it draws nothing from the generator."""

    def __init__(self, lengths: List[int]) -> None:
        self.lengths = list(lengths)
        self.epoch = -1

    def _len(self, e: int) -> int:
        return self.lengths[min(max(e, 0), len(self.lengths) - 1)]

    def __iter__(self) -> Iterator[int]:
        self.epoch += 1
        return iter(range(self._len(self.epoch)))

    def __len__(self) -> int:
        return self._len(self.epoch)


class _Consumer:
    """The loop's per-batch work: check the indices, fingerprint the batch."""

    def __init__(self) -> None:
        self.pos = 0
        self.batches = 0
        self.bad: Optional[str] = None
        self.sums: List[int] = []

    def add(self, batch: Any) -> None:
        idx = batch_indices(batch)
        n = len(idx)
        if self.bad is None and not (isinstance(idx, torch.Tensor) and
                                     torch.equal(idx, torch.arange(self.pos, self.pos + n))):
            head = idx[:4].tolist() if isinstance(idx, torch.Tensor) else list(idx[:4])
            self.bad = (f"batch {self.batches}: indices {head}... "
                        f"where {self.pos}..{self.pos + n - 1} were due")
        self.sums.append(checksum(batch))
        self.pos += n
        self.batches += 1

    def report(self) -> Dict[str, Any]:
        return {"batches": self.batches, "samples": self.pos, "order_error": self.bad,
                "checksums": self.sums}


def child_main() -> None:
    """Import, build the dataset, wait for the parent's "go" (the previous run
    has fully exited by then), measure, write the result, then tear down."""
    t_main = time.time()  # the interpreter is up and torch imported
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    for p in reversed(spec["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    keep: Dict[str, Any] = {}  # the loader and its iterator, torn down after the result is out
    t_go = None
    try:
        made = _child_prepare(spec)
        sys.stdin.readline()
        t_go = time.time()
        res = _child_run(spec, made, keep)
    except BaseException:
        res = {"error": traceback.format_exc()}
    res.update(t_main=t_main, t_go=t_go, t_done=time.time())
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out + ".tmp", out)
    keep.clear()


def _child_prepare(spec: Dict[str, Any]) -> Tuple[Any, Any, Any, Workload]:
    from torch.utils.data import DataLoader

    from fastload import FastLoader

    w = rebuild(spec["workload"], spec["batch_size"])
    ds, collate = w.make(spec["cache"])
    return (FastLoader if spec["kind"] == "fastload" else DataLoader), ds, collate, w


def descendants_cpu_s(root: int) -> float:
    """CPU seconds (user + system, all threads) used so far by every live
    descendant of ``root``: the workers, and fastload's zygote."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in MemSampler(root).tree()[1:]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tck
        except (OSError, ValueError, IndexError):
            pass
    return total


def _child_run(spec: Dict[str, Any], made: Tuple[Any, Any, Any, Workload],
               keep: Dict[str, Any]) -> Dict[str, Any]:
    """Both epochs of one loader: epoch 1 short and whole, epoch 2 timed."""
    cls, ds, collate, w = made
    bs, workers = spec["batch_size"], spec["workers"]
    n_short = spec["short_batches"] * bs
    if w.length is not None:
        n_short = min(n_short, w.length)
    g = torch.Generator()
    g.manual_seed(spec["seed"])
    res: Dict[str, Any] = {"kind": spec["kind"], "pid": os.getpid()}

    res["t_start"] = time.time()
    t0 = time.perf_counter()
    # num_workers above the core count (the oversubscribed run) is meant:
    # both loaders warn at construction and at each iter()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    loader = keep["loader"] = cls(
        ds, batch_size=bs, sampler=EpochSampler([n_short, BIG]), num_workers=workers,
        collate_fn=collate, multiprocessing_context=spec["start_method"],
        persistent_workers=False, generator=g)
    if spec.get("gap"):  # the script does other work (builds its model) before iterating
        time.sleep(spec["gap"])
        t0 = time.perf_counter()
    it = iter(loader)
    res["base_seed_1"] = it._base_seed
    batch = next(it)
    res["ttfb_cold_s"] = time.perf_counter() - t0
    e1 = _Consumer()
    e1.add(batch)
    del batch
    for batch in it:
        e1.add(batch)
    batch = None
    del it
    res["epoch1"] = e1.report()
    res.update(_epoch2(spec, loader, keep))
    return res


def _epoch2(spec: Dict[str, Any], loader: Any, keep: Dict[str, Any]) -> Dict[str, Any]:
    """The warm first batch, the warm-up, then the steady state, measured."""
    res: Dict[str, Any] = {}
    t0 = time.perf_counter()
    it = keep["it"] = iter(loader)
    res["base_seed_2"] = it._base_seed
    batch = next(it)
    res["ttfb_warm_s"] = time.perf_counter() - t0
    e2 = _Consumer()
    e2.add(batch)
    del batch
    exhausted = False
    t_w = time.perf_counter()
    while time.perf_counter() - t_w < spec["warmup"] or e2.batches < 2 * spec["workers"]:
        batch = next(it, None)
        if batch is None:
            exhausted = True
            break
        e2.add(batch)
    b0, s0 = e2.batches, e2.pos
    t_s, cpu_s, kids_s = time.perf_counter(), time.process_time(), descendants_cpu_s(os.getpid())
    while not exhausted:
        spent = time.perf_counter() - t_s
        if spent >= spec["seconds"] and (e2.batches - b0 >= spec.get("min_batches", 0)
                                         or spent >= spec.get("max_seconds", spec["seconds"])):
            break
        batch = next(it, None)
        if batch is None:
            exhausted = True
            break
        e2.add(batch)
    elapsed, cpu = time.perf_counter() - t_s, time.process_time() - cpu_s
    kids = descendants_cpu_s(os.getpid()) - kids_s
    batch = None
    res["t_end"] = time.time()
    nb, ns = e2.batches - b0, e2.pos - s0
    res["steady"] = {"seconds": elapsed, "batches": nb, "samples": ns, "cpu_s": cpu,
                     "workers_cpu_s": kids, "exhausted": exhausted}
    res["samples_per_s"] = ns / elapsed if nb else None
    res["batches_per_s"] = nb / elapsed if nb else None
    res["main_cpu_ms_per_batch"] = 1000 * cpu / nb if nb else None
    res["workers_cpu_ms_per_batch"] = 1000 * kids / nb if nb else None
    res["epoch2"] = e2.report()
    return res
