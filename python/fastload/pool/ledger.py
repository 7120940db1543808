"""The slot ledger: which slot is doing what, one record per slot.

NOTE [ Slot lifetime ]
A slot leaves the ring's free list for one of three jobs, and the ledger
holds one :class:`Record` for it until it goes back:

* ``BATCH``: a task of the current iterator. It is *in flight* until its
  worker commits a result, then *done* (READY in the ring) until the
  iterator takes it (the slot is then leased to the training loop, and the
  record ends: the lease's last view frees the slot) or discards it unread.
* ``SESSION``: the task that starts a session on a worker. Freed by the
  ledger as soon as the worker commits it.
* ``ORPHAN``: a batch an earlier iterator of the same pool left in flight
  (the loop broke out of the epoch). Nobody wants it, but its worker may be
  writing it, so the slot is freed only once the result is in, or once its
  worker is dead (a zygote pool kills such workers as the iterator hands
  it back, rather than wait for them: :meth:`SlotLedger.abandon_worker`).

So every slot is free, leased to the loop, held for a device copy (pinned
memory), or in the ledger: :meth:`SlotLedger.accounted_for` checks exactly
that before a pool is reused. Sequence numbers (stamps) are the ledger's and
never repeat within a pool, so a result is always matched to the task that
asked for it.

The ledger changes only its own records and the ring; it never calls back
into the iterator. Its waits return what completed and the caller decides.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Dict, Iterator, List, Optional

from .. import _core
from ..device.pinning import ReleaseGate
from ..transport.overflow import OverflowSegments
from ..common.protocol import FLAG_OVERFLOW


class Role(enum.Enum):
    BATCH = "batch"
    SESSION = "session"
    ORPHAN = "orphan"


class Record:
    """One slot out of the free list: its job, stamp, worker and, for a batch,
    what it is (``idx``: batch number in the epoch, ``index``: the sampler's
    output, ``task``: the encoded task, kept so it can be sent again)."""

    __slots__ = ("role", "seq", "worker", "slot", "idx", "index", "task", "kind", "done",
                 "make_ns", "result")

    def __init__(self, role: Role, seq: int, worker: int, slot: int, idx: int = -1,
                 index: Any = None, task: bytes = b"") -> None:
        self.role = role
        self.seq = seq
        self.worker = worker
        self.slot = slot
        self.idx = idx
        self.index = index
        self.task = task
        self.kind = -1  # once done: the result's Kind, maybe with FLAG_OVERFLOW (fastload.common.protocol)
        self.done = False
        self.make_ns = 0  # once done: what its worker says making it took
        # Once done: the ring's result, (kind, data_len, meta_off, meta_len,
        # make_ns), read once; the reader finds the batch's bytes by it.
        self.result: Optional[tuple] = None


class SlotLedger:
    """The records of one pool's ring (see NOTE [ Slot lifetime ]).

    ``overflow`` holds the overflow segments the pool's workers send: a
    batch freed unread, or taken back from a dead worker, has its segment
    closed there.
    """

    def __init__(self, ring: _core.Ring, overflow: OverflowSegments) -> None:
        self._ring = ring
        self._overflow = overflow
        self._records: Dict[int, Record] = {}  # seq -> record, in stamp order
        self._seq = 0
        self._gate: Optional[ReleaseGate] = None  # a pinned ring's

    # ---- handing out slots ---------------------------------------------------
    def use_gate(self, gate: ReleaseGate) -> None:
        """Slots released while device copies from them are pending wait in
        ``gate``; the ledger asks it for slots when the free list runs short."""
        self._gate = gate

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def make_free(self, n: int) -> None:
        """Have at least ``n`` free slots if slots held for device copies can
        give them: those whose copies are done first, then the oldest."""
        gate = self._gate
        if gate is None or not len(gate):
            return
        gate.collect()
        while self._ring.free_slot_count() < n and gate.wait_one():
            pass

    def assign(self, role: Role, worker: int, task: bytes, idx: int = -1,
               index: Any = None) -> Record:
        """Queue ``task`` for ``worker`` in a free slot (a batch takes the
        lowest, a session the highest, so batches keep to the fewest slots)."""
        self.make_free(1)
        slot = self._ring.pop_free_slot(highest=role is Role.SESSION)
        if slot is None:  # cannot happen: the ring has a slot per possible task + held ones
            raise AssertionError(f"fastload: no free slot for a {role.value} task")
        rec = Record(role, self._next_seq(), worker, slot, idx, index, task)
        # Recorded before the assign: a KeyboardInterrupt delivered right after
        # it must not leave a task in flight that nobody waits for.
        self._records[rec.seq] = rec
        try:
            self._ring.assign(slot, rec.seq, worker, task)
        except BaseException:
            if self._ring.state(slot) == _core.SlotState.FREE:  # not handed out: undo
                del self._records[rec.seq]
                self._ring.push_free_slot(slot)
            raise
        return rec

    # ---- results -------------------------------------------------------------
    def in_flight(self) -> List[Record]:
        """Records with no result yet, in stamp order."""
        return [r for r in self._records.values() if not r.done]

    def busy(self) -> bool:
        return any(not r.done for r in self._records.values())

    def wait(self, timeout: float) -> Optional[Record]:
        """Wait up to ``timeout`` s (``math.inf``: no limit) for any in-flight
        record's result.

        A finished session or orphan is freed here and returned (the caller
        ignores it); a finished batch is marked done, its kind set, and
        returned for the caller to take or discard. None: timed out, or a
        worker the pool watches died (the ring's wait returns at once; the
        caller looks at its workers either way).
        """
        waiting = self.in_flight()
        if not waiting:
            return None
        status, which = self._ring.wait_any([r.slot for r in waiting],
                                            [r.seq for r in waiting], timeout)
        if status != _core.WaitResult.READY:
            return None
        rec = waiting[which]
        self._settle(rec)
        if rec.role is not Role.BATCH:
            self.discard(rec)
        return rec

    def _settle(self, rec: Record) -> None:
        """``rec``'s slot is READY: read its result into it, and mark it done."""
        result = rec.result = self._ring.result(rec.slot)
        rec.kind, rec.make_ns = result[0], result[4]
        rec.done = True

    def drain(self, wait: Callable[[], Optional[Record]]) -> None:
        """Wait out every in-flight record (``wait``: the caller's own, which
        also watches the workers), discarding the batches."""
        while self.busy():
            rec = wait()
            if rec is not None and rec.role is Role.BATCH:
                self.discard(rec)

    def discard(self, rec: Record) -> None:
        """Free a done record's slot unread (and its overflow segment, if it has one)."""
        self._records.pop(rec.seq, None)
        if rec.done and rec.kind & FLAG_OVERFLOW:
            self._overflow.discard(rec.worker, rec.seq)
        self._ring.release(rec.slot)

    def take(self, rec: Record) -> Record:
        """Hand done batch ``rec`` over to be read: its slot is from now on
        the reader's to lease or free, and no longer the ledger's."""
        self._records.pop(rec.seq, None)
        return rec

    # ---- iterators and pools -------------------------------------------------
    def orphan_batches(self) -> None:
        """The iterator ends with batches in flight: keep them as orphans for
        the next iterator of this pool to wait out. Done ones are freed."""
        for rec in list(self._records.values()):
            if rec.role is Role.BATCH:
                if rec.done:
                    self.discard(rec)
                else:
                    rec.role = Role.ORPHAN

    def forget(self) -> None:
        """The pool is stopping: nothing will be waited for any more."""
        self._records.clear()

    def accounted_for(self) -> bool:
        """Every slot is free, leased by the loop, or in the ledger.

        False when an interrupted iterator (a KeyboardInterrupt between two
        bookkeeping steps) lost track of one: such a pool is not reused.
        """
        ring = self._ring
        leased = sum(ring.state(i) == _core.SlotState.LEASED for i in range(ring.num_slots))
        return ring.free_slot_count() + leased + len(self._records) == ring.num_slots

    def live_leases(self) -> int:
        """Slots leased to the training loop (batches it still holds)."""
        held = len(self._gate) if self._gate is not None else 0  # waiting for device copies
        return self._ring.num_slots - self._ring.free_slot_count() - len(self._records) - held

    def trim_free(self, keep: int) -> int:
        """Give back the pages of every free slot past its first ``keep``
        bytes (a slot keeps its pages once written: one outlier batch would
        otherwise pin its size for good); returns the bytes released. Not
        for a pinned ring, whose pages are registered with the device."""
        if self._gate is not None:
            return 0
        return sum(self._ring.trim_free_slot(s, keep) for s in range(self._ring.num_slots))

    # ---- one worker ----------------------------------------------------------
    def of_worker(self, worker: int) -> Iterator[Record]:
        return (r for r in self._records.values() if r.worker == worker)

    def get(self, seq: Optional[int]) -> Optional[Record]:
        return self._records.get(seq) if seq is not None else None

    def oldest_queued(self, worker: int) -> Optional[int]:
        """The stamp of the oldest in-flight record of ``worker`` (its
        session comes first: sessions are assigned before its batches)."""
        seqs = [r.seq for r in self._records.values() if r.worker == worker and not r.done]
        return min(seqs) if seqs else None

    def reclaim_worker(self, worker: int) -> List[Record]:
        """Take back the slots of a dead worker's unfinished records.

        Results it committed stay (their slots are READY with its stamp).
        Unfinished sessions and orphans are freed; unfinished batches are
        returned, in batch order, for :meth:`reassign`. The pool has
        collected the worker's channel first: an overflow segment it sent
        for a batch it never committed is closed.
        """
        redo = []
        for rec in sorted(self.of_worker(worker), key=lambda r: (r.role is Role.BATCH, r.idx)):
            if rec.done or self._ring.is_ready(rec.slot, rec.seq) or not self._ring.reclaim(rec.slot):
                continue
            del self._records[rec.seq]
            self._overflow.forget(rec.seq)
            if rec.role is Role.BATCH:
                redo.append(rec)
            else:
                self._ring.push_free_slot(rec.slot)
        return redo

    def abandon_worker(self, worker: int) -> None:
        """Free the slots of every record of a dead worker that nobody will
        read (an earlier iterator's orphans), committed or not, and their
        overflow segments (the pool has collected its channel first)."""
        for rec in sorted(self.of_worker(worker), key=lambda r: r.seq):
            if not rec.done and self._ring.is_ready(rec.slot, rec.seq):
                self._settle(rec)  # its kind says whether a segment came with it
            if rec.done:
                self.discard(rec)
                continue
            del self._records[rec.seq]
            self._overflow.forget(rec.seq)
            if self._ring.reclaim(rec.slot):  # unfinished: back to the free list
                self._ring.push_free_slot(rec.slot)

    def reassign(self, rec: Record, worker: int) -> None:
        """Queue a reclaimed batch again, in its own slot, under a new stamp."""
        rec.seq = self._next_seq()
        rec.worker = worker
        self._records[rec.seq] = rec
        self._ring.assign(rec.slot, rec.seq, worker, rec.task)

