"""What a loader keeps between its iterators: a warm pool, its lease on the
fork server, and the batch size it learned.

Starting workers costs seconds (a new interpreter importing torch). The
training process pays it once: a loader takes a lease on the process's fork
server at construction (it starts, importing torch, while the script builds
its model) and every pool's zygote is forked from it in milliseconds. A
loader also keeps its pool after an epoch (``reuse_workers``) and the next
iterator starts a new *session* on it: fresh workers forked from the pool's
zygote, which has unpickled the new session's dataset (spawned workers are
kept and sent it), seeded as DataLoader's fresh workers would be. Slots are
sized from the largest batch seen, so a second epoch gets slots that fit.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import statistics
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from .. import _core
from ..debug_views import IteratorView, LoaderView
from ..device.prefetch import CudaStreamOps, StreamOps, resolve_device
from ..launching.zygote import Zygote
from ..launching.fork_server import ServerLease, fork_server, fork_server_pid, lease_fork_server
from ..launching.buffer_copies import SharedBuffers
from ..launching.start_methods import ZYGOTE
from ..stats.meter import EpochMeter
from ..device.pinning import DeviceRuntime, cuda_runtime_or_none
from ..pool.worker_pool import WorkerPool

log = logging.getLogger("fastload")

_MIN_SLOT_BYTES = 1 << 20
_DEFAULT_SLOT_BYTES = 64 << 20  # memfd pages are only committed when written
_DEFAULT_SLOT_BYTES_SHM = 16 << 20  # the shm fallback reserves every page up front


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """fastload's own loader options, checked on construction (see FastLoader)."""

    allow_gpu_in_workers: bool = False
    slot_bytes: Optional[int] = None
    held_batches: int = 4
    reuse_workers: bool = True
    hang_timeout: Optional[float] = 300.0
    max_worker_restarts: int = 0
    device: Optional[torch.device] = None
    auto_workers: bool = False  # num_workers="auto" (see fastload.stats.autoscale)

    def __post_init__(self) -> None:
        slot_bytes, hang_timeout = self.slot_bytes, self.hang_timeout
        max_worker_restarts, held_batches = self.max_worker_restarts, self.held_batches
        if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes <= 0):
            raise ValueError(f"slot_bytes option should be a positive int, but got {slot_bytes!r}")
        if hang_timeout is not None and (
            isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float))
            or not hang_timeout > 0
        ):
            raise ValueError(
                f"hang_timeout option should be a positive number of seconds or None, "
                f"but got {hang_timeout!r}"
            )
        if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, int) \
                or max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts option should be an int >= 0, "
                             f"but got {max_worker_restarts!r}")
        if not isinstance(held_batches, int) or held_batches < 1:
            raise ValueError(f"held_batches option should be an int >= 1, but got {held_batches!r}")
        # frozen: normalise through object.__setattr__
        object.__setattr__(self, "allow_gpu_in_workers", bool(self.allow_gpu_in_workers))
        object.__setattr__(self, "reuse_workers", bool(self.reuse_workers))
        object.__setattr__(self, "device", resolve_device(self.device))


class LoaderState:
    """fastload's state for one loader, kept across its iterators.

    FastLoader makes one in its constructor; ``fastload.install()`` makes one
    for a plain DataLoader when it is first iterated. The iterator reads the
    options from it, gets its pool from it and hands the pool back to it, so
    any DataLoader can run on fastload without new attributes of its own.
    Copies and pickles of a loader carry the options only: worker processes
    are not copied.

    ``make_pool`` makes a new pool from :class:`fastload.pool.worker_pool.WorkerPool`'s
    arguments (tests pass one whose workers they play themselves).
    """

    def __init__(self, options: LoaderOptions,
                 make_pool: Callable[..., WorkerPool] = WorkerPool) -> None:
        self.options = options
        self._make_pool = make_pool
        self.learned_batch_bytes = 0
        self.recent_batch_bytes: Deque[int] = collections.deque(maxlen=64)
        self.idle_pool: Optional[WorkerPool] = None
        self.server_lease: Optional[ServerLease] = None  # see lease_fork_server
        # A zygote forked for this loader's first pool when the loader was
        # built, importing the loader's modules meanwhile (prepare_zygote).
        self.spare_zygote: Optional[Zygote] = None
        self.warned_fork = False  # said that its workers fork from this process
        # Copies of the big arrays and buffers its sessions carry, reused
        # while unchanged (fastload.launching.buffer_copies); freed with it.
        self.buffers = SharedBuffers()
        self.resume: Any = None  # a state from load_state_dict(), to start the next iterator from
        self.live_iterator: Any = None  # weakref to the newest iterator, for state_dict()
        self.meter = EpochMeter()  # its epochs' figures, for stats()
        self.auto_count: Optional[int] = None  # num_workers="auto": the count its last epoch ended with

    def __reduce__(self) -> Tuple[Any, Tuple[LoaderOptions]]:
        return (LoaderState, (self.options,))

    def take_resume(self) -> Optional[dict]:
        """The loaded state the next iterator starts from, once (None: start
        afresh; a state saved between epochs of a loader without persistent
        workers is that too)."""
        saved, self.resume = self.resume, None
        if saved is not None and saved["position"] is None and (
                not saved["persistent_workers"] or saved["workers"] is None):
            return None
        return saved

    def device_runtime(self, device_type: Optional[str]) -> Optional[DeviceRuntime]:
        """The runtime that can register the ring as pinned memory, if any."""
        return cuda_runtime_or_none(device_type)

    def stream_ops(self) -> Optional[StreamOps]:
        """Stream operations for device prefetch; None when there is nothing to do."""
        device = self.options.device
        if device is None or device.type == "cpu":
            return None
        if device.type == "cuda":
            return CudaStreamOps(device)
        from ..device.prefetch import BlockingOps

        return BlockingOps(device)

    def learn(self, batch_bytes: int) -> None:
        """Remember the largest batch seen (later pools get slots that fit
        it) and the recent ones (what a slot keeps, see :meth:`slot_keep`)."""
        if batch_bytes > self.learned_batch_bytes:
            self.learned_batch_bytes = batch_bytes
        self.recent_batch_bytes.append(batch_bytes)

    def slot_keep(self) -> Optional[int]:
        """The bytes a free slot keeps at an epoch's start: twice the median
        of the recent batches (at least 1 MiB); None before any batch."""
        if not self.recent_batch_bytes:
            return None
        return max(2 * statistics.median_low(self.recent_batch_bytes), _MIN_SLOT_BYTES)

    def slot_bytes(self, force_shm: bool) -> int:
        slot_bytes = self.options.slot_bytes
        if slot_bytes is None:
            slot_bytes = _DEFAULT_SLOT_BYTES_SHM if force_shm else _DEFAULT_SLOT_BYTES
            learned = self.learned_batch_bytes * 5 // 4
            if learned > slot_bytes:
                slot_bytes = -(-learned // (1 << 20)) << 20
        return max(int(slot_bytes), _MIN_SLOT_BYTES)

    def pool_for(self, ctx: Any, num_workers: int, prefetch_factor: int, *,
                 persistent: bool, inherited: Optional[tuple],
                 capacity: Optional[int] = None) -> WorkerPool:
        """A pool for a new iterator: the warm one if it fits, else a new one
        (``capacity``: the most workers it may grow to, for
        ``num_workers="auto"``; a warm pool keeps the count it had).

        Slots: one per possible task, one per worker for its session task,
        and the batches the loop may hold.
        """
        opts = self.options
        capacity = num_workers if capacity is None else capacity
        num_slots = capacity * (prefetch_factor + 1) + opts.held_batches
        if num_slots > _core.MAX_SLOTS:
            raise ValueError(
                "num_workers * (prefetch_factor + 1) + held_batches must be at most "
                f"{_core.MAX_SLOTS}, got {num_slots}"
            )
        force_shm = forced_shm()
        hide = not opts.allow_gpu_in_workers
        config = (ctx, capacity, num_slots, self.slot_bytes(force_shm), hide, force_shm)
        if not persistent and inherited is None:
            pool = self._take_idle_pool(config)
            if pool is not None:
                return pool
        zygote, self.spare_zygote = self.spare_zygote, None
        if zygote is not None and (ctx != ZYGOTE or zygote.hide_accelerators != hide):
            zygote.stop()
            zygote = None
        return self._make_pool(ctx=ctx, num_workers=num_workers, num_slots=num_slots,
                               slot_bytes=config[3], hide_accelerators=hide, force_shm=force_shm,
                               zygote=zygote, inherited=inherited, capacity=capacity)

    def prepare_zygote(self, modules: List[str]) -> Optional[Zygote]:
        """Fork the first pool's zygote from the fork server now, without
        waiting (the server may still be importing torch), and have it
        import ``modules`` (those defining the loader's dataset, sampler,
        ``collate_fn`` and ``worker_init_fn``) in the background, so that
        the first ``iter()`` pays for neither. Returns it; the caller stops
        it if the loader goes unused (:func:`release_lease`)."""
        if self.spare_zygote is None:
            hide = not self.options.allow_gpu_in_workers
            try:
                self.spare_zygote = fork_server(hide).fork_zygote(wait=False)
            except (OSError, RuntimeError) as e:  # the first pool forks its own then
                log.debug("fastload: could not fork a zygote ahead: %s", e)
                return None
            self.spare_zygote.warm_imports(modules)
        return self.spare_zygote

    def lease_fork_server(self) -> ServerLease:
        """Keep the fork server running for this loader (started now if it
        is not: it imports torch while the script builds its model, so the
        first epoch's workers fork from a ready one). The caller releases
        the lease when the loader is gone (:func:`release_lease`)."""
        if self.server_lease is None:
            self.server_lease = lease_fork_server(not self.options.allow_gpu_in_workers)
        return self.server_lease

    def _take_idle_pool(self, config: tuple) -> Optional[WorkerPool]:
        pool, self.idle_pool = self.idle_pool, None
        if pool is None:
            return None
        if pool.config == config and pool.alive:
            return pool
        pool.shutdown()
        return None

    def debug_view(self, iterator: Optional[IteratorView]) -> LoaderView:
        """What :func:`fastload.debug.debug_view` shows of a loader with this
        state; ``iterator``: the view of the iterator the loader keeps."""
        lease = self.server_lease
        return LoaderView(
            idle_pool=self.idle_pool.debug_view() if self.idle_pool is not None else None,
            fork_server_pid=(fork_server_pid(not self.options.allow_gpu_in_workers)
                             if lease is not None and lease.held else None),
            iterator=iterator)

    def keep_idle_pool(self, pool: WorkerPool) -> None:
        """An iterator is done with ``pool``: keep it warm if it may be reused."""
        if (self.options.reuse_workers and self.idle_pool is None and pool.alive
                and pool.reusable and pool.ledger.accounted_for()):
            pool.retire()
            self.idle_pool = pool
        else:
            pool.shutdown()


def forced_shm() -> bool:
    """Whether rings go in a ``/dev/shm`` file rather than a memfd
    (``FASTLOAD_SEGMENT=shm``, the fallback where memfd is missing)."""
    return os.environ.get("FASTLOAD_SEGMENT", "") == "shm"


def release_lease(lease: ServerLease, state: Optional["LoaderState"] = None) -> None:
    """A loader is gone: the zygote forked for it, if no pool took it, stops,
    and its lease on the fork server ends."""
    if state is not None:
        zygote, state.spare_zygote = state.spare_zygote, None
        if zygote is not None:
            zygote.stop()
    lease.release()


def loader_modules(*objects: Any) -> List[str]:
    """The modules that define ``objects`` (a loader's dataset, sampler,
    ``collate_fn``, ``worker_init_fn``...) or their classes, where they can
    be imported by name: not the training script's (its objects travel by
    value), not builtins, and not torch or fastload, which the fork server
    has imported already."""
    out: List[str] = []
    for obj in objects:
        if obj is None:
            continue
        for holder in (obj, type(obj)):
            name = getattr(holder, "__module__", None)
            if (isinstance(name, str) and name not in out and not name.startswith("__")
                    and name not in ("builtins", "functools")
                    and name.split(".")[0] not in ("torch", "fastload")):
                out.append(name)
    return out
