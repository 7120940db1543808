"""A read-only look inside a loader or its iterator, for tests and diagnostics.

``debug_view(obj)`` returns a snapshot of fastload's state behind a loader
or an iterator: worker pids, the zygote, the ring, the warm pool kept
between epochs, the options the iterator runs with. It is what fastload's
own tests check, and what to print when a loader misbehaves::

    from fastload.debug import debug_view
    it = iter(loader)
    print(debug_view(it))          # IteratorView(num_workers=2, pool=PoolView(...), ...)
    debug_view(loader).idle_pool   # the warm pool kept after an epoch, or None

Not part of the DataLoader API: the fields follow fastload's internals and
may change between versions. A view is taken when ``debug_view`` is called
(call it again to see later changes) and holds no reference to the loader,
the iterator or their pool, so keeping one never keeps workers alive. It
changes nothing: nothing in it starts, stops or signals a process.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple, overload

from torch.utils.data import DataLoader

from . import _core
from .iterator import FastLoaderIter
from .launching.lineage import fork_server_pid as running_server_pid
from .loader import STATE_ATTR
from .pool import WorkerPool

__all__ = ["debug_view", "IteratorView", "LoaderView", "PoolView", "RingView"]


class RingView:
    """Read-only accessors of a pool's shared-memory ring.

    Two views are equal when they show the same ring (the same memory), so a
    test can check that an epoch reused the ring of the one before.
    """

    __slots__ = ("_ring",)

    def __init__(self, ring: "_core.Ring") -> None:
        self._ring = ring

    @property
    def fd(self) -> int:
        """The segment's file descriptor in this process (``os.fstat`` it for its blocks)."""
        return self._ring.fd

    @property
    def num_slots(self) -> int:
        return self._ring.num_slots

    @property
    def slot_bytes(self) -> int:
        return self._ring.slot_bytes

    @property
    def backend(self) -> str:
        """``"memfd"`` or ``"posix_shm"``."""
        return self._ring.backend

    def payload_span(self) -> Tuple[int, int]:
        """``(address, length)`` of the slots' payloads in this process: a
        batch viewing the ring has its ``data_ptr()`` in there."""
        region = self._ring.payload_region()
        return region.address, len(region)

    def worker_pid(self, worker: int) -> int:
        """The pid worker ``worker`` wrote into the ring once it attached (0 before)."""
        return self._ring.worker_pid(worker)

    def worker_current_seq(self, worker: int) -> Optional[int]:
        """The task worker ``worker`` has in hand, as the ring records it, or None."""
        return self._ring.worker_current_seq(worker)

    def dead_workers(self) -> List[int]:
        """Workers whose death the ring's death watch saw and that were not
        replaced or retired since (a wait answers WORKER_DIED meanwhile)."""
        return self._ring.dead_workers()

    def rescan_count(self) -> int:
        """How many times the main process read every slot instead of the
        completion queue (after deaths, timed-out waits, lost entries)."""
        return self._ring.rescan_count()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RingView) and other._ring is self._ring

    def __hash__(self) -> int:
        return id(self._ring)

    def __repr__(self) -> str:
        return (f"RingView(fd={self.fd}, num_slots={self.num_slots}, "
                f"slot_bytes={self.slot_bytes}, backend={self.backend!r})")


@dataclasses.dataclass(frozen=True)
class PoolView:
    """A worker pool: its processes, the zygote they fork from, its ring."""

    pids: Tuple[int, ...]
    """The worker processes' pids, worker 0 first."""
    processes: Tuple[Any, ...] = dataclasses.field(repr=False)
    """The worker process handles (``multiprocessing`` processes, or fastload's
    zygote children): for their ``pid`` and ``exitcode``."""
    zygote_pid: Optional[int]
    """The zygote the workers are forked from; None under ``spawn``, ``fork``
    or ``forkserver``, or once it is gone."""
    ring: RingView
    pinned: bool
    """Batches are pinned for device copies (the ring is registered, or copies are pinned)."""
    pin_failed: Optional[str]
    """Why registering the ring as pinned memory failed (batches are then copied), or None."""
    pinned_bytes: int
    """Bytes of the ring registered as pinned memory."""
    zygote_pids: Tuple[int, ...]
    """Every zygote this pool has started, oldest first (one is replaced when
    it dies, gets stuck unpickling a session, or was left running a thread);
    the last is ``zygote_pid``'s, while it runs."""
    preloaded: bool
    """The current session (the pickled dataset) was unpickled once by the
    zygote, so workers forked after that share its pages."""
    inherited: Tuple[bool, ...]
    """Per worker: it was forked from the zygote holding the current session,
    so it did not unpickle the dataset itself."""


@dataclasses.dataclass(frozen=True)
class IteratorView:
    """A fastload iterator (with workers): its pool and the options it runs with."""

    num_workers: int
    pool: Optional[PoolView]
    """None once the iterator has stopped its workers or handed them back to the loader."""
    ring: RingView
    """The ring its batches come from (kept after the pool is handed back)."""
    shut_down: bool
    """The iterator is done with its workers (stopped them, or gave them back warm)."""
    hang_timeout: Optional[float]
    held_batches: int
    restarts_left: int
    """Worker restarts it may still do (``max_worker_restarts`` less those done)."""
    base_seed: int

    @property
    def worker_pids(self) -> Tuple[int, ...]:
        """``pool.pids``, or ``()`` once the iterator has no pool."""
        return self.pool.pids if self.pool is not None else ()


@dataclasses.dataclass(frozen=True)
class LoaderView:
    """What a loader keeps across its iterators."""

    idle_pool: Optional[PoolView]
    """The warm pool kept between epochs (``reuse_workers``), or None."""
    fork_server_pid: Optional[int]
    """The fork server this loader keeps running (its pools' zygotes are
    forked from it), or None: the loader holds no lease on one (an explicit
    start method, ``num_workers=0``, or a DataLoader not yet iterated under
    ``fastload.install()``)."""
    iterator: Optional[IteratorView]
    """The iterator the loader keeps (``persistent_workers=True``), or None."""


def _pool_view(pool: WorkerPool) -> PoolView:
    pinner = pool.pinner
    lineage = pool.lineage
    zygote = lineage.current if lineage is not None else None
    return PoolView(
        pids=pool.pids,
        processes=tuple(pool.procs),
        zygote_pid=zygote.pid if zygote is not None else None,
        ring=RingView(pool.ring),
        pinned=pinner is not None,
        pin_failed=pinner.failed if pinner is not None else None,
        pinned_bytes=pinner.registered_bytes() if pinner is not None else 0,
        zygote_pids=tuple(z.launched_pid for z in lineage.zygotes) if lineage is not None else (),
        preloaded=lineage is not None and lineage.preloaded is not None,
        inherited=tuple(lineage is not None and lineage.inherits(w) for w in range(pool.num_workers)),
    )


def _iterator_view(it: FastLoaderIter) -> IteratorView:
    pool = it._pool
    return IteratorView(
        num_workers=it._num_workers,
        pool=_pool_view(pool) if pool is not None else None,
        ring=RingView(it._ring),
        shut_down=it._shutdown,
        hang_timeout=it._hang_timeout,
        held_batches=it._held_batches,
        restarts_left=it._supervisor.restarts_left,
        base_seed=it._base_seed,
    )


def _loader_view(loader: DataLoader) -> LoaderView:
    # A FastLoader has its state from the start; a DataLoader under
    # fastload.install() from its first iterator on.
    state = loader.__dict__.get(STATE_ATTR)
    it = getattr(loader, "_iterator", None)  # DataLoader's own, for persistent_workers
    return LoaderView(
        idle_pool=(_pool_view(state.idle_pool)
                   if state is not None and state.idle_pool is not None else None),
        fork_server_pid=(running_server_pid(not state.options.allow_gpu_in_workers)
                         if state is not None and state.server_lease is not None
                         and state.server_lease.held else None),
        iterator=_iterator_view(it) if isinstance(it, FastLoaderIter) else None,
    )


@overload
def debug_view(obj: FastLoaderIter) -> IteratorView: ...
@overload
def debug_view(obj: DataLoader) -> LoaderView: ...
def debug_view(obj: Any) -> Any:
    """A snapshot of fastload's state behind ``obj``.

    ``obj`` is a loader (a :class:`~fastload.FastLoader`, or a DataLoader
    under ``fastload.install()``): returns a :class:`LoaderView`. Or an
    iterator of one with workers: returns an :class:`IteratorView`. Raises
    TypeError for anything else (a ``num_workers=0`` iterator, or one of
    torch's own).
    """
    if isinstance(obj, FastLoaderIter):
        return _iterator_view(obj)
    if isinstance(obj, DataLoader):
        return _loader_view(obj)
    raise TypeError(f"debug_view() takes a loader or a fastload iterator with workers, "
                    f"not {type(obj).__name__}")
