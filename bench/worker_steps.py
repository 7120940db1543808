"""What a fastload worker adds to ``dataset[i]`` + collate, step by step, in
one process: each step a worker takes per batch is timed on its own, over a
slot of plain memory, with no other process on the core::

    python bench/worker_steps.py --workload tiny
    python bench/worker_steps.py --workload tokens --batches 500

The steps, in the order a worker runs them (``fastload.worker.loop``):

* ``task``: decode the task the main process sent (the batch's indices);
* ``collate``: ``dataset[i]`` for each index and the default collate, as
  ``DataLoader``'s own collate makes it (the plain cost, the baseline);
* ``collate into slot``: the same, stacked straight into the slot (what a
  worker does);
* ``capture``: the worker's resume state after the batch (its generators);
* ``describe``: the batch's meta written into the slot (pickling it, with
  the tensors described where they lie).

Each figure is the median over ``--repeats`` runs of ``--batches`` batches,
in microseconds per batch. The loader's own figure for the same work, on a
core shared with the main process, is ``stats()``'s make time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
from torch.utils.data import default_collate

from fastload.bench.workloads import WORKLOADS, cache_root
from fastload.common.protocol import decode_task, encode_fetch
from fastload.transport.writer import SlotWriter
from fastload.worker.loop import _stack_into_slots
from fastload.worker.session import Session

SLOT_BYTES = 64 << 20
SLOTS = 4


class _NoSettings:
    """Stands in for the training process's inherited settings, which this
    one process already has."""

    def apply_filters(self) -> None:
        pass


def _timed(step: Callable[[int], Any], batches: int, repeats: int) -> float:
    """Median microseconds per batch of ``step(k)`` over ``repeats`` runs."""
    runs: List[float] = []
    for _ in range(repeats):
        t = time.perf_counter()
        for k in range(batches):
            step(k)
        runs.append((time.perf_counter() - t) / batches * 1e6)
    return statistics.median(runs)


def measure(workload: str, batches: int, repeats: int) -> Dict[str, float]:
    """Microseconds per batch of each step (see the module's docstring)."""
    w = WORKLOADS[workload]
    if w.prepare is not None:
        w.prepare(cache_root())
    ds, collate_fn = w.make(cache_root())
    if collate_fn is not None:
        raise SystemExit(f"{workload}: a workload with its own collate_fn is not timed here")
    bs = w.batch_size
    torch.set_num_threads(1)  # as in a worker
    writer = SlotWriter(bytearray(SLOT_BYTES * SLOTS), SLOT_BYTES)
    _stack_into_slots(writer)  # from here the default collate stacks into the slot, as in a worker
    session = Session(lambda: (_NoSettings(), ds, default_collate, None, 0, True, False),
                      base_seed=0, worker_id=0, num_workers=1,
                      wrap_collate=writer.collating)
    if session.init_exception is not None:
        session.init_exception.reraise()
    fetcher = session.fetcher
    indices = [list(range(k * bs, (k + 1) * bs)) for k in range(batches)]
    tasks = [encode_fetch(1, k, idx) for k, idx in enumerate(indices)]

    def collate(k: int) -> None:
        writer.abort()  # no slot begun: the collate stacks into fresh memory, as DataLoader's does
        default_collate([ds[i] for i in indices[k]])

    def into_slot(k: int) -> None:
        writer.begin(k % SLOTS)
        fetcher.fetch(indices[k])
        writer.abort()

    def with_capture(k: int) -> None:
        writer.begin(k % SLOTS)
        fetcher.fetch(indices[k])
        session.capture()
        writer.abort()

    def whole(k: int) -> None:
        writer.begin(k % SLOTS)
        data = fetcher.fetch(indices[k])
        writer.finish(data, session.capture())

    for step in (collate, into_slot, whole):  # first touches: lazy opens, slot pages
        step(0)
    out = {"task": _timed(lambda k: decode_task(tasks[k]), batches, repeats),
           "collate": _timed(collate, batches, repeats),
           "collate into slot": _timed(into_slot, batches, repeats)}
    captured = _timed(with_capture, batches, repeats)
    out["capture"] = captured - out["collate into slot"]
    out["describe"] = _timed(whole, batches, repeats) - captured
    out["worker in all"] = out["task"] + captured + out["describe"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="tiny", choices=sorted(WORKLOADS))
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    res = measure(a.workload, a.batches, a.repeats)
    print(f"{a.workload}, batch {WORKLOADS[a.workload].batch_size}: us per batch, "
          f"median of {a.repeats} x {a.batches} batches, one process")
    for name, us in res.items():
        print(f"  {name:<18} {us:9.1f}")
    extra = res["worker in all"] - res["collate"]
    print(f"  a worker adds {extra:.1f} us to the plain collate "
          f"({100 * extra / res['collate']:.0f}%)")


if __name__ == "__main__":
    main()
