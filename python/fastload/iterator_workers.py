"""The iterator's dealings with its pool's workers: a half of
:class:`fastload.iterator.FastLoaderIter`.

The iterator orders batches; this half starts a session on the workers of
the pool the iterator took, waits for their results while the supervisor
watches them (NOTE [ Supervision ] in supervisor.py), and ends the
iterator's hold on them: the pool handed back to the loader warm, or its
workers stopped for good. A mixin, so that the iterator's own module keeps
to DataLoader's iterator; the state it reads and sets is the iterator's.

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

import functools
import os
import time
from typing import Optional

from torch.utils.data import _DatasetKind

from . import resume
from .launching import crossing
from .ledger import Record, Role
from .loader_state import LoaderState
from .pool import WorkerPool
from .supervisor import Supervisor, WorkerLost, restart_session
from .wire import FLAG_OVERFLOW, Kind


class WorkersMixin:
    """The iterator's session, waits and end (mixed into FastLoaderIter only)."""

    # ---- the session -------------------------------------------------------
    def _supervise(self, pool: WorkerPool, blob: Optional[crossing.Parcel],
                   state: LoaderState) -> None:
        """Have a supervisor watch ``pool``'s workers for this iterator; a
        replacement worker gets session ``blob``."""
        opts = state.options
        restartable = self._dataset_kind == _DatasetKind.Map
        # The pickled session is as big as the dataset: kept for the iterator's
        # life only where a replacement worker may need it.
        kept = (blob if restartable and (opts.max_worker_restarts > 0 or self._auto is not None)
                else None)
        self._session_blob = kept  # a worker added by num_workers="auto" gets it too
        self._supervisor = Supervisor(
            pool, self._ledger, hang_timeout=opts.hang_timeout,
            max_restarts=opts.max_worker_restarts, restartable=restartable,
            start_session=functools.partial(restart_session, pool, kept, self._base_seed,
                                            self._book, self._reader),
            on_restart=state.meter.restarted)

    def _start_session(self, state: LoaderState, saved: Optional[dict],
                       blob: Optional[crossing.Parcel]) -> None:
        """Wait out a spawned pool's orphans, then start session ``blob`` on
        the workers, put back to ``saved``'s states."""
        assert self._pool is not None
        workers = None
        if saved is not None:
            mid_epoch = saved["position"] is not None
            workers = [resume.worker_resume(ws, mid_epoch) for ws in saved["workers"]]
            # num_workers="auto" may have room for more or fewer workers here
            workers = (workers + [None] * self._capacity)[: self._capacity]
            this_epoch = [mid_epoch and bool(ws and ws["this_epoch"]) for ws in saved["workers"]]
            self._book.resumed([w and w[0] for w in workers],
                               (this_epoch + [False] * self._capacity)[: self._capacity])
        self._ledger.drain(self._wait_one)
        self._trim_slots(state)
        self._ledger.make_free(self._num_workers)
        self._pool.start_session(blob, self._base_seed, resume=workers,
                                 preload_timeout=state.options.hang_timeout)

    def _next_session_epoch(self) -> None:
        """A persistent session's next epoch: DataLoader waits for every
        worker to acknowledge ``_ResumeIteration``; here the previous
        epoch's batches are waited out, then tasks carry the new epoch."""
        self._release_unclaimed()
        self._ledger.drain(self._wait_one)
        self._trim_slots(self._state_ref())
        self._epoch += 1

    def _trim_slots(self, state: Optional[LoaderState]) -> None:
        """An epoch starts: free slots give back the pages an outlier batch
        made them keep (see SlotLedger.trim_free)."""
        keep = state.slot_keep() if state is not None else None
        if keep is not None:
            self._ledger.trim_free(keep)

    # ---- receiving ---------------------------------------------------------
    def _wait_one(self, deadline: Optional[float] = None,
                  needed: Optional[Record] = None) -> Optional[Record]:
        """One round of waiting: a completed record, or None with the workers
        checked, after a worker died or the watchdog's interval passed
        (NOTE [ Supervision ])."""
        if self._supervisor.deaths_deferred:
            self._check(needed)
        wait = self._supervisor.check_every
        if deadline is not None:
            wait = min(wait, max(0.0, deadline - time.monotonic()))
        rec = self._ledger.wait(wait)
        if rec is not None:
            if rec.role is Role.BATCH and rec.kind & ~FLAG_OVERFLOW == Kind.DATA:
                self._meter.made(rec.worker, rec.make_ns, rec.idx, rec.index)
            return rec
        self._check(needed)
        if deadline is not None and time.monotonic() >= deadline:
            self._fail(f"DataLoader timed out after {self._timeout} seconds")
        return None

    def _check(self, needed: Optional[Record]) -> None:
        """The supervisor's look at the workers; a lost worker ends the iterator."""
        try:
            self._supervisor.check(needed)
        except WorkerLost as lost:
            self._fatal = str(lost.error)
            self._shutdown_workers(wait=False)  # no grace: a stuck worker would not see a stop
            raise lost.error from None

    def _receive_one(self, deadline: Optional[float], needed: Optional[Record]) -> Record:
        """Block until some batch of this iterator has a result (``needed``:
        the batch due next, see Supervisor.check)."""
        while True:
            rec = self._wait_one(deadline, needed)
            if rec is not None and rec.role is Role.BATCH:
                return rec

    def _fail(self, msg: str) -> None:
        """A timeout ends the epoch: kill the workers (one that kept the loop
        waiting would not see a stop soon) and raise now and at every later next()."""
        self._fatal = msg
        self._shutdown_workers(wait=False)
        raise RuntimeError(msg)

    # ---- shutdown (NOTE [ Shutdown ]) --------------------------------------
    def _hand_back_pool(self) -> None:
        """End of this iterator: give a healthy pool back to the loader, warm."""
        if self._shutdown:
            return
        self._shutdown = True
        pool = self._pool
        if pool is None:
            return
        state = self._state_ref()
        if state is None or self._persistent_workers or not pool.alive:
            self._pool = None
            pool.shutdown()
            return
        self._release_unclaimed()
        self._pool = None
        self._ledger.orphan_batches()
        state.keep_idle_pool(pool)

    def _shutdown_workers(self, wait: bool = True) -> None:
        """Stop the workers for good (an error, a persistent iterator's end)."""
        if self._shutdown:
            return
        self._shutdown = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait)

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) != os.getpid():
            # A forked child collecting its inherited copy: the pool, its
            # slots and workers are the parent's (teardown.stop_pool closes our fds).
            return
        try:
            if getattr(self, "_persistent_workers", True):
                self._shutdown_workers()
            else:
                self._hand_back_pool()
        except Exception:  # pragma: no cover - interpreter teardown
            pass
