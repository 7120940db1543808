"""The slot ledger on its own: a ring in this process, its worker played by
the test (``support/ring_driver.py``), no worker process."""

from __future__ import annotations

from typing import List, Tuple

from fastload import _core
from fastload.ledger import Role, SlotLedger
from fastload.wire import FLAG_OVERFLOW, Kind, encode_fetch
from support.ring_driver import FakeWorker, new_ring


def _ledger(slots: int = 8, workers: int = 2) -> Tuple[_core.Ring, SlotLedger, List[Tuple[int, int]]]:
    ring = new_ring(slots, workers)
    closed: List[Tuple[int, int]] = []
    return ring, SlotLedger(ring, lambda w, seq: closed.append((w, seq))), closed


def test_a_batch_from_assignment_to_its_result() -> None:
    ring, ledger, _ = _ledger()
    rec = ledger.assign(Role.BATCH, 1, encode_fetch(0, 0, [0, 1]), idx=0, index=[0, 1])
    assert rec.slot == 0  # batches take the lowest free slot
    assert ledger.busy() and ledger.in_flight() == [rec] and not rec.done
    assert ledger.wait(0.0) is None  # nothing committed yet
    w = FakeWorker(ring, 1)
    assert w.take() == (rec.slot, rec.seq)
    w.commit(rec.slot, Kind.DATA, make_ns=12345)
    got = ledger.wait(1.0)
    assert got is rec and rec.done and rec.kind == Kind.DATA and rec.make_ns == 12345
    assert ring.state(rec.slot) == _core.SlotState.READY and ledger.accounted_for()
    ledger.taken(rec)  # the reader's now
    assert not ledger.busy()
    ring.release(rec.slot)
    assert ring.free_slot_count() == ring.num_slots and ledger.accounted_for()


def test_a_session_is_freed_as_it_completes_and_takes_the_highest_slot() -> None:
    ring, ledger, _ = _ledger()
    rec = ledger.assign(Role.SESSION, 0, b"session")
    assert rec.slot == ring.num_slots - 1
    w = FakeWorker(ring, 0)
    w.take()
    w.commit(rec.slot)
    assert ledger.wait(1.0) is rec
    assert ring.free_slot_count() == ring.num_slots and not ledger.busy()


def test_discarding_an_overflowed_batch_closes_its_segment() -> None:
    ring, ledger, closed = _ledger()
    rec = ledger.assign(Role.BATCH, 0, b"t", idx=3)
    w = FakeWorker(ring, 0)
    w.take()
    w.commit(rec.slot, Kind.DATA | FLAG_OVERFLOW)
    ledger.wait(1.0)
    ledger.discard(rec)
    assert closed == [(0, rec.seq)] and ring.free_slot_count() == ring.num_slots


def test_an_ended_iterator_leaves_its_batches_in_flight_as_orphans() -> None:
    ring, ledger, _ = _ledger()
    a = ledger.assign(Role.BATCH, 0, b"a", idx=0)
    b = ledger.assign(Role.BATCH, 1, b"b", idx=1)
    w0 = FakeWorker(ring, 0)
    w0.take()
    w0.commit(a.slot)
    ledger.wait(1.0)  # a is done, b is not
    ledger.orphan_batches()
    assert ring.state(a.slot) == _core.SlotState.FREE  # a done batch nobody wants: freed
    assert b.role is Role.ORPHAN and ledger.busy()
    w1 = FakeWorker(ring, 1)
    w1.take()
    w1.commit(b.slot)
    ledger.drain(lambda: ledger.wait(1.0))  # the next iterator waits it out
    assert ring.free_slot_count() == ring.num_slots and ledger.accounted_for()


def test_a_dead_worker_s_unfinished_batches_are_reclaimed_in_batch_order() -> None:
    ring, ledger, _ = _ledger()
    recs = [ledger.assign(Role.BATCH, 0, f"t{i}".encode(), idx=i) for i in (4, 2, 6)]
    w0 = FakeWorker(ring, 0)
    first = w0.take()
    assert first is not None
    w0.commit(first[0])  # batch 4 made; then the worker dies holding batch 2
    w0.take()
    redo = ledger.reclaim_worker(0)
    assert [r.idx for r in redo] == [2, 6]
    assert ring.state(recs[0].slot) == _core.SlotState.READY  # what it committed stays
    for r in redo:
        ledger.reassign(r, 1)
    w1 = FakeWorker(ring, 1)
    for r in redo:  # the replacement gets them, under new stamps, in their own slots
        assert w1.take() == (r.slot, r.seq)
        w1.commit(r.slot)
    got = {ledger.wait(1.0).idx for _ in range(3)}  # type: ignore[union-attr]
    assert got == {2, 4, 6}


def test_a_slot_lost_track_of_is_noticed() -> None:
    ring, ledger, _ = _ledger()
    assert ledger.accounted_for()
    ring.pop_free_slot()  # taken off the free list behind the ledger's back
    assert not ledger.accounted_for()
