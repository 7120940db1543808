"""Which worker makes the next batch, and which batch the loop gets next.

NOTE [ Ordering ]
Batch ``n`` goes to the next active worker in round-robin order, as in
DataLoader (some datasets rely on it), into the lowest free slot. Results
are handed out by batch number, not by slot, so a slot the loop still holds
never blocks a later batch. With ``prefetch_factor > 1`` the refill task of
a delivered batch is sent at the start of the next ``__next__``, when the
loop has dropped the batch before it, so the task can reuse that batch's
slot: the ring then commits ``num_workers * prefetch_factor + 1`` slots of
memory, not one more (a slot keeps its pages once written). Its index is
drawn when DataLoader draws it, so a sampler that raises does so with the
same batch.

:class:`TaskSchedule` is DataLoader's bookkeeping of
``_MultiProcessingDataLoaderIter`` (``_send_idx``, ``_rcvd_idx``,
``_task_info``, ``_workers_status``, ``_tasks_outstanding``, the worker
cycle) as one object that owns it. It never draws from the sampler: the
iterator draws and hands it the index, so that the sampler is drawn from
in DataLoader's order by one owner.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..pool.ledger import Record, Role, SlotLedger
from ..common.protocol import Kind, encode_fetch


class Due(enum.Enum):
    """What :meth:`TaskSchedule.due` found for the loop's next batch."""

    READY = enum.auto()  # its result is in: deliver it
    WAIT = enum.auto()  # its task is out: wait for a result
    END = enum.auto()  # no batch is left this epoch


class Arrival(enum.Enum):
    """What to do with a result that arrived (:meth:`TaskSchedule.arrived`)."""

    DELIVER = enum.auto()  # hand it to the loop now
    LATER = enum.auto()  # kept (in its slot, or freed); wait on
    REPLICA_ENDED = enum.auto()  # an IterableDataset replica ended: send another task


class TaskSchedule:
    """The tasks of one iterator's epochs: sent round-robin, received in order.

    ``ledger``: the pool's slot ledger, which gives each task its slot;
    ``capacity``: the most workers the iterator may use; the count in use
    (:attr:`num_workers`) is set by :meth:`reset` and changed by
    :meth:`grow` and :meth:`shrink`.
    """

    def __init__(self, ledger: SlotLedger, capacity: int, prefetch_factor: int,
                 in_order: bool) -> None:
        self._ledger = ledger
        self.capacity = capacity
        self.prefetch_factor = prefetch_factor
        self.in_order = in_order
        self.num_workers = 0
        self.next_worker = 0  # the worker the round-robin reaches next
        self.sampler_done = False  # the sampler ran out this epoch
        self._cycle: Iterable[int] = iter(())
        self._send_idx = 0
        self._rcvd_idx = 0
        self._tasks: Dict[int, Record] = {}  # batch number -> its task's record
        self._outstanding = 0
        self._owed: List[Any] = []  # indices drawn for tasks not sent yet
        self._active: List[bool] = []  # per worker: its replica has not ended
        self._per_worker: List[int] = []  # per worker: tasks it holds
        self._retiring: List[int] = []  # workers to retire once their tasks are in
        self._skip: set = set()  # batch numbers delivered before a resume

    # ---- epochs ------------------------------------------------------------
    def reset(self, num_workers: int, *, first_batch: int = 0, first_worker: int = 0,
              active: Optional[Sequence[bool]] = None, skip: Iterable[int] = ()) -> None:
        """A new epoch over ``num_workers`` workers: batch ``first_batch``
        (after a resume, the first undelivered one) goes to ``first_worker``;
        ``active``: which replicas have not ended (all, unless resumed);
        ``skip``: later batch numbers delivered before the resume."""
        self.num_workers = num_workers
        self._send_idx = self._rcvd_idx = first_batch
        self._tasks = {}
        self._outstanding = 0
        self._owed = []
        self.sampler_done = False
        self._active = ([True] * self.capacity if active is None else
                        (list(active) + [True] * self.capacity)[: self.capacity])
        self._per_worker = [0] * self.capacity
        self._retiring = []
        self._skip = set(skip)
        self._restart_cycle(first_worker)

    @property
    def max_tasks(self) -> int:
        return self.prefetch_factor * self.num_workers

    @property
    def retiring(self) -> bool:
        """Workers are being retired (:meth:`shrink`) and still hold tasks."""
        return bool(self._retiring)

    @property
    def drained(self) -> bool:
        """The epoch's last batch has been handed out: nothing drawn is owed
        or out, and the sampler ran out."""
        return (self.sampler_done and not self._tasks and not self._owed
                and self._outstanding == 0)

    @property
    def outstanding(self) -> int:
        return self._outstanding

    # ---- sending -----------------------------------------------------------
    def check_room(self) -> None:
        """DataLoader's check before it sends a task."""
        if self._outstanding >= self.max_tasks and not self._retiring:
            raise AssertionError("Number of outstanding tasks exceeded maximum allowed tasks")

    def send(self, index: Any, epoch: int) -> None:
        """DataLoader's ``_try_put_index`` once the index is drawn: the task
        for ``index`` goes to the next active worker (dropped if none is:
        every replica ended). Past the limit (workers being retired still
        hold tasks beyond the new count's share) it waits, in order."""
        if self._outstanding >= self.max_tasks:
            self._owed.insert(0, index)
            return
        for _ in range(self.num_workers):  # find the next active worker, if any
            worker = next(self._cycle)  # type: ignore[call-overload]
            self.next_worker = (worker + 1) % self.num_workers
            if self._active[worker]:
                if self.in_order:
                    break
                elif self._per_worker[worker] < self.max_tasks // sum(
                        self._active[: self.num_workers]):
                    break
        else:
            return
        while self._send_idx in self._skip:  # delivered before a resume
            self._skip.discard(self._send_idx)
            self._send_idx += 1
        rec = self._ledger.assign(Role.BATCH, worker, encode_fetch(epoch, self._send_idx, index),
                                  idx=self._send_idx, index=index)
        self._tasks[self._send_idx] = rec
        self._per_worker[worker] += 1
        self._outstanding += 1
        self._send_idx += 1

    def owe(self, index: Any) -> None:
        """A delivered batch's refill, its index drawn now; sent by
        :meth:`pay` at the next ``__next__`` (NOTE [ Ordering ])."""
        self._owed.append(index)

    def pay(self, epoch: int) -> None:
        """Send the deferred tasks, as many as the worker count allows."""
        while self._owed and self._outstanding < self.max_tasks:
            self.send(self._owed.pop(0), epoch)

    # ---- receiving ---------------------------------------------------------
    def due(self) -> Tuple[Due, Optional[Record]]:
        """The loop's next batch: its record, and whether it is in, out, or
        whether the epoch is over. Tasks of replicas that ended with no
        result are passed over."""
        while self._rcvd_idx < self._send_idx:
            rec = self._tasks.get(self._rcvd_idx, None)
            if rec:
                if rec.done or self._active[rec.worker]:
                    break
                del self._tasks[self._rcvd_idx]  # its EXHAUSTED result is freed on arrival
            self._rcvd_idx += 1
        else:
            return Due.END, None
        rec = self._tasks[self._rcvd_idx]
        if rec.done:
            del self._tasks[self._rcvd_idx]
            self._rcvd_idx += 1
            return Due.READY, rec
        return Due.WAIT, rec

    def arrived(self, rec: Record) -> Arrival:
        """A task's result came in: deliver it now, keep it for its turn
        (or free it: nobody wants it), or a replica ended."""
        self._outstanding -= 1
        if rec.kind == Kind.EXHAUSTED:
            self._ledger.discard(rec)
            if self._tasks.get(rec.idx) is rec:
                del self._tasks[rec.idx]
            if self._active[rec.worker]:
                self._active[rec.worker] = False
                return Arrival.REPLICA_ENDED
            return Arrival.LATER
        if self._tasks.get(rec.idx) is not rec:
            self._ledger.discard(rec)  # a task passed over: nobody wants it
            return Arrival.LATER
        if rec.idx != self._rcvd_idx:
            if not self.in_order:
                del self._tasks[rec.idx]
                return Arrival.DELIVER
            return Arrival.LATER  # stays in its slot until its turn
        del self._tasks[rec.idx]
        self._rcvd_idx += 1
        return Arrival.DELIVER

    def handed_out(self, rec: Record) -> None:
        """``rec``'s batch is being handed out: its worker holds one task less."""
        self._per_worker[rec.worker] -= 1

    def release_unclaimed(self) -> None:
        """Free the slots of results nobody will take (their batches were
        skipped: the loop broke out of the epoch)."""
        for rec in self._tasks.values():
            if rec.done:
                self._ledger.discard(rec)
        self._tasks = {}

    # ---- the worker count (num_workers="auto") -----------------------------
    def grow(self, new: int, added: Sequence[int]) -> None:
        """``new`` workers from now on, ``added`` among them: the round-robin
        goes on over them where it was."""
        for w in added:
            self._active[w] = True
        self.num_workers = new
        self._restart_cycle(self.next_worker % new)

    def shrink(self, new: int) -> None:
        """No more tasks for the workers past ``new``; they are retired once
        their batches are in (:meth:`retired`)."""
        self._retiring = list(range(new, self.num_workers))
        self.num_workers = new
        self._restart_cycle(self.next_worker % new)

    def retired(self) -> bool:
        """Whether the workers being retired hold no task any more: they can
        go (then :meth:`end_retirement`), and the tasks that waited for them
        can be sent."""
        return bool(self._retiring) and not any(self._per_worker[w] for w in self._retiring)

    def end_retirement(self) -> None:
        """The retired workers are gone."""
        self._retiring = []

    # ---- resume ------------------------------------------------------------
    def position(self, first_undelivered: int) -> Tuple[int, List[bool]]:
        """Where a resumed epoch would start: the worker that batch
        ``first_undelivered`` goes to, and which replicas are active. A
        replica seen to end that still has undelivered batches is active:
        it makes them again, then ends."""
        rec = self._tasks.get(first_undelivered)
        worker = rec.worker if rec is not None else self.next_worker
        active = [self._active[w] or any(r.worker == w for r in self._tasks.values())
                  for w in range(self.num_workers)]
        return worker, active

    def _restart_cycle(self, first: int) -> None:
        n = self.num_workers
        self._cycle = itertools.cycle([*range(first, n), *range(first)])
