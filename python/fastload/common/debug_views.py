"""The read-only views behind :func:`fastload.debug.debug_view`.

Each class renders its own view from its own state, so that no module
reads another's private attributes: :meth:`WorkerPool.debug_view
<fastload.pool.worker_pool.WorkerPool.debug_view>`, :meth:`FastLoaderIter.debug_view
<fastload.iterator.multi_process.FastLoaderIter.debug_view>` and
:meth:`LoaderRuntime.debug_view <fastload.iterator.loader_runtime.LoaderRuntime.debug_view>`
(with :func:`fastload.loader.loader_view` for any loader). This module
imports none of them, so each can import it. See :mod:`fastload.debug` for
what a view promises (a snapshot, holding no worker alive, changing nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

from .. import _core

__all__ = ["IteratorView", "LoaderView", "PoolView", "RingView"]


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
    """The fork server this loader's pools' zygotes are forked from (it
    outlives the loader), or None: the loader holds no lease on one (an explicit
    start method, ``num_workers=0``, or a DataLoader not yet iterated under
    ``fastload.install()``)."""
    iterator: Optional[IteratorView]
    """The iterator the loader keeps (``persistent_workers=True``), or None."""
