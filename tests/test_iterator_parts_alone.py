"""The multi-process iterator's parts, each on its own: the task schedule
over a real slot ledger whose workers the test plays, the resume cursor
over a plain sampler, and the worker-count controller's choice of counts.
(The whole iterator over a fake pool is ``test_iterator.py``.)"""

from __future__ import annotations

from typing import Iterator, List, Optional

import pytest
from torch.utils.data import BatchSampler, SequentialSampler, _DatasetKind

from fastload.iterator.auto_count import AutoCount
from fastload.iterator.loader_runtime import LoaderOptions
from fastload.iterator.resume_cursor import ResumeCursor
from fastload.iterator.schedule import Arrival, Due, TaskSchedule
from fastload.pool.ledger import SlotLedger
from fastload.resume import book
from fastload.common.protocol import Kind, decode_task
from support.ring_driver import Channels, FakeWorker, new_ring


class Ring:
    def __init__(self, workers: int = 2) -> None:
        self.ring = new_ring(16, workers)
        self.channels = Channels(workers)
        self.ledger = SlotLedger(self.ring, self.channels.segments)
        self.workers = [FakeWorker(self.ring, w) for w in range(workers)]

    def make(self, w: int, kind: int = Kind.DATA) -> int:
        """Worker ``w`` takes its next task and commits it; returns its batch number."""
        got = self.workers[w].next_task()
        assert got is not None, f"worker {w} has no task"
        slot, _seq, task = got
        self.workers[w].commit(slot, kind)
        return task.batch_idx  # type: ignore[union-attr]

    def close(self) -> None:
        self.channels.close()
        # pytest keeps the fixture's value past the leak check: let go of the ring.
        del self.ring, self.ledger, self.workers


@pytest.fixture
def ring() -> Iterator[Ring]:
    r = Ring()
    yield r
    r.close()


def _next_batch(schedule: TaskSchedule, ring: Ring) -> Optional[int]:
    """What the iterator's ``next()`` does with its schedule: the number of
    the batch handed out next (None: the epoch is over)."""
    while True:
        due, rec = schedule.due()
        if due is Due.END:
            return None
        if due is Due.READY:
            assert rec is not None
            schedule.handed_out(rec)
            return rec.idx
        got = ring.ledger.wait(1.0)
        assert got is not None, "no result came"
        if schedule.arrived(got) is Arrival.DELIVER:
            schedule.handed_out(got)
            return got.idx


def _fill(schedule: TaskSchedule, indices: List[int]) -> None:
    for i in indices:
        schedule.check_room()
        schedule.send([i], epoch=0)


def test_tasks_go_round_robin_and_batches_come_in_order(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=2, in_order=True)
    schedule.reset(2)
    _fill(schedule, [0, 1, 2, 3])
    assert schedule.outstanding == 4
    with pytest.raises(AssertionError, match="exceeded maximum"):
        schedule.check_room()
    assert ring.make(1) == 1  # worker 1 finishes batch 1 first
    due, rec = schedule.due()
    assert due is Due.WAIT and rec is not None and rec.idx == 0
    later = ring.ledger.wait(1.0)
    assert later is not None and schedule.arrived(later) is Arrival.LATER  # kept for its turn
    assert ring.make(0) == 0
    first = ring.ledger.wait(1.0)
    assert first is not None and schedule.arrived(first) is Arrival.DELIVER and first.idx == 0
    schedule.handed_out(first)
    due, rec = schedule.due()
    assert due is Due.READY and rec is later  # its turn now, already in
    assert schedule.position(2) == (0, [True, True])  # batch 2 is worker 0's


def test_out_of_order_delivery_hands_out_what_comes(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=1, in_order=False)
    schedule.reset(2)
    _fill(schedule, [0, 1])
    ring.make(1)
    rec = ring.ledger.wait(1.0)
    assert rec is not None and schedule.arrived(rec) is Arrival.DELIVER and rec.idx == 1


def test_an_ended_replica_is_passed_over_and_the_epoch_ends(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=1, in_order=True)
    schedule.reset(2)
    _fill(schedule, [0, 1])
    ring.make(0, Kind.EXHAUSTED)
    rec = ring.ledger.wait(1.0)
    assert rec is not None and schedule.arrived(rec) is Arrival.REPLICA_ENDED
    _fill(schedule, [2])  # the iterator sends another: it goes to the active worker
    assert ring.make(1) == 1 and ring.make(1) == 2
    assert [_next_batch(schedule, ring), _next_batch(schedule, ring)] == [1, 2]  # 0 passed over
    schedule.sampler_done = True
    assert _next_batch(schedule, ring) is None and schedule.drained


def test_refills_owed_are_paid_within_the_limit(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=1, in_order=True)
    schedule.reset(2)
    _fill(schedule, [0, 1])
    schedule.owe([2])
    schedule.pay(epoch=0)
    assert schedule.outstanding == 2 and not schedule.drained  # no room: still owed
    ring.make(0)
    rec = ring.ledger.wait(1.0)
    assert rec is not None and schedule.arrived(rec) is Arrival.DELIVER
    schedule.handed_out(rec)
    schedule.pay(epoch=0)
    assert schedule.outstanding == 2
    got = ring.workers[0].next_task()
    assert got is not None and got[2].index == [2]  # type: ignore[union-attr]


def test_a_shrinking_count_retires_workers_once_their_tasks_are_in(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=1, in_order=True)
    schedule.reset(2)
    _fill(schedule, [0, 1])
    schedule.shrink(1)
    assert schedule.num_workers == 1 and schedule.retiring and not schedule.retired()
    ring.make(1)
    ring.make(0)
    assert [_next_batch(schedule, ring), _next_batch(schedule, ring)] == [0, 1]
    assert schedule.retired() and schedule.retiring  # until the caller has them go
    schedule.end_retirement()
    assert not schedule.retiring and not schedule.retired()
    _fill(schedule, [2])
    assert ring.workers[0].next_task() is not None  # only worker 0 gets tasks now


def test_a_resumed_epoch_skips_batches_delivered_before(ring: Ring) -> None:
    schedule = TaskSchedule(ring.ledger, capacity=2, prefetch_factor=1, in_order=True)
    schedule.reset(2, first_batch=3, first_worker=1, skip=[4])
    _fill(schedule, [30, 50])
    got = [ring.workers[w].next_task() for w in (1, 0)]
    assert [(t[2].batch_idx, t[2].index) for t in got] == [(3, [30]), (5, [50])]  # type: ignore


def test_the_resume_cursor_skips_delivered_indices() -> None:
    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    cursor = ResumeCursor(2, None, {"first_iter": True})
    assert cursor.begin_epoch(None, 0, first_iter=True) is False
    cursor.enter_epoch(0)
    it = iter(sampler)
    assert [cursor.draw(it) for _ in range(2)] == [[0, 1], [2, 3]]
    cursor.taken(0, 0, None, 0)
    state = cursor.state(yielded=1, finished=False, persistent=False, base_seed=7,
                         num_workers=2, position=lambda first: (first % 2, [True, True]))
    assert state["position"] == 1 and state["next_worker"] == 1 and state["base_seed"] == 7


@pytest.mark.parametrize("auto", [False, True])
def test_the_count_controller_starts_where_it_should(auto: bool) -> None:
    options = LoaderOptions(auto_workers=auto)
    start, cap, controller = AutoCount.choose(
        options, 3, _DatasetKind.Map, 2, lambda shm: 1 << 20, None, None)
    if not auto:
        assert (start, cap, controller) == (3, 3, None)
    else:
        assert controller is not None and 1 <= start <= cap
    start, cap, controller = AutoCount.choose(
        options, 3, _DatasetKind.Map, 2, lambda shm: 1 << 20, {"workers_in_use": 5}, None)
    assert start == (5 if auto else 3)
    start, cap, controller = AutoCount.choose(
        options, 3, _DatasetKind.Iterable, 2, lambda shm: 1 << 20, None, 4)
    assert controller is None and start == cap == (4 if auto else 3)  # replicas shard by it


def test_a_resumed_epochs_skips_end_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indices dropped because their batches were delivered before a resume
    are dropped in the resumed epoch only, even when the loop broke out of
    it before reaching them."""
    sampler = BatchSampler(SequentialSampler(range(20)), batch_size=2, drop_last=False)
    saved = {"position": 1, "delivered_ahead": [3], "epoch_start": {"first_iter": False},
             "workers_active": [True, True], "next_worker": 1}
    monkeypatch.setattr(book, "draw_as_usual", lambda sampler_iter: None)
    monkeypatch.setattr(book, "Replay", lambda start: type("R", (), {"rewind": lambda s, l: None})())
    cursor = ResumeCursor(2, saved, None)
    ff = cursor.fast_forward(None, iter(sampler), sampler)
    assert (ff.first_batch, ff.skip, ff.yielded) == (1, (3,), 2)
    it = ff.sampler_iter
    assert [cursor.draw(it) for _ in range(2)] == [[2, 3], [4, 5]]  # then the loop broke out
    monkeypatch.setattr(book, "epoch_start", lambda loader, seed, first: {})
    assert cursor.begin_epoch(None, 0, first_iter=False) is False  # the next epoch
    it = iter(sampler)
    assert [cursor.draw(it) for _ in range(5)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
