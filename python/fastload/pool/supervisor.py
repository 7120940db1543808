"""Watching the workers: deaths, hangs, and restarts.

NOTE [ Supervision ]
The main process never blocks on a worker without a way out. The ring's
wait returns when a batch completes, on a signal, at the end of its
timeout, and, since the pool watches every worker's pidfd (the ring's death
watch), as soon as a worker dies. After every wait that brought no batch,
the iterator calls :meth:`Supervisor.check`, so a death is acted on at once,
with no polling. The wait's timeout is only what the hang watchdog needs
(:attr:`Supervisor.check_every`: a twentieth of ``hang_timeout``), or none
at all without a watchdog; where a worker could not be watched (no pidfd)
the iterator checks every 0.1 s instead. :meth:`Supervisor.check` looks for

* **dead workers** (any exit, any signal): the epoch ends at once with
  DataLoader's message for the worker (its last words if it died starting
  up) and the batches it held; or, with ``max_worker_restarts``, the worker
  is replaced at once (:meth:`Supervisor.restart`). Only batches already
  made and waiting in the ring are delivered before the error: the loop
  never waits for a batch that is not made yet, since the worker owing it
  may be slow or stuck (a stuck one would hold the error back until the
  hang watchdog fires, minutes later);
* **hung workers**: each worker bumps a progress counter in the ring at
  every pop and commit. A worker that should be working (it holds a batch,
  or has one queued: a worker stopped between two tasks, or before it has
  joined the ring, holds up the epoch as surely as one stuck inside one)
  and whose counter has not moved for ``hang_timeout`` seconds is asked for
  its Python stack, killed, and then reported
  (:class:`fastload.WorkerHangError`) or restarted. A warning is logged at
  half the timeout. Before a worker joins the ring, its progress is the CPU
  time it uses: a fresh interpreter (``multiprocessing_context="spawn"``)
  importing torch for seconds is busy, not late; one stopped, or blocked
  for ``hang_timeout`` (a lock, a file system that does not answer), is hung.

A restart keeps what the dead worker committed, takes back the slots of
its unfinished batches and queues them again, in batch order, for a new
process with the same worker id and seeds, after its session task. Batch
numbers and indices do not change, so delivery stays exactly once and in
order. Exceptions raised by ``dataset[i]`` are results, not failures: they
are never retried.

The supervisor acts on the pool and the ledger and reports a failure by
raising :class:`WorkerLost`; it never calls back into the iterator.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Dict, Optional, Set, Tuple

from ..common.errors import WorkerHangError, as_list, short_list
from .ledger import Record, Role, SlotLedger
from .exits import cpu_ticks, describe_exit
from .worker_pool import WorkerPool

log = logging.getLogger("fastload")

_POLL_S = 0.1  # how often liveness is checked where deaths do not wake the wait


class WorkerLost(Exception):
    """A worker died or hung and the epoch cannot go on; ``error`` is what
    the training loop gets."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def describe_batch(rec: Optional[Record]) -> str:
    if rec is None or rec.role is not Role.BATCH:
        return "its session set-up (unpickling the dataset, worker_init_fn)"
    return f"batch {rec.idx} of this epoch (indices {short_list(as_list(rec.index))})"


class Supervisor:
    """Deaths, hangs and restarts of one pool's workers, for one iterator.

    ``start_session(worker)`` starts the session of a replacement worker
    (the iterator's dataset and seeds) and returns its record; ``restartable``
    is False where a new replica cannot continue a dead one's work (an
    IterableDataset would repeat its stream).
    """

    def __init__(self, pool: WorkerPool, ledger: SlotLedger, *, hang_timeout: Optional[float],
                 max_restarts: int, restartable: bool,
                 start_session: Callable[[int], Record],
                 on_restart: Callable[[], None] = lambda: None) -> None:
        self._pool = pool
        self._ledger = ledger
        self._ring = pool.ring
        self.hang_timeout = hang_timeout
        self.restarts_left = max_restarts
        self._restartable = restartable
        self._start_session = start_session
        self._on_restart = on_restart  # counts restarts for the loader's stats()
        self._stall: Dict[int, Tuple[object, float, bool]] = {}  # worker -> (progress, since, warned)
        # Dead workers whose error waits until the loop needs one of their
        # batches (see check); the ring no longer wakes waits for them.
        self._deferred: Set[int] = set()

    def check(self, needed: Optional[Record] = None) -> None:
        """Look at every worker once; raise :class:`WorkerLost` to end the epoch.

        ``needed``: the batch the loop waits for, in order. While it is
        already made (READY in the ring), a worker that died and cannot be
        restarted does not end the epoch yet: that batch is delivered first,
        as DataLoader delivers what arrived before its check of the workers.
        The error comes as soon as the loop needs a batch that is not made
        (with ``needed=None``, at once)."""
        self._check_deaths(needed)
        self._check_hangs()

    @property
    def deaths_deferred(self) -> bool:
        """A death is known that :meth:`check` has not raised yet: check
        before waiting, as no wait wakes for it any more."""
        return bool(self._deferred)

    @property
    def check_every(self) -> float:
        """How long a wait may last before :meth:`check` is due (seconds,
        ``math.inf`` for no limit): a twentieth of ``hang_timeout``, so a hang
        is reported within 5% of it; no limit without a watchdog, as deaths
        wake the wait themselves (unless the pool could not watch them)."""
        if not self._pool.deaths_watched:
            return _POLL_S
        if self.hang_timeout is None:
            return math.inf
        return max(0.01, self.hang_timeout / 20)

    def can_restart(self, n: int) -> bool:
        return self._restartable and self.restarts_left >= n

    # ---- deaths --------------------------------------------------------------
    def _made(self, rec: Optional[Record]) -> bool:
        return rec is not None and (rec.done or self._ring.is_ready(rec.slot, rec.seq))

    def _check_deaths(self, needed: Optional[Record]) -> None:
        dead = self._pool.dead_workers()
        if not dead:
            return
        if self.can_restart(len(dead)):
            for wid, pid, code in dead:
                self.restart(wid, describe_exit(pid, code).strip())
            return
        if self._made(needed):
            for wid, _pid, _code in dead:
                if wid not in self._deferred:
                    self._deferred.add(wid)
                    self._ring.unwatch_worker(wid)  # else every wait would wake for it
            return
        msgs = []
        for wid, pid, code in dead:
            msg = describe_exit(pid, code, self._pool.death_note(wid))
            mine = sorted((r for r in self._ledger.of_worker(wid)
                           if r.role is Role.BATCH and not self._made(r)), key=lambda r: r.idx)
            if mine:
                batches = ", ".join(str(r.idx) for r in mine)
                msg += (f"It was making batch(es) {batches} of this epoch "
                        f"(indices {short_list([r.index for r in mine])}). ")
            msgs.append(msg)
        raise WorkerLost(RuntimeError("".join(msgs).strip()))

    # ---- hangs ---------------------------------------------------------------
    def _in_hand(self, w: int) -> Optional[int]:
        """The stamp of the task worker ``w`` should be working on, if any:
        the one it popped, else its oldest queued one. A worker that has not
        attached to the ring yet counts too: one stopped or stuck while it
        starts holds up its session as surely as one stuck inside it."""
        seq = self._ring.worker_current_seq(w)
        if seq is not None:
            return seq
        return self._ledger.oldest_queued(w)

    def _check_hangs(self) -> None:
        if self.hang_timeout is None:
            return
        now = time.monotonic()
        for w in range(len(self._pool.procs)):  # retiring ones too, while they hold tasks
            seq = self._in_hand(w)
            if seq is None:  # no work for it: it cannot be late
                self._stall.pop(w, None)
                continue
            pid = self._pool.procs[w].pid
            joined = self._ring.worker_pid(w) != 0
            # Not joined yet: the CPU time it used stands for its progress.
            progress: object = self._ring.worker_progress(w) if joined else ("cpu", cpu_ticks(pid))
            last = self._stall.get(w)
            if last is None or last[0] != progress:
                self._stall[w] = (progress, now, False)
                continue
            stalled = now - last[1]
            what = describe_batch(self._ledger.get(seq))
            if not joined:
                what = "its start-up (it has not joined the ring yet)"
            if stalled >= self.hang_timeout:
                self._hung(w, pid, what, stalled)
            elif stalled >= self.hang_timeout / 2 and not last[2]:
                log.warning("fastload: worker %d (pid %s) has been on %s for %.0f s "
                            "(hang_timeout=%s)", w, pid, what, stalled, self.hang_timeout)
                self._stall[w] = (last[0], last[1], True)

    def _hung(self, w: int, pid: Optional[int], what: str, stalled: float) -> None:
        stack = self._pool.worker_stack(w)
        self._pool.procs[w].kill()  # no grace period for a hung worker
        self._stall.pop(w, None)
        if self.can_restart(1):
            log.warning("fastload: worker %d (pid %s) hung on %s; its stack:\n%s",
                        w, pid, what, stack)
            self.restart(w, f"no progress for {stalled:.0f} s")
            return
        raise WorkerLost(WorkerHangError(
            f"DataLoader worker {w} (pid {pid}) made no progress for {stalled:.0f} s "
            f"on {what} (hang_timeout={self.hang_timeout}). Its Python stack:\n{stack}"))

    # ---- restarts ------------------------------------------------------------
    def restart(self, w: int, cause: str) -> None:
        """Replace worker ``w`` and have it make its unfinished batches again."""
        self.restarts_left -= 1
        self._on_restart()
        self._stall.pop(w, None)  # the new process's clock starts when it does
        log.warning("fastload: restarting worker %d (%s); %d restart(s) left", w, cause,
                    self.restarts_left)
        self._pool.replace_worker(w)  # the old process is gone when this returns
        redo = self._ledger.reclaim_worker(w)
        self._start_session(w)
        for rec in redo:
            self._ledger.reassign(rec, w)

