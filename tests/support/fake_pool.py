"""A worker pool played in the test's own process, for tests of the main
side's parts with no worker process (the iterator, the supervisor).

:class:`FakePool` has what those parts ask of a
:class:`fastload.pool.worker_pool.WorkerPool`: a real ring and
:class:`~fastload.pool.ledger.SlotLedger`, and worker processes that are
:class:`~support.ring_driver.FakeWorker`\\ s, whose deaths, stacks and
replacements the test makes up. Its workers work only while the main side
waits on the ring (:class:`DrivenRing`), which is when a real main process
lets time pass for its workers; so a run is the same every time, and needs
no clock. A worker the test stalls sits out that many waits; a wait that no
worker will ever answer (none did anything, none is stalled, none died)
raises :class:`Stuck` instead of hanging.

:class:`DrivenLoader` is a ``DataLoader`` whose multi-process iterator is
fastload's, over fake pools whose workers make batches from the loader's own
dataset and ``collate_fn``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import DataLoader, _DatasetKind
from torch.utils.data._utils import ExceptionWrapper

from fastload import _core
from fastload.iterator.multi_process import FastLoaderIter
from fastload.pool.ledger import SlotLedger
from fastload.iterator.loader_runtime import LoaderOptions, LoaderRuntime
from fastload.transport.overflow import OverflowSegments
from fastload.common.protocol import SessionTask, encode_session

from .ring_driver import SLOT_BYTES, FakeWorker


class Stuck(AssertionError):
    """The main side waits for a result that no fake worker will make."""


@dataclass
class Fetch:
    """A fetch task as a fake worker took it."""

    worker: int
    epoch: int
    batch: int  # its number in the epoch
    index: Any  # the sampler's output
    slot: int


class _Proc:
    """A worker process as the supervisor sees it: a pid, and kill()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.killed = False

    def kill(self) -> None:
        self.killed = True


class DrivenRing:
    """The pool's ring as the main side sees it; its waits run the workers
    first. Everything else is the real ring's."""

    def __init__(self, ring: _core.Ring, pool: "FakePool") -> None:
        self._ring = ring
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)

    def wait_any(self, slots: List[int], seqs: List[int],
                 timeout: float) -> Tuple[_core.WaitResult, int]:
        progressed = self._pool.run_workers()
        status, which = self._ring.wait_any(slots, seqs, 0.0)
        if status != _core.WaitResult.READY and not progressed and not self._pool.dead:
            raise Stuck(f"the main side waits for slots {slots} (stamps {seqs}), which no "
                        f"fake worker will commit")
        return status, which


class FakePool:
    """What the iterator and the supervisor ask of a pool (see the module's
    docstring). Made with :class:`fastload.pool.worker_pool.WorkerPool`'s arguments;
    ``fetch(index)``: how a worker makes the batch of sampler output
    ``index`` (None: the test's workers make no batches)."""

    def __init__(self, *, ctx: Any = None, num_workers: int = 2, num_slots: int = 8,
                 slot_bytes: int = SLOT_BYTES, hide_accelerators: bool = True,
                 force_shm: bool = False, zygote: Any = None, inherited: Optional[tuple] = None,
                 capacity: Optional[int] = None,
                 fetch: Optional[Callable[[Any], Any]] = None) -> None:
        capacity = num_workers if capacity is None else capacity
        self.capacity = capacity
        self.num_workers = num_workers
        self.config = (ctx, capacity, num_slots, slot_bytes, hide_accelerators, force_shm)
        self.real_ring = _core.Ring.create(num_slots, capacity, slot_bytes)
        self.ring = DrivenRing(self.real_ring, self)
        self.overflow = OverflowSegments([])  # a fake worker's batch always fits its slot
        self.ledger = SlotLedger(self.ring, self.overflow)
        self.reusable = inherited is None
        self.pinner = None
        self.deaths_watched = True
        self.procs = [_Proc(1000 + w) for w in range(capacity)]
        self._fetch = fetch
        self.workers = [FakeWorker(self.real_ring, w) for w in range(capacity)]
        # What the test sets or reads:
        self.dead: List[Tuple[int, int, Optional[int]]] = []  # (worker, pid, exit code)
        self.stalls: Dict[int, int] = {}  # worker -> waits it still sits out
        self.sessions: List[Tuple[int, int]] = []  # (worker, base seed) of each session taken
        self.fetches: List[Fetch] = []  # every fetch task taken, in the order taken
        self.replaced: List[int] = []
        self.retired = False  # handed back: its workers are done (a zygote pool's)
        self.shut_down = False

    # ---- the test's controls --------------------------------------------------
    def kill(self, worker: int) -> None:
        """Worker ``worker`` dies of SIGKILL: it makes nothing more."""
        self.dead.append((worker, self.procs[worker].pid, -signal.SIGKILL))

    def run_workers(self) -> bool:
        """Each live worker not stalled does every task in its queue, in
        worker order; returns whether any did one or sat this wait out (a
        later wait may then bring more)."""
        progressed = False
        if self.shut_down:
            return progressed
        dead = {d[0] for d in self.dead}
        for w in range(self.num_workers):
            if w in dead:
                continue
            if self.stalls.get(w, 0) > 0:
                self.stalls[w] -= 1
                progressed = True
                continue
            while True:
                got = self.workers[w].next_task()
                if got is None:
                    break
                progressed = True
                self._do(w, *got)
        return progressed

    def _do(self, w: int, slot: int, seq: int, task: Any) -> None:
        worker = self.workers[w]
        if isinstance(task, SessionTask):
            self.sessions.append((w, task.base_seed))
            worker.commit(slot)
            return
        self.fetches.append(Fetch(w, task.epoch, task.batch_idx, task.index, slot))
        assert self._fetch is not None, "this pool's workers make no batches"
        capture = ("worker", w, "batch", task.batch_idx)
        try:
            batch = self._fetch(task.index)
        except Exception:
            worker.commit_error(slot, ExceptionWrapper(where=f"in DataLoader worker process {w}"),
                                capture)
            return
        worker.commit_batch(slot, batch, capture, make_ns=1000)

    # ---- what a WorkerPool answers ----------------------------------------------
    @property
    def alive(self) -> bool:
        return not self.shut_down and not self.dead

    def session_tasks(self, parcel: Any, base_seed: int, workers: Optional[List[int]] = None,
                      resume: Optional[list] = None,
                      preload_timeout: Optional[float] = None) -> Iterator[Tuple[int, bytes]]:
        if workers is None and self.retired:  # a zygote pool's new session: fresh workers
            self.workers = [FakeWorker(self.real_ring, w) for w in range(self.capacity)]
            self.retired = False
        targets = range(self.num_workers) if workers is None else workers
        states = resume if resume is not None else [None] * self.capacity
        for w in targets:
            yield w, encode_session(base_seed, False, states[w])

    def retire(self) -> None:
        """Handed back to the loader: the workers are done, batches still in
        flight abandoned (a zygote pool kills their workers)."""
        orphans = self.ledger.busy()
        for w in range(self.num_workers):
            self.real_ring.reset_worker(w)
            if orphans:
                self.ledger.abandon_worker(w)
        self.retired = True

    def shutdown(self, wait: bool = True) -> None:
        self.ledger.forget()
        if not self.shut_down:
            self.shut_down = True
            self.real_ring.shutdown()

    def dead_workers(self) -> List[Tuple[int, int, Optional[int]]]:
        return list(self.dead)

    def death_note(self, worker: int) -> str:
        return ""

    def worker_stack(self, worker: int, wait_s: float = 0.5) -> str:
        return f'  File "ds.py", line 7, in __getitem__ (worker {worker})'

    def replace_worker(self, w: int) -> None:
        self.replaced.append(w)
        self.dead = [d for d in self.dead if d[0] != w]
        self.real_ring.reset_worker(w)
        self.workers[w] = FakeWorker(self.real_ring, w)


class DrivenLoader(DataLoader):
    """A ``DataLoader`` whose multi-process iterator is fastload's
    :class:`~fastload.iterator.multi_process.FastLoaderIter` over :class:`FakePool`\\ s
    (``pools``, the newest last), whose workers make batches from this
    loader's dataset and ``collate_fn``. ``options``: fastload's own
    (:class:`~fastload.iterator.loader_runtime.LoaderOptions`); no hang watchdog by
    default, whose clock the fakes do not move."""

    def __init__(self, dataset: Any, *, options: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("num_workers", 2)
        super().__init__(dataset, **kwargs)
        self.pools: List[FakePool] = []
        opts = {"hang_timeout": None, "slot_bytes": SLOT_BYTES, **(options or {})}
        self.fastload_state = LoaderRuntime(LoaderOptions(**opts), make_pool=self._new_pool)

    def _new_pool(self, **kwargs: Any) -> FakePool:
        fetcher = _DatasetKind.create_fetcher(self._dataset_kind, self.dataset,
                                              self._auto_collation, self.collate_fn,
                                              self.drop_last)
        pool = FakePool(fetch=fetcher.fetch, **kwargs)
        self.pools.append(pool)
        return pool

    def _get_iterator(self) -> FastLoaderIter:
        return FastLoaderIter(self, self.fastload_state)


def ring_slots(pool: FakePool) -> Dict[str, int]:
    """How many of the pool's slots are free and leased to the test's batches."""
    ring = pool.real_ring
    leased = sum(ring.state(i) == _core.SlotState.LEASED for i in range(ring.num_slots))
    return {"free": ring.free_slot_count(), "leased": leased, "all": ring.num_slots}

