"""The worker pool: one ring and the processes that fill it.

Owned by one loader iterator, or kept warm by its loader between
iterators. Workers are forked from the pool's zygote by default, afresh for
each session (:meth:`WorkerPool.session_tasks`: the zygote unpickles the
session once and its workers share it); spawned or forked workers (an
explicit start method) are started with the pool and kept across sessions.
:meth:`WorkerPool.shutdown` stops them,
escalating from the ring's shutdown flag to SIGTERM to SIGKILL, and is also
run by a finalizer, so a pool dropped without shutdown (``break``, an
exception, ``del``) still leaves no process behind. The memory needs no
clean-up: a memfd disappears with the last process holding it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
import weakref
from typing import Any, Iterator, List, Optional, Tuple

from .. import _core
from ..common.debug_views import PoolView, RingView
from ..launching import parcels
from ..launching.child import Child
from ..launching.fork_server import Lineage
from ..launching.spawn import hidden_env, spawn
from ..launching.start_methods import launcher_of
from ..launching.zygote import Zygote
from .ledger import SlotLedger
from ..device.pinning import DeviceRuntime, PinnedRing
from .teardown import stop_pool
from ..common.protocol import encode_session, send_session
from ..common.protocol import WorkerSpec
from ..worker.loop import worker_main
from .handles import Launch, WorkerHandles, wait_retired

log = logging.getLogger("fastload")

_WORKER_MAIN = "fastload.worker.loop:worker_main"


class WorkerPool:
    """Main side: a ring and ``num_workers`` processes feeding it.

    A pool outlives one iterator when the loader keeps it warm: the next
    iterator starts a new *session* on it (the dataset re-sent, workers
    reseeded) instead of building a new ring and starting interpreters
    again. Its :class:`SlotLedger` says what every slot out of the free list
    is doing, across iterators.

    Workers forked from the zygote are started by each session, not by the
    pool: the zygote first unpickles the session (:meth:`Zygote.preload`),
    so the workers forked from it share those objects' pages copy-on-write
    instead of unpickling a copy each; the last session's workers are
    retired. Spawned and forked workers start with the pool and serve every
    session (the objects are sent to each of them).

    The pool decides when workers start, are replaced, retire and stop;
    :class:`~fastload.pool.handles.WorkerHandles` keeps their processes,
    channels and stack files. ``launch`` starts one worker from its spec in
    place of the start method's way (tests pass a fake).
    """

    def __init__(
        self,
        *,
        ctx: Any,
        num_workers: int,
        num_slots: int,
        slot_bytes: int,
        hide_accelerators: bool,
        force_shm: bool = False,
        zygote: Optional[Zygote] = None,
        inherited: Optional[tuple] = None,
        capacity: Optional[int] = None,
        launch: Optional[Launch] = None,
    ) -> None:
        # ``capacity``: the most workers the pool may grow to (num_workers="auto");
        # the ring has a queue for each, and slots for each one's tasks.
        capacity = num_workers if capacity is None else capacity
        self.capacity = capacity
        self.config = (ctx, capacity, num_slots, slot_bytes, hide_accelerators, force_shm)
        self.ring = _core.Ring.create(num_slots, capacity, slot_bytes, force_shm)
        self.num_workers = num_workers
        self.workers = WorkerHandles(self.ring, hide_accelerators, inherited)
        # The overflow segments the workers send on their channels.
        self.overflow = self.workers.overflow
        self.ledger = SlotLedger(self.ring, self.overflow)
        # Set when batches are pinned in place; leases handed out keep it
        # alive past the pool.
        self._pinner: Optional[PinnedRing] = None
        # The default: workers forked from this pool's own zygote, itself
        # forked from the training process's fork server.
        self._launcher = launcher_of(ctx)
        self._fake_launch = launch
        # The session objects themselves, for workers forked from this
        # process (what only fork can hand over). Such a pool serves one
        # session: a later one must see the objects as they are then.
        self._inherited = inherited
        if inherited is not None and self._launcher is not None:
            raise ValueError("fastload: an inherited session needs workers forked from this process")
        # Zygote workers: the zygotes they fork from, and the session the
        # current one holds (None for spawned or forked workers).
        self.lineage: Optional[Lineage] = None
        if self._launcher == "zygote":
            self.lineage = Lineage(capacity, hide_accelerators, zygote)
        elif zygote is not None:
            zygote.stop()
        self._finalizer = weakref.finalize(
            self, stop_pool, self.ring, self.workers,
            self.lineage.zygotes if self.lineage is not None else [], os.getpid(),
            leases=[self.lineage.lease] if self.lineage is not None else [])
        self._ctx = ctx
        self._hide = hide_accelerators
        # A zygote pool's workers once its iterator handed it back (retire):
        # exited or exiting, on purpose; the next session forks fresh ones.
        self._retired: List[multiprocessing.process.BaseProcess] = []
        if self._launcher != "zygote":  # zygote workers start with each session
            try:
                for i in range(num_workers):
                    self._start_worker(i)
            except BaseException:
                self.shutdown()
                raise
        log.debug("fastload: pool of %d workers (%s), ring %d x %d bytes (%s)", num_workers,
                  self._launcher or self._ctx.get_start_method(), num_slots, self.ring.slot_bytes,
                  self.ring.backend)

    def _start_worker(self, i: int) -> None:
        """Start worker ``i`` (a new one, or the replacement of a dead one)."""
        self.workers.start(i, self.num_workers, self._fake_launch or self._launch)

    def _launch(self, i: int, spec: WorkerSpec) -> multiprocessing.process.BaseProcess:
        """Start worker ``i`` the pool's way: forked from its zygote, spawned,
        or forked from this process with its spec (what only fork can hand
        over) inherited rather than pickled."""
        if self._launcher is None:
            p = self._ctx.Process(target=worker_main, args=(spec,),
                                  name=f"fastload-worker-{i}", daemon=True)
            p.start()
            return p
        parcel = parcels.pack(spec, "worker spec")
        try:
            if self.lineage is not None:
                return self.lineage.fork(i, _WORKER_MAIN, parcel)
            return spawn(_WORKER_MAIN, parcel, env=hidden_env(self._hide))
        finally:
            parcel.close()

    def replace_worker(self, w: int) -> None:
        """Replace dead (or hung: it is killed) worker ``w`` by a new process;
        the old one has exited when this returns. Overflow segments it sent
        before dying are kept (its channel is emptied as it is replaced).
        The caller starts the new worker's session."""
        old = self.procs[w]
        self.ring.unwatch_worker(w)  # its death is handled here
        if old.exitcode is None:
            old.kill()
        old.join(5.0)
        if isinstance(old, Child):
            old.close()
        self.ring.reset_worker(w)
        self._start_worker(w)

    def _retire_workers(self) -> List[multiprocessing.process.BaseProcess]:
        """Retire every worker (a new session gets fresh ones); returns the
        processes, which exit on their own at their next look at the ring."""
        old = list(self.procs)
        for w, p in enumerate(old):
            self.ring.unwatch_worker(w)  # it exits on purpose
            if p.exitcode is None and self.ring.worker_pid(w) == 0:
                # Not attached to the ring yet (a previous iterator was dropped
                # at once): it would attach to the new queue. No code of ours
                # runs in it yet.
                p.kill()
                p.join(5.0)
            self.overflow.collect(w)  # the ledger may free its batches unread
            self.ring.reset_worker(w)  # its next next_task() answers SHUTDOWN
        return old

    def retire(self) -> None:
        """An iterator handed this pool back: if its workers come from a
        zygote, they are done, as DataLoader's are at the end of an epoch,
        and go now rather than at the next ``iter()``, which forks fresh ones
        anyway; idle, they would hold memory for nothing (think of a
        validation loader, idle through every training epoch). Spawned and
        forked workers serve every session and stay.

        Batches a dropped iterator left in flight (the loop broke out of an
        epoch) are not waited for: their workers are killed and the slots
        freed. DataLoader shuts a dropped iterator's workers down too;
        waiting would cost the next epoch the queued batches, or all of a
        stuck sample. The zygote is told that the session it unpickled for
        the workers is done; it keeps the objects only to spare the next
        session its unpickling when that one is identical (the next epoch of
        an unchanged dataset)."""
        if self._launcher != "zygote" or self._retired:
            return
        orphans = self.ledger.busy()
        if orphans:
            self.workers.kill_all()
            for p in self.procs:
                p.join(5.0)
        self._retired = self._retire_workers()
        if orphans:  # every worker's: those num_workers="auto" was retiring too
            for w in range(self.capacity):
                self.ledger.abandon_worker(w)
        assert self.lineage is not None
        self.lineage.forget()

    def _fresh_workers(self, parcel: parcels.Parcel, timeout: Optional[float]) -> None:
        """A new session of a zygote pool: have the zygote preload ``parcel``
        and fork fresh workers from it, once the last session's (retired as
        its iterator handed the pool back) are gone."""
        old, self._retired = self._retired, []
        assert self.lineage is not None
        self.lineage.preload(parcel, timeout)
        # The retired workers are gone before new ones attach (one queue each).
        deadline = time.monotonic() + 2.0
        for p in old:
            wait_retired(p, max(0.0, deadline - time.monotonic()))
        self.workers.forget_past(self.num_workers)  # num_workers="auto" shrank it
        for i in range(self.num_workers):
            self._start_worker(i)

    # ---- num_workers="auto" ---------------------------------------------------
    def grow(self, n: int) -> List[int]:
        """Start workers up to ``n`` (at most :attr:`capacity`); returns the
        new ones' ids. The caller starts their session (:meth:`session_tasks`
        with ``workers``), as for a replacement."""
        if n > self.capacity:
            raise ValueError(f"fastload: a pool for {self.capacity} workers cannot grow to {n}")
        new = list(range(len(self.procs), n))
        self.num_workers = n  # the new workers' get_worker_info().num_workers
        for i in new:
            self._start_worker(i)
        return new

    def shrink(self, n: int) -> None:
        """Retire the workers past the first ``n`` (their tasks are done:
        the caller stopped giving them any and took their batches). They
        exit at their next look at the ring."""
        while len(self.procs) > n:
            w = len(self.procs) - 1
            p = self.procs[w]
            self.ring.unwatch_worker(w)  # it exits on purpose
            self.ring.reset_worker(w)  # its next next_task() answers SHUTDOWN
            wait_retired(p, 2.0)
            self.workers.forget_past(w)
        self.num_workers = n

    @property
    def procs(self) -> List[multiprocessing.process.BaseProcess]:
        """The workers' processes, by worker id."""
        return self.workers.procs

    @property
    def pids(self) -> Tuple[int, ...]:
        return self.workers.pids

    @property
    def deaths_watched(self) -> bool:
        """Whether every worker's death wakes the ring's waits (pidfds); if
        not, the iterator checks liveness between short waits."""
        return self.workers.deaths_watched

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and not self.dead_workers()

    @property
    def pinner(self) -> Optional[PinnedRing]:
        """The pool's pinned ring, if its batches are pinned in place."""
        return self._pinner

    def pin(self, runtime: DeviceRuntime) -> PinnedRing:
        """Register the ring as pinned memory with ``runtime`` (once per pool)."""
        if self._pinner is None:
            self._pinner = PinnedRing(self.ring, runtime)
            self.ledger.use_gate(self._pinner.gate)
        return self._pinner

    def debug_view(self) -> PoolView:
        """This pool as :func:`fastload.debug.debug_view` shows it."""
        pinner, lineage = self._pinner, self.lineage
        return PoolView(
            pids=self.pids,
            processes=tuple(self.procs),
            zygote_pid=lineage.current.pid if lineage is not None else None,
            ring=RingView(self.ring),
            pinned=pinner is not None,
            pin_failed=pinner.failed if pinner is not None else None,
            pinned_bytes=pinner.registered_bytes() if pinner is not None else 0,
            zygote_pids=(tuple(z.launched_pid for z in lineage.zygotes)
                         if lineage is not None else ()),
            preloaded=lineage is not None and lineage.preloaded is not None,
            inherited=tuple(lineage is not None and lineage.inherits(w)
                            for w in range(self.num_workers)),
        )

    @property
    def reusable(self) -> bool:
        """Whether a later iterator may start a session on this pool."""
        return self._inherited is None

    def session_tasks(self, parcel: Optional[parcels.Parcel], base_seed: int,
                      workers: Optional[List[int]] = None,
                      resume: Optional[List[Optional[bytes]]] = None,
                      preload_timeout: Optional[float] = None) -> Iterator[Tuple[int, bytes]]:
        """Make ready a session on every worker (or, for replacement workers,
        on those in ``workers``): its seeds, its objects and, to resume, the
        state to put its generators back to (``resume[w]``). Yields each
        worker and its session task, which the caller queues through the
        ledger (the one owner of slot assignment) before it takes the next:
        the task is what tells the worker to read what was sent on its
        channel. Close the generator if you stop early.

        The objects (``parcel``: the pickled dataset and the fds of what it
        shares) reach a worker by inheritance where they can: a whole
        session of a zygote pool forks fresh workers from a zygote that has
        unpickled ``parcel`` (``preload_timeout``: how long it may take), as
        does a replacement forked while it holds it; ``parcel`` is None for a
        pool whose workers were forked from this process with the objects.
        Other workers are sent ``parcel`` and unpickle it themselves."""
        targets = range(self.num_workers) if workers is None else workers
        states = resume if resume is not None else [None] * self.num_workers
        if parcel is None:
            assert self._inherited is not None
            for w in targets:
                yield w, encode_session(base_seed, True, states[w])
            return
        if workers is None and self._launcher == "zygote":
            self._fresh_workers(parcel, preload_timeout)
        fd = None
        try:
            for w in targets:
                if self.lineage is not None and self.lineage.inherits(w):
                    task = encode_session(base_seed, resume=states[w],
                                          preloaded=self.lineage.preloaded)
                else:
                    if fd is None:
                        fd = parcels.memfd_of(parcel.data)
                    self.ledger.make_free(1)
                    send_session(self.workers.channels[w], [fd, *parcel.fds])
                    task = encode_session(base_seed, False, states[w])
                yield w, task
        finally:
            if fd is not None:
                os.close(fd)

    def death_note(self, worker: int) -> str:
        """What worker ``worker`` wrote before dying at start-up, if anything."""
        return self.workers.death_note(worker)

    def worker_stack(self, worker: int, wait_s: float = 0.5) -> str:
        """The worker's Python stack, dumped by faulthandler on request."""
        return self.workers.stack(worker, wait_s)

    def dead_workers(self) -> List[Tuple[int, int, Optional[int]]]:
        """(worker id, pid, exit code) of every worker that has exited; the
        code is None for a forked worker whose status is lost
        (:func:`~fastload.pool.exits.exited_unseen`). Not under forkserver, whose
        exit codes arrive a moment after the worker is gone."""
        if self._retired:
            return []  # they exit on purpose
        return self.workers.exited(
            forked=self._launcher is None and self._ctx.get_start_method() == "fork")

    def shutdown(self, wait: bool = True) -> None:
        """Stop every worker (idempotent). ``wait=False``: kill them at once,
        without the grace period in which they would see the stop between
        two samples (they are stuck: the loader's ``timeout`` ran out)."""
        self._pinner = None
        self.ledger.forget()
        if not wait and self._finalizer.alive:
            try:
                self.workers.kill_all()
            except Exception:  # pragma: no cover - never let clean-up raise
                pass
        self._finalizer()

