"""The worker process: take a task from the ring, make the batch in its slot.

Runs in a process started by :mod:`fastload.pool` (spawn by default). It
never touches an accelerator: the pool hides them through the environment
before anything here runs. The loop polls the ring with a timeout, so it
notices shutdown and the death of the main process on its own.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from ._ring import RingHandle

ACCELERATOR_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
_POLL_S = 0.5
_OVERFLOW_MSG = struct.Struct("<Q")  # seq of the batch whose overflow fd follows


@dataclass
class WorkerSpec:
    """Everything one worker needs; pickled once per worker by the start method."""

    ring: RingHandle
    sock: socket.socket
    worker_id: int
    num_workers: int
    blob: bytes  # (dataset, collate_fn, worker_init_fn), pickled once for all workers
    base_seed: int
    dataset_kind: int
    auto_collation: bool
    drop_last: bool
    parent_pid: int
    hide_accelerators: bool


def _watch_parent(parent_pid: int) -> None:
    # Exits the worker when the main process is gone even while the loop is
    # busy in dataset code (the loop checks too, between tasks).
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def _describe_indices(index: Any, limit: int = 16) -> str:
    if isinstance(index, (list, tuple)):
        if all(i is None for i in index):
            return ""
        shown = ", ".join(repr(i) for i in index[:limit])
        more = f", ... ({len(index)} in all)" if len(index) > limit else ""
        return f", sample indices [{shown}{more}]"
    if index is None:
        return ""
    return f", sample index {index!r}"


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a worker process."""
    if spec.hide_accelerators:
        for var in ACCELERATOR_ENV:
            os.environ[var] = ""
    # Ctrl-C goes to the whole process group; the main process handles it and
    # shuts the pool down. A worker dying of it would only blur the error.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()

    import torch
    from torch.utils.data import _DatasetKind
    from torch.utils.data._utils import HAS_NUMPY, collate, signal_handling
    from torch.utils.data._utils import worker as torch_worker
    from torch._utils import ExceptionWrapper

    from . import _pickling
    from ._core import WaitResult
    from .serialize import FLAG_OVERFLOW, KIND_DATA, KIND_ERROR, KIND_EXHAUSTED, SlotWriter

    signal_handling._set_worker_signal_handlers()
    torch.set_num_threads(1)
    ring = spec.ring.get()
    wid = spec.worker_id
    ring.worker_started(wid, os.getpid())
    payload = ring.payload_region()
    mv = memoryview(payload).cast("B")
    slot_bytes = ring.slot_bytes
    writer = SlotWriter(payload, slot_bytes)
    where = f"in DataLoader worker process {wid}"

    # The default collate stacks into the slot being written instead of into
    # torch's /dev/shm-backed shared storage (what DataLoader's workers do):
    # that is both the zero-copy path and what keeps a 64 MB /dev/shm out of
    # the picture. Same semantics and errors as torch's collate_tensor_fn.
    torch_collate_tensor = collate.collate_tensor_fn

    def collate_tensor_into_slot(batch: Any, *, collate_fn_map: Any = None) -> Any:
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided or elem.device.type != "cpu":
            return torch_collate_tensor(batch, collate_fn_map=collate_fn_map)
        out = writer.alloc_tensor((len(batch), *elem.shape), elem.dtype)
        return torch.stack(batch, 0, out=out)

    collate.default_collate_fn_map[torch.Tensor] = collate_tensor_into_slot

    init_exception: Optional[Any] = None
    fetcher = None
    dataset = collate_fn = init_fn = None
    try:
        dataset, collate_fn, init_fn = _pickling.loads(spec.blob)
    except Exception:
        init_exception = ExceptionWrapper(where=f"{where} while unpickling the dataset")

    seed = spec.base_seed + wid
    random.seed(seed)
    torch.manual_seed(seed)
    if HAS_NUMPY:
        import numpy as np

        np.random.seed(torch_worker._generate_state(spec.base_seed, wid))
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=wid, num_workers=spec.num_workers, seed=seed, dataset=dataset
    )

    def make_fetcher() -> Any:
        return _DatasetKind.create_fetcher(
            spec.dataset_kind, dataset, spec.auto_collation, collate_fn, spec.drop_last
        )

    if init_exception is None:
        try:
            if init_fn is not None:
                init_fn(wid)
            fetcher = make_fetcher()
        except Exception:
            init_exception = ExceptionWrapper(where=where)

    def commit_error(slot: int, wrapper: Any) -> None:
        try:
            meta = _pickling.dumps_by_value(wrapper, "error")
        except Exception:
            meta = pickle.dumps(
                ExceptionWrapper(
                    (RuntimeError, RuntimeError(wrapper.msg), None), where=wrapper.where
                )
            )
        if len(meta) > slot_bytes:
            short = RuntimeError(wrapper.msg[:4096])
            meta = pickle.dumps(ExceptionWrapper((RuntimeError, short, None), wrapper.where))
        start = slot * slot_bytes
        mv[start : start + len(meta)] = meta
        ring.commit(slot, KIND_ERROR, 0, 0, len(meta))

    epoch = -1
    iteration_end = False
    try:
        while True:
            status, slot, seq, task_len = ring.next_task(wid, _POLL_S)
            if status == WaitResult.TIMED_OUT:
                if os.getppid() != spec.parent_pid:
                    break
                continue
            if status == WaitResult.SHUTDOWN:
                break
            start = slot * slot_bytes
            task_epoch, index = pickle.loads(mv[start : start + task_len])
            if task_epoch != epoch:
                # A new epoch of a persistent pool: DataLoader's _ResumeIteration.
                if epoch >= 0 and init_exception is None:
                    fetcher = make_fetcher()
                epoch = task_epoch
                iteration_end = False
            if iteration_end:
                ring.commit(slot, KIND_EXHAUSTED, 0, 0, 0)
                continue
            if init_exception is not None:
                commit_error(slot, init_exception)
                continue
            writer.begin(slot)
            try:
                data = fetcher.fetch(index)  # type: ignore[union-attr]
            except StopIteration:
                if spec.dataset_kind == _DatasetKind.Iterable:
                    iteration_end = True
                    writer.abort()
                    ring.commit(slot, KIND_EXHAUSTED, 0, 0, 0)
                    continue
                writer.abort()
                commit_error(
                    slot, ExceptionWrapper(where=f"{where} (batch {seq}{_describe_indices(index)})")
                )
                continue
            except Exception:
                writer.abort()
                commit_error(
                    slot, ExceptionWrapper(where=f"{where} (batch {seq}{_describe_indices(index)})")
                )
                continue
            try:
                data_len, meta_off, meta_len, ofd, _ = writer.finish(data)
            except Exception:
                del data
                commit_error(
                    slot,
                    ExceptionWrapper(
                        where=f"{where} while sending batch {seq}{_describe_indices(index)} "
                        "to the main process"
                    ),
                )
                continue
            del data
            kind = KIND_DATA
            if ofd is not None:
                try:
                    socket.send_fds(spec.sock, [_OVERFLOW_MSG.pack(seq)], [ofd])
                finally:
                    os.close(ofd)
                kind |= FLAG_OVERFLOW
            ring.commit(slot, kind, data_len, meta_off, meta_len)
    except KeyboardInterrupt:
        pass
