"""The multi-process iterator (``fastload.iterator.multi_process``) with no worker
process: its pool is a fake (``support.fake_pool``) whose workers, played in
this process, make each batch from the loader's dataset when the iterator
waits, and which the test stalls or kills.

Batches in order whatever order the workers finish in (or the first ready
with ``in_order=False``), DataLoader's round robin, refills sent at the next
call so a loop holding one batch uses ``num_workers * prefetch_factor + 1``
slots, indices drawn when DataLoader draws them, the epoch's end (the pool
handed back warm at the last batch, then StopIteration), persistent
workers' epochs, a dataset's error re-raised with DataLoader's message, held
batches copied past ``held_batches`` and slots back when batches are
dropped, a dead worker's error at every later call.
"""

from __future__ import annotations

import gc
from typing import Iterator, List

import pytest
import torch
from torch.utils.data import Dataset, Sampler

from support import torch_versions
from support.datasets import Plain
from support.fake_pool import DrivenLoader, ring_slots

W = 2  # workers


def _values(batches: List[torch.Tensor]) -> List[List[int]]:
    return [b.tolist() for b in batches]


def _pairs(n: int) -> List[List[int]]:
    """An unshuffled epoch of ``Plain(n)`` with batch_size=2."""
    return [[i, i + 1] for i in range(0, n, 2)]


class CountingSampler(Sampler):
    """``range(n)`` in order, counting the indices drawn from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.drawn = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.drawn += 1
            yield i


class BadAt(Dataset):
    """``Plain``, except that ``dataset[bad]`` raises ValueError."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise ValueError(f"index {i} is bad")
        return torch.tensor(i)


def test_batches_come_in_order_whichever_worker_finishes_first() -> None:
    loader = DrivenLoader(Plain(12), batch_size=2, num_workers=W)
    it = iter(loader)
    pool = loader.pools[-1]
    pool.stalls[0] = 5  # worker 0 makes nothing in the iterator's first five waits
    assert _values(list(it)) == _pairs(12)
    assert sorted((f.batch, f.worker) for f in pool.fetches) == [(n, n % W) for n in range(6)]
    assert pool.fetches[0].worker == 1  # worker 1's batches were made first


@torch_versions.needs_in_order
def test_with_in_order_false_the_batch_made_first_comes_first() -> None:
    loader = DrivenLoader(Plain(12), batch_size=2, num_workers=W, in_order=False)
    it = iter(loader)
    loader.pools[-1].stalls[0] = 5
    got = _values(list(it))
    assert got[0] == [2, 3]  # worker 1's first batch
    assert sorted(got) == _pairs(12)


def test_a_loop_holding_its_batch_uses_workers_times_prefetch_plus_one_slots() -> None:
    """NOTE [ Ordering ]: a delivered batch's refill goes out at the next
    call, by when the loop dropped the batch before it; a ``for`` loop holds
    the last batch while it asks for the next."""
    loader = DrivenLoader(Plain(40), batch_size=2, num_workers=W, prefetch_factor=2)
    got = []
    for batch in loader:
        got.append(batch.tolist())
    assert got == _pairs(40)
    slots = {f.slot for f in loader.pools[-1].fetches}
    assert len(slots) == W * 2 + 1, sorted(slots)


def test_indices_are_drawn_when_dataloader_draws_them() -> None:
    """DataLoader draws ``num_workers * prefetch_factor`` batches at
    ``iter()`` and one more as it hands out each batch."""
    sampler = CountingSampler(40)
    loader = DrivenLoader(Plain(40), batch_size=2, sampler=sampler, num_workers=W,
                          prefetch_factor=2)
    it = iter(loader)
    assert sampler.drawn == 2 * W * 2
    for k in range(1, 8):
        next(it)
        assert sampler.drawn == 2 * (W * 2 + k), k


def test_the_epoch_ends_at_its_last_batch_and_the_pool_goes_back_warm() -> None:
    loader = DrivenLoader(Plain(8), batch_size=2, num_workers=W)
    it = iter(loader)
    got = [next(it) for _ in range(len(loader))]
    pool = loader.pools[0]
    # At the last batch, not at a StopIteration that Lightning's loop never asks for.
    assert pool.retired and loader.fastload_state.pools.idle_pool is pool
    assert loader.fastload_state.meter.stats().finished
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert _values(got) == _pairs(8)
    assert _values(list(loader)) == _pairs(8)  # the next epoch, on the same pool
    assert loader.pools == [pool] and len(pool.sessions) == 2 * W
    assert [f.epoch for f in pool.fetches] == [0] * 8  # a new session's epoch 0
    del got
    gc.collect()
    assert ring_slots(pool)["free"] == ring_slots(pool)["all"]


def test_persistent_workers_keep_their_session_and_their_epochs_follow_in_order() -> None:
    loader = DrivenLoader(Plain(24), batch_size=2, num_workers=W, persistent_workers=True,
                          prefetch_factor=2)
    it = iter(loader)
    assert _values([next(it), next(it)]) == _pairs(4)  # the loop breaks out of epoch 0
    assert _values(list(loader)) == _pairs(24)
    pool = loader.pools[-1]
    assert len(loader.pools) == 1 and len(pool.sessions) == W  # one session, all epochs
    epochs = [f.epoch for f in pool.fetches]
    assert epochs == sorted(epochs)  # epoch 0's tasks are all made before epoch 1's
    # Epoch 0 sent what DataLoader sends: the first W * 2, one per batch
    # delivered, and the refill owed at the break.
    assert epochs.count(0) == W * 2 + 2
    assert sorted(f.batch for f in pool.fetches if f.epoch == 1) == list(range(12))


def test_a_dataset_error_is_raised_with_dataloader_s_message_and_the_epoch_goes_on() -> None:
    sampler = CountingSampler(24)
    loader = DrivenLoader(BadAt(24, bad=3), batch_size=2, sampler=sampler, num_workers=W,
                          prefetch_factor=2)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(ValueError) as e:
        next(it)
    msg = str(e.value)
    assert msg.startswith("Caught ValueError in DataLoader worker process 1.")
    assert "Original Traceback" in msg and "index 3 is bad" in msg
    assert sampler.drawn == 2 * (W * 2 + 2)  # the failed batch's refill is drawn too
    assert _values(list(it)) == _pairs(24)[2:]
    pool = loader.pools[-1]
    assert ring_slots(pool)["free"] == ring_slots(pool)["all"]


def test_batches_held_past_held_batches_are_copies_and_slots_come_back_when_dropped() -> None:
    loader = DrivenLoader(Plain(16), batch_size=2, num_workers=W, options={"held_batches": 2})
    kept = list(loader)
    assert _values(kept) == _pairs(16)
    pool = loader.pools[-1]
    stats = loader.fastload_state.meter.stats()
    assert stats.copied_batches == len(kept) - 2
    assert ring_slots(pool)["leased"] == 2  # the first two view their slots
    del kept, stats
    gc.collect()
    assert ring_slots(pool) == {"free": pool.real_ring.num_slots, "leased": 0,
                                "all": pool.real_ring.num_slots}


def test_a_dead_worker_ends_the_epoch_with_dataloader_s_message_at_every_later_call() -> None:
    loader = DrivenLoader(Plain(12), batch_size=2, num_workers=W)
    it = iter(loader)
    pool = loader.pools[-1]
    pool.kill(1)  # before it made anything
    assert next(it).tolist() == [0, 1]  # made by worker 0
    with pytest.raises(RuntimeError) as e:
        next(it)
    msg = str(e.value)
    assert msg.startswith("DataLoader worker (pid 1001) is killed by signal: Killed.")
    assert "It was making batch(es) 1, 3 of this epoch" in msg
    assert pool.shut_down and loader.fastload_state.pools.idle_pool is None
    with pytest.raises(RuntimeError) as again:
        next(it)
    assert str(again.value) == msg
