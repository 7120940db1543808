"""A loader's pools between its iterators: :class:`PoolKeeper`.

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
import logging
import os
import statistics
from typing import Any, Callable, Deque, List, Optional

from .. import _core
from ..common.debug_views import PoolView
from ..launching.buffer_copies import SharedBuffers
from ..launching.fork_server import ServerLease, fork_server, fork_server_pid, lease_fork_server
from ..launching.start_methods import ZYGOTE
from ..launching.zygote import Zygote
from .worker_pool import WorkerPool

log = logging.getLogger("fastload")

_MIN_SLOT_BYTES = 1 << 20
_DEFAULT_SLOT_BYTES = 64 << 20  # memfd pages are only committed when written
_DEFAULT_SLOT_BYTES_SHM = 16 << 20  # the shm fallback reserves every page up front


class PoolKeeper:
    """What one loader keeps of its processes between iterators: the warm
    pool, the zygote forked ahead for its first pool, its lease on the fork
    server, the copies of the big buffers its sessions carry, and the batch
    sizes its slots are sized from.

    ``make_pool`` makes a new pool from :class:`WorkerPool`'s arguments
    (tests pass one whose workers they play themselves).
    """

    def __init__(self, make_pool: Callable[..., WorkerPool] = WorkerPool) -> None:
        self._make_pool = make_pool
        self.learned_batch_bytes = 0
        self._recent_batch_bytes: Deque[int] = collections.deque(maxlen=64)
        self.idle_pool: Optional[WorkerPool] = None
        self.server_lease: Optional[ServerLease] = None  # see lease_fork_server
        # A zygote forked for this loader's first pool when the loader was
        # built, importing the loader's modules meanwhile (prepare_zygote).
        self.spare_zygote: Optional[Zygote] = None
        self.warned_fork = False  # said that its workers fork from this process
        # Copies of the big arrays and buffers its sessions carry, reused
        # while unchanged (fastload.launching.buffer_copies); freed with it.
        self.buffers = SharedBuffers()

    # ---- slot sizes --------------------------------------------------------
    def learn(self, batch_bytes: int) -> None:
        """Remember the largest batch seen (later pools get slots that fit
        it) and the recent ones (what a slot keeps, see :meth:`slot_keep`)."""
        if batch_bytes > self.learned_batch_bytes:
            self.learned_batch_bytes = batch_bytes
        self._recent_batch_bytes.append(batch_bytes)

    def slot_keep(self) -> Optional[int]:
        """The bytes a free slot keeps at an epoch's start: twice the median
        of the recent batches (at least 1 MiB); None before any batch."""
        if not self._recent_batch_bytes:
            return None
        return max(2 * statistics.median_low(self._recent_batch_bytes), _MIN_SLOT_BYTES)

    def slot_bytes(self, asked: Optional[int], force_shm: bool) -> int:
        """A new pool's slot size: ``asked`` (the ``slot_bytes`` option), or
        a default that grows to fit the largest batch seen."""
        slot_bytes = asked
        if slot_bytes is None:
            slot_bytes = _DEFAULT_SLOT_BYTES_SHM if force_shm else _DEFAULT_SLOT_BYTES
            learned = self.learned_batch_bytes * 5 // 4
            if learned > slot_bytes:
                slot_bytes = -(-learned // (1 << 20)) << 20
        return max(int(slot_bytes), _MIN_SLOT_BYTES)

    # ---- pools -------------------------------------------------------------
    def pool_for(self, ctx: Any, num_workers: int, prefetch_factor: int, *,
                 held_batches: int, slot_bytes: Optional[int], hide_accelerators: bool,
                 persistent: bool, inherited: Optional[tuple],
                 capacity: Optional[int] = None) -> WorkerPool:
        """A pool for a new iterator: the warm one if it fits, else a new one
        (``capacity``: the most workers it may grow to, for
        ``num_workers="auto"``; a warm pool keeps the count it had).

        Slots: one per possible task, one per worker for its session task,
        and the batches the loop may hold.
        """
        capacity = num_workers if capacity is None else capacity
        num_slots = capacity * (prefetch_factor + 1) + held_batches
        if num_slots > _core.MAX_SLOTS:
            raise ValueError(
                "num_workers * (prefetch_factor + 1) + held_batches must be at most "
                f"{_core.MAX_SLOTS}, got {num_slots}"
            )
        force_shm = forced_shm()
        hide = hide_accelerators
        config = (ctx, capacity, num_slots, self.slot_bytes(slot_bytes, force_shm), hide,
                  force_shm)
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

    def _take_idle_pool(self, config: tuple) -> Optional[WorkerPool]:
        pool, self.idle_pool = self.idle_pool, None
        if pool is None:
            return None
        if pool.config == config and pool.alive:
            return pool
        pool.shutdown()
        return None

    def keep_idle_pool(self, pool: WorkerPool, reuse_workers: bool) -> None:
        """An iterator is done with ``pool``: keep it warm if it may be reused."""
        if (reuse_workers and self.idle_pool is None and pool.alive
                and pool.reusable and pool.ledger.accounted_for()):
            pool.retire()
            self.idle_pool = pool
        else:
            pool.shutdown()

    # ---- the fork server ---------------------------------------------------
    def prepare_zygote(self, hide_accelerators: bool, modules: List[str]) -> Optional[Zygote]:
        """Fork the first pool's zygote from the fork server now, without
        waiting (the server may still be importing torch), and have it
        import ``modules`` (those defining the loader's dataset, sampler,
        ``collate_fn`` and ``worker_init_fn``) in the background, so that
        the first ``iter()`` pays for neither. Returns it; :meth:`release`
        stops it if the loader goes unused."""
        if self.spare_zygote is None:
            try:
                self.spare_zygote = fork_server(hide_accelerators).fork_zygote(wait=False)
            except (OSError, RuntimeError) as e:  # the first pool forks its own then
                log.debug("fastload: could not fork a zygote ahead: %s", e)
                return None
            self.spare_zygote.warm_imports(modules)
        return self.spare_zygote

    def lease_fork_server(self, hide_accelerators: bool) -> ServerLease:
        """Keep the fork server running for this loader (started now if it
        is not: it imports torch while the script builds its model, so the
        first epoch's workers fork from a ready one). :meth:`release` ends
        the lease when the loader is gone."""
        if self.server_lease is None:
            self.server_lease = lease_fork_server(hide_accelerators)
        return self.server_lease

    def release(self) -> None:
        """The loader is gone: the zygote forked for it, if no pool took it,
        stops, and its lease on the fork server ends."""
        zygote, self.spare_zygote = self.spare_zygote, None
        if zygote is not None:
            zygote.stop()
        if self.server_lease is not None:
            self.server_lease.release()

    def fork_server_pid(self, hide_accelerators: bool) -> Optional[int]:
        """The fork server this loader holds a lease on, if it does."""
        lease = self.server_lease
        return fork_server_pid(hide_accelerators) if lease is not None and lease.held else None

    def idle_pool_view(self) -> Optional[PoolView]:
        return self.idle_pool.debug_view() if self.idle_pool is not None else None


def forced_shm() -> bool:
    """Whether rings go in a ``/dev/shm`` file rather than a memfd
    (``FASTLOAD_SEGMENT=shm``, the fallback where memfd is missing)."""
    return os.environ.get("FASTLOAD_SEGMENT", "") == "shm"
