"""One iterator's session on a pool's workers: started, waited on, ended.

:class:`PoolSession` owns what an iterator holds of its pool: the pool
itself, the supervisor that watches its workers (NOTE [ Supervision ] in
:mod:`fastload.pool.supervisor`), the session's epoch number, the pickled
session kept for replacement workers, and the iterator's failure. It starts
the session on the workers, waits for their results, and ends the
iterator's hold on them.

NOTE [ Shutdown ]
An iterator that ends normally (or is dropped mid-epoch) gives its pool back
to the loader, warm; a zygote pool's workers, and batches still in flight,
go then (:meth:`WorkerPool.retire`), a spawned pool's orphans are waited out
by the next session. An iterator that fails (a dead or hung worker, a
timeout) stops its workers for good and raises the same error at every
later ``next()``. Persistent workers end with the iterator. Slots still
leased by the loop stay mapped until their last view dies.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, List, Optional

from ..launching import parcels
from ..pool.ledger import Record, Role
from ..pool.supervisor import Supervisor, WorkerLost
from ..pool.worker_pool import WorkerPool
from ..common.protocol import FLAG_OVERFLOW, Kind
from ..resume import book
from ..stats.meter import EpochMeter
from ..transport.reader import SlotReader
from .loader_runtime import LoaderOptions, LoaderRuntime


class PoolSession:
    """An iterator's hold on ``pool``: its session on the workers, the waits
    for their results under a supervisor, and its end.

    ``parcel``: the pickled session; kept for the iterator's life only where
    a replacement worker may need it (``keep_parcel``: restarts are allowed
    or ``num_workers="auto"`` may add workers). ``resume_book`` and
    ``reader``: where a replacement worker's state is read from.
    """

    def __init__(self, pool: WorkerPool, options: LoaderOptions, meter: EpochMeter,
                 base_seed: int, parcel: Optional[parcels.Parcel], *, restartable: bool,
                 keep_parcel: bool, resume_book: book.ResumeBook, reader: SlotReader) -> None:
        self.pool: Optional[WorkerPool] = pool
        self.ledger = pool.ledger
        self.ring = pool.ring
        self.epoch = 0  # the session's epoch, carried by each task
        self.failure: Optional[str] = None  # the error every later next() raises
        self.shut_down = False
        self._meter = meter
        self._base_seed = base_seed
        self._parcel = parcel if restartable and keep_parcel else None
        self._book = resume_book
        self._reader = reader
        self.supervisor = Supervisor(
            pool, self.ledger, hang_timeout=options.hang_timeout,
            max_restarts=options.max_worker_restarts, restartable=restartable,
            start_session=self._replacement_session, on_restart=meter.restarted)

    # ---- the session -------------------------------------------------------
    def start(self, parcel: Optional[parcels.Parcel], num_workers: int,
              resumes: Optional[List[Optional[tuple]]], state: LoaderRuntime) -> None:
        """Wait out a spawned pool's orphans, then start session ``parcel``
        on ``num_workers`` workers, put back to ``resumes``."""
        assert self.pool is not None
        self.ledger.drain(self.wait_one)
        self._trim_slots(state)
        self.ledger.make_free(num_workers)
        self._queue_sessions(parcel, resume=resumes, preload_timeout=state.options.hang_timeout)

    def start_added(self, added: List[int], capacity: int) -> None:
        """Start the session on workers ``num_workers="auto"`` just added."""
        self._queue_sessions(self._parcel, added, resume=[None] * capacity)

    def next_epoch(self, state: Optional[LoaderRuntime]) -> None:
        """A persistent session's next epoch: DataLoader waits for every
        worker to acknowledge ``_ResumeIteration``; here the previous
        epoch's batches are waited out, then tasks carry the new epoch."""
        self.ledger.drain(self.wait_one)
        self._trim_slots(state)
        self.epoch += 1

    def _trim_slots(self, state: Optional[LoaderRuntime]) -> None:
        """An epoch starts: free slots give back the pages an outlier batch
        made them keep (see SlotLedger.trim_free)."""
        keep = state.pools.slot_keep() if state is not None else None
        if keep is not None:
            self.ledger.trim_free(keep)

    def _replacement_session(self, worker: int) -> Record:
        """The session of a replacement worker, its generators put back to where
        the dead one's were after its last finished batch, so the batches it
        makes again are the ones the dead worker would have made (see
        NOTE [ Resume ] in fastload.resume.book)."""
        pool = self.pool
        assert pool is not None
        finished = [r for r in pool.ledger.of_worker(worker) if r.role is Role.BATCH and
                    (r.done or pool.ring.is_ready(r.slot, r.seq))]
        capture = self._book.last_made[worker]
        if finished:
            capture = self._reader.peek_capture(max(finished, key=lambda r: r.idx))
        states: List[Any] = [None] * pool.capacity
        if capture is not None:
            states[worker] = (tuple(book.decode(capture)), 0)
        return self._queue_sessions(self._parcel, [worker], resume=states)[0]

    def _queue_sessions(self, parcel: Optional[parcels.Parcel], workers: Optional[List[int]] = None,
                        **kw: Any) -> List[Record]:
        """Start a session on the pool's workers (or on ``workers``): the
        pool sends each what it needs, and each one's session task is queued
        in a slot the ledger assigns; the ledger frees it when it completes."""
        assert self.pool is not None
        with contextlib.closing(self.pool.session_tasks(parcel, self._base_seed, workers,
                                                        **kw)) as tasks:
            return [self.ledger.assign(Role.SESSION, w, task) for w, task in tasks]

    # ---- waiting -----------------------------------------------------------
    def wait_one(self, deadline: Optional[float] = None, needed: Optional[Record] = None,
                 timeout: float = 0) -> Optional[Record]:
        """One round of waiting: a completed record, or None with the workers
        checked, after a worker died or the watchdog's interval passed
        (NOTE [ Supervision ]). ``deadline``: DataLoader's ``timeout``
        (``timeout`` seconds) ends the iterator when passed."""
        supervisor = self.supervisor
        if supervisor.deaths_deferred:
            self._check(needed)
        wait = supervisor.check_every
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        rec = self.ledger.wait(wait)
        if rec is not None:
            if rec.role is Role.BATCH and rec.kind & ~FLAG_OVERFLOW == Kind.DATA:
                self._meter.made(rec.worker, rec.make_ns, rec.idx, rec.index)
            return rec
        self._check(needed)
        if deadline is not None and time.monotonic() >= deadline:
            self.fail(f"DataLoader timed out after {timeout} seconds")
        return None

    def receive(self, deadline: Optional[float], needed: Optional[Record],
                timeout: float) -> Record:
        """Block until some batch of this iterator has a result (``needed``:
        the batch due next, see Supervisor.check)."""
        while True:
            rec = self.wait_one(deadline, needed, timeout)
            if rec is not None and rec.role is Role.BATCH:
                return rec

    def _check(self, needed: Optional[Record]) -> None:
        """The supervisor's look at the workers; a lost worker ends the iterator."""
        try:
            self.supervisor.check(needed)
        except WorkerLost as lost:
            self.failure = str(lost.error)
            self.shutdown(wait=False)  # no grace: a stuck worker would not see a stop
            raise lost.error from None

    def fail(self, msg: str) -> None:
        """A timeout ends the epoch: kill the workers (one that kept the loop
        waiting would not see a stop soon) and raise now and at every later next()."""
        self.failure = msg
        self.shutdown(wait=False)
        raise RuntimeError(msg)

    # ---- the end (NOTE [ Shutdown ]) ---------------------------------------
    def keeps_warm(self, state: Optional[LoaderRuntime], persistent: bool) -> bool:
        """Whether :meth:`hand_back` would give the pool back to the loader warm."""
        return (not self.shut_down and self.pool is not None and state is not None
                and not persistent and self.pool.alive)

    def hand_back(self, state: Optional[LoaderRuntime], persistent: bool) -> None:
        """End of the iterator: give a healthy pool back to the loader, warm
        (its unclaimed results freed first: see :meth:`keeps_warm`)."""
        if self.shut_down:
            return
        warm = self.keeps_warm(state, persistent)
        self.shut_down = True
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if not warm:
            pool.shutdown()
            return
        self.ledger.orphan_batches()
        assert state is not None
        state.keep_idle_pool(pool)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers for good (an error, a persistent iterator's end)."""
        if self.shut_down:
            return
        self.shut_down = True
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait)
