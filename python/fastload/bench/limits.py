"""The limits printed beside the table, measured in the benchmark's own run:
single-thread memcpy bandwidth, a workload's rate in one plain process (one
torch thread, seeded as DataLoader's worker would be), the aggregate rate of
several such processes side by side, and the cost of the loop's own
per-batch work.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any, Dict, List

import torch
from torch.utils.data import default_collate

from .child import _Consumer
from .workloads import Workload


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Single-thread memcpy bandwidth, bytes copied per second (median)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return nbytes / statistics.median(times)
    finally:
        torch.set_num_threads(threads)


class _WorkerLike:
    """In-process, seed ``random``/``torch``/``numpy`` as DataLoader's worker
    ``wid`` would, one torch thread; :meth:`fetch` runs ``dataset[i]`` with
    ``get_worker_info()`` set as there (not around the collate, which would
    then allocate in shared memory). Everything is restored on exit."""

    def __init__(self, base_seed: int, wid: int, workers: int, dataset: Any) -> None:
        from torch.utils.data._utils import worker as tw

        self.tw, self.base_seed, self.wid, self.dataset = tw, base_seed, wid, dataset
        self.info = tw.WorkerInfo(id=wid, num_workers=workers, seed=base_seed + wid, dataset=dataset)

    def __enter__(self) -> "_WorkerLike":
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        self._py = random.getstate()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        seed = self.base_seed + self.wid
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            self._np = np.random.get_state()
            np.random.seed(self.tw._generate_state(self.base_seed, self.wid))
        except ImportError:
            self._np = None
        return self

    def fetch(self, idx: Any) -> List[Any]:
        saved, self.tw._worker_info = self.tw._worker_info, self.info
        try:
            return [self.dataset[i] for i in idx]
        finally:
            self.tw._worker_info = saved

    def __exit__(self, *exc: Any) -> None:
        if self._np is not None:
            import numpy as np

            np.random.set_state(self._np)
        random.setstate(self._py)
        torch.set_num_threads(self._threads)
        self._fork.__exit__(None, None, None)


def raw_rate(w: Workload, cache: str, batch_size: int, seconds: float, seed: int = 0) -> float:
    """Samples/s of ``dataset[i]`` + collate in this process, one thread, as one
    worker would make them."""
    ds, collate = w.make(cache)
    collate = collate or default_collate
    done, k = 0, 0
    with _WorkerLike(seed, 0, 1, ds) as wl:
        collate(wl.fetch(range(batch_size)))  # first touch: lazy opens
        t = time.perf_counter()
        while True:
            collate(wl.fetch(range(k * batch_size, (k + 1) * batch_size)))
            k += 1
            done += batch_size
            el = time.perf_counter() - t
            if el >= seconds and k >= 2:
                return done / el


def _stack_into_ring(slots: int, slot_bytes: int = 16 << 20) -> None:
    """Make this process's default_collate stack tensors into ``slots`` slots
    of a memfd mapping in turn, as a fastload worker stacks into its ring (a
    tensor bigger than a slot is stacked as usual). For measuring children
    only: it changes torch's collate map for the rest of the process."""
    import itertools
    import mmap

    from torch.utils.data._utils import collate as tc

    fd = os.memfd_create("fastload-bench-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, slots * slot_bytes)
        mm = mmap.mmap(fd, slots * slot_bytes)
    finally:
        os.close(fd)
    u8 = torch.frombuffer(mm, dtype=torch.uint8)
    turn = itertools.count()
    plain = tc.collate_tensor_fn

    def stack_into_slot(batch: Any, *, collate_fn_map: Any = None) -> Any:
        elem = batch[0]
        n = elem.element_size() * elem.numel() * len(batch)
        if n > slot_bytes:
            return plain(batch, collate_fn_map=collate_fn_map)
        start = next(turn) % slots * slot_bytes
        out = u8[start : start + n].view(elem.dtype).view((len(batch), *elem.shape))
        return torch.stack(batch, 0, out=out)

    tc.default_collate_fn_map[torch.Tensor] = stack_into_slot


def _side_by_side(spec: Dict[str, Any], batch_size: int, cache: str, seconds: float, seed: int,
                  ready: Any, go: Any, results: Any, into_ring: int = 0) -> None:
    from .workloads import rebuild

    if into_ring:
        _stack_into_ring(into_ring)
    w = rebuild(spec, batch_size)
    ready.put(os.getpid())
    go.wait()
    results.put(raw_rate(w, cache, batch_size, seconds, seed))


def parallel_rate(w: Workload, cache: str, batch_size: int, seconds: float, procs: int,
                  seed: int = 0, timeout: float = 180.0, into_ring: int = 0) -> float:
    """Samples/s summed over ``procs`` plain processes, no loader, each doing
    :func:`raw_rate` at the same time (started together once all have
    imported torch): what the machine allows ``procs`` workers. On a machine
    whose cores slow each other down it is below ``procs`` x ``raw_rate``.
    ``into_ring=N``: each stacks its batches into N shared-memory slots in
    turn, as a fastload worker does, instead of into fresh memory."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    spec = w.spec or {"name": w.name}
    ps = [ctx.Process(target=_side_by_side, daemon=True,
                      args=(spec, batch_size, cache, seconds, seed, ready, go, results, into_ring))
          for _ in range(procs)]
    try:
        for p in ps:
            p.start()

        def collect(q: Any, n: int, limit: float) -> List[Any]:
            got: List[Any] = []
            deadline = time.monotonic() + limit
            while len(got) < n:
                try:
                    got.append(q.get(timeout=0.2))
                except queue.Empty:
                    dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"{w.name}: side-by-side rate: a measuring process "
                                           f"{'exited with ' + str(dead[0]) if dead else 'timed out'}")
            return got

        collect(ready, procs, timeout)
        go.set()
        rates = collect(results, procs, seconds + timeout)
    finally:
        for p in ps:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return float(sum(rates))


def consumer_cost(w: Workload, cache: str, batch_size: int, reps: int = 50) -> float:
    """Microseconds the run loop's own work (index check + checksum) takes on
    one batch of ``w``: what the benchmark adds to every batch of both loaders."""
    ds, collate = w.make(cache)
    with _WorkerLike(0, 0, 1, ds) as wl:
        batch = (collate or default_collate)(wl.fetch(range(batch_size)))
    c = _Consumer()
    times = []
    for _ in range(reps + 1):  # the first call pays one-off costs: dropped by the median
        c.pos = 0
        t = time.perf_counter()
        c.add(batch)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)
