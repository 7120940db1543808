"""What a loader keeps for its iterators: :class:`LoaderRuntime`.

A ``FastLoader`` (or a DataLoader under ``fastload.install()``) has one;
each of its iterators reads the options from it, takes its pool from the
runtime's :class:`~fastload.pool.keeper.PoolKeeper` and gives it back
there, reports to its meter, and picks up the state ``load_state_dict()``
left for it. It is not the loader's ``state_dict()``: that is
:mod:`fastload.resume`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch

from ..common.debug_views import IteratorView, LoaderView
from ..device.pinning import DeviceRuntime, cuda_runtime_or_none
from ..device.prefetch import BlockingOps, CudaStreamOps, StreamOps, resolve_device
from ..pool.keeper import PoolKeeper
from ..pool.worker_pool import WorkerPool
from ..stats.meter import EpochMeter


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

    @property
    def hide_accelerators(self) -> bool:
        """Whether workers run with accelerators hidden (the default)."""
        return not self.allow_gpu_in_workers


class LoaderRuntime:
    """fastload's runtime for one loader, kept across its iterators.

    ``options``: the loader's options; ``pools``: its pools between
    iterators (warm pool, fork-server lease, slot sizes); ``meter``: its
    epochs' figures, for ``stats()``; ``resume``: a state from
    ``load_state_dict()`` for the next iterator; ``live_iterator``: a
    weakref to the newest iterator, for ``state_dict()``; ``auto_count``:
    under ``num_workers="auto"``, the count its last epoch ended with.
    Copies and pickles of a loader carry the options only: worker processes
    are not copied.

    ``make_pool`` makes a new pool from :class:`WorkerPool`'s arguments
    (tests pass one whose workers they play themselves).
    """

    def __init__(self, options: LoaderOptions,
                 make_pool: Callable[..., WorkerPool] = WorkerPool) -> None:
        self.options = options
        self.pools = PoolKeeper(make_pool)
        self.meter = EpochMeter()
        self.resume: Any = None
        self.live_iterator: Any = None
        self.auto_count: Optional[int] = None

    def __reduce__(self) -> Tuple[Any, Tuple[LoaderOptions]]:
        return (LoaderRuntime, (self.options,))

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
        return BlockingOps(device)

    def slot_bytes(self, force_shm: bool) -> int:
        """A new pool's slot size under this loader's options."""
        return self.pools.slot_bytes(self.options.slot_bytes, force_shm)

    def pool_for(self, ctx: Any, num_workers: int, prefetch_factor: int, *, persistent: bool,
                 inherited: Optional[tuple], capacity: Optional[int] = None) -> WorkerPool:
        """A pool for a new iterator under this loader's options (see
        :meth:`PoolKeeper.pool_for`)."""
        opts = self.options
        return self.pools.pool_for(
            ctx, num_workers, prefetch_factor, held_batches=opts.held_batches,
            slot_bytes=opts.slot_bytes, hide_accelerators=opts.hide_accelerators,
            persistent=persistent, inherited=inherited, capacity=capacity)

    def keep_idle_pool(self, pool: WorkerPool) -> None:
        """An iterator is done with ``pool``: warm for the next, if allowed."""
        self.pools.keep_idle_pool(pool, self.options.reuse_workers)

    def debug_view(self, iterator: Optional[IteratorView]) -> LoaderView:
        """What :func:`fastload.debug.debug_view` shows of a loader with this
        runtime; ``iterator``: the view of the iterator the loader keeps."""
        return LoaderView(idle_pool=self.pools.idle_pool_view(),
                          fork_server_pid=self.pools.fork_server_pid(
                              self.options.hide_accelerators),
                          iterator=iterator)


def loader_modules(*objects: Any) -> list:
    """The modules that define ``objects`` (a loader's dataset, sampler,
    ``collate_fn``, ``worker_init_fn``...) or their classes, where they can
    be imported by name: not the training script's (its objects travel by
    value), not builtins, and not torch or fastload, which the fork server
    has imported already."""
    out: list = []
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
