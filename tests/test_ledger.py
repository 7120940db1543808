"""The slot ledger on its own: a ring in this process, its worker played by
the test (``support/ring_driver.py``), no worker process; overflow segments
sent on real socketpairs, and counted in ``/proc/self/fd``."""

from __future__ import annotations

from typing import Iterator

import pytest

from fastload import _core
from fastload.pool.ledger import Role, SlotLedger
from fastload.common.protocol import FLAG_OVERFLOW, Kind, encode_fetch
from support.processes import open_fds
from support.ring_driver import Channels, FakeWorker, new_ring


class Pool:
    """What a pool gives its ledger: a ring, its workers' channels and the
    overflow segments received on them."""

    def __init__(self, slots: int, workers: int) -> None:
        self.ring = new_ring(slots, workers)
        self.channels = Channels(workers)
        self.overflow = self.channels.segments
        self.ledger = SlotLedger(self.ring, self.overflow)

    def worker(self, w: int) -> FakeWorker:
        return FakeWorker(self.ring, w, self.channels.theirs[w])


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool(8, 2)
    yield p
    p.channels.close()


def test_a_batch_from_assignment_to_its_result(pool: Pool) -> None:
    ring, ledger = pool.ring, pool.ledger
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
    assert ledger.take(rec) is rec  # the reader's now
    assert not ledger.busy()
    ring.release(rec.slot)
    assert ring.free_slot_count() == ring.num_slots and ledger.accounted_for()


def test_a_session_is_freed_as_it_completes_and_takes_the_highest_slot(pool: Pool) -> None:
    ring, ledger = pool.ring, pool.ledger
    rec = ledger.assign(Role.SESSION, 0, b"session")
    assert rec.slot == ring.num_slots - 1
    w = FakeWorker(ring, 0)
    w.take()
    w.commit(rec.slot)
    assert ledger.wait(1.0) is rec
    assert ring.free_slot_count() == ring.num_slots and not ledger.busy()


def test_discarding_an_overflowed_batch_closes_its_segment(pool: Pool) -> None:
    ledger, ring = pool.ledger, pool.ring
    rec = ledger.assign(Role.BATCH, 0, b"t", idx=3)
    w = pool.worker(0)
    before = open_fds()
    w.take()
    w.send_segment(rec.seq)
    w.commit(rec.slot, Kind.DATA | FLAG_OVERFLOW)
    assert ledger.wait(1.0) is rec
    pool.overflow.collect(0)  # received: one more fd here
    assert len(open_fds() - before) == 1
    ledger.discard(rec)
    assert open_fds() <= before and not len(pool.overflow)
    assert ring.free_slot_count() == ring.num_slots


def test_a_result_is_read_once_into_its_record(pool: Pool) -> None:
    rec = pool.ledger.assign(Role.BATCH, 1, b"t", idx=0)
    w = pool.worker(1)
    w.take()
    w.commit(rec.slot, Kind.DATA, data_len=4096, make_ns=7, meta_off=4096, meta_len=100)
    assert pool.ledger.wait(1.0) is rec
    assert rec.result == (Kind.DATA, 4096, 4096, 100, 7)


def test_a_dead_worker_s_committed_orphans_are_freed_with_their_segments(pool: Pool) -> None:
    # An earlier iterator's batches, committed (one with a segment) but not
    # yet seen by the ledger when their worker is killed: the pool abandons
    # them, and the segment goes too, not only at the pool's end.
    ledger, ring = pool.ledger, pool.ring
    recs = [ledger.assign(Role.BATCH, 0, b"t", idx=i) for i in range(3)]
    ledger.orphan_batches()
    w = pool.worker(0)
    before = open_fds()
    for rec, kind in zip(recs[:2], (Kind.DATA | FLAG_OVERFLOW, Kind.DATA)):
        w.take()
        if kind & FLAG_OVERFLOW:
            w.send_segment(rec.seq)
        w.commit(rec.slot, kind)
    pool.overflow.collect(0)  # the pool empties a killed worker's channel
    ledger.abandon_worker(0)
    assert open_fds() <= before and not len(pool.overflow)
    assert not ledger.busy() and ring.free_slot_count() == ring.num_slots


def test_a_segment_sent_for_a_batch_never_committed_is_closed_when_it_is_reclaimed(
        pool: Pool) -> None:
    # The worker sent the segment and died before its commit: the batch is
    # made again under a new stamp, and the segment is nobody's.
    ledger = pool.ledger
    rec = ledger.assign(Role.BATCH, 0, b"t", idx=5)
    old_seq = rec.seq
    w = pool.worker(0)
    w.take()
    before = open_fds()
    w.send_segment(old_seq)
    pool.overflow.collect(0)  # the pool replaces the dead worker's channel
    assert len(pool.overflow) == 1
    assert ledger.reclaim_worker(0) == [rec]
    assert not len(pool.overflow) and open_fds() <= before
    ledger.reassign(rec, 1)
    assert rec.seq != old_seq


def test_an_ended_iterator_leaves_its_batches_in_flight_as_orphans(pool: Pool) -> None:
    ring, ledger = pool.ring, pool.ledger
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


def test_a_dead_worker_s_unfinished_batches_are_reclaimed_in_batch_order(pool: Pool) -> None:
    ring, ledger = pool.ring, pool.ledger
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


def test_a_slot_lost_track_of_is_noticed(pool: Pool) -> None:
    ring, ledger = pool.ring, pool.ledger
    assert ledger.accounted_for()
    ring.pop_free_slot()  # taken off the free list behind the ledger's back
    assert not ledger.accounted_for()


def test_waits_follow_records_that_come_go_and_complete_between_them(pool: Pool) -> None:
    """wait() keeps what it waits for between calls: each change of the
    records (a new task, a result, a discard, a reclaimed worker's batch
    queued again) is seen by the next wait."""
    ring, ledger = pool.ring, pool.ledger
    a = ledger.assign(Role.BATCH, 0, b"a", idx=0)
    assert ledger.wait(0.0) is None  # waits for a alone
    b = ledger.assign(Role.BATCH, 1, b"b", idx=1)
    w0, w1 = FakeWorker(ring, 0), FakeWorker(ring, 1)
    w1.take()
    w1.commit(b.slot)
    assert ledger.wait(1.0) is b  # b, assigned after the last wait, is waited for
    assert ledger.in_flight() == [a]
    assert ledger.wait(0.0) is None  # b, done, is not waited for again
    ledger.discard(b)
    w0.take()
    w0.commit(a.slot)
    assert ledger.wait(1.0) is a
    ledger.discard(a)
    assert ledger.wait(0.0) is None and not ledger.busy()
    c = ledger.assign(Role.BATCH, 0, b"c", idx=2)
    assert ledger.wait(0.0) is None
    ring.reset_worker(0)
    [redo] = ledger.reclaim_worker(0)
    assert redo is c and ledger.wait(0.0) is None and not ledger.busy()
    ledger.reassign(c, 1)  # queued again under a new stamp
    w1.take()
    w1.commit(c.slot)
    assert ledger.wait(1.0) is c and c.done
    ledger.discard(c)
    assert ring.free_slot_count() == ring.num_slots and ledger.accounted_for()
