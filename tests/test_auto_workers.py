"""``num_workers="auto"``: the loader picks its worker count as it runs.

Whatever the count does, DataLoader's guarantees hold: every index once per
epoch, in the sampler's order; each worker seeded ``base_seed + id`` and
``worker_init_fn`` run in it, as a fresh DataLoader worker is; resume
exact in its indices. The rule itself is tested on made-up windows in
``test_autoscale.py``; here it runs on real workers.
"""

from __future__ import annotations

import logging
import time
from typing import Any, List

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import fastload
from fastload import FastLoader
from fastload.stats.autoscale import cores_available, initial_workers
from support.datasets import Plain, SlowProbe

START = initial_workers(cores_available())


def _epoch(loader: Any, step_s: float = 0.0) -> List[Any]:
    """An epoch's batches as plain Python data (a training loop keeps no
    batch: holding them all would make the loader copy them out)."""
    out = []
    for b in loader:
        out.append({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                   if isinstance(b, dict) else b.tolist())
        del b
        if step_s:
            time.sleep(step_s)
    return out


def test_an_io_bound_loader_grows_and_keeps_order_and_seeds(
        caplog: pytest.LogCaptureFixture) -> None:
    # 5 ms a sample, sleeping: workers take no CPU, so the count goes past the cores.
    n = 480
    dl = FastLoader(SlowProbe(n, delay=0.005), batch_size=4, num_workers="auto",
                    persistent_workers=True)
    assert dl.num_workers == START
    with caplog.at_level(logging.INFO, logger="fastload"):
        batches = _epoch(dl)
    assert [int(i) for b in batches for i in b["index"]] == list(range(n))
    s = dl.stats()
    assert s is not None and s.workers > START, s.workers
    grew = [r.getMessage() for r in caplog.records if "goes from" in r.getMessage()]
    assert grew and f"goes from {START} to" in grew[0]
    # every worker, old or new, seeded base_seed + its id, told the count it started with
    seeds = {(int(w), int(seed)) for b in batches for w, seed in zip(b["worker_id"], b["seed"])}
    assert len({seed - w for w, seed in seeds}) == 1
    assert {w for w, _ in seeds} == set(range(s.workers))
    assert all(START <= int(k) <= s.workers for b in batches for k in b["num_workers"])
    # the next epoch starts with the count this one ended with
    batches = _epoch(dl)
    assert [int(i) for b in batches for i in b["index"]] == list(range(n))
    assert dl.stats().workers >= s.workers  # type: ignore[union-attr]


def test_a_loop_bound_loader_retires_workers_and_loses_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    # Samples are instant and the loop's step takes 10 ms: workers idle.
    n = 360
    dl = FastLoader(Plain(n), batch_size=2, num_workers="auto")
    with caplog.at_level(logging.INFO, logger="fastload"):
        batches = _epoch(dl, step_s=0.01)
    assert [int(i) for b in batches for i in b] == list(range(n))
    assert dl.stats().workers < START  # type: ignore[union-attr]
    assert [r for r in caplog.records if f"goes from {START} to {START - 1}" in r.getMessage()]
    # a new iterator (the warm pool) starts with the smaller count
    batches = _epoch(dl)
    assert [int(i) for b in batches for i in b] == list(range(n))


class _Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, 40, nw))


def test_an_iterable_dataset_keeps_the_count_it_starts_with() -> None:
    # Its replicas shard by get_worker_info().num_workers: the count cannot change.
    got = sorted(int(i) for b in FastLoader(_Stream(), batch_size=2, num_workers="auto") for i in b)
    want = sorted(int(i) for b in DataLoader(_Stream(), batch_size=2, num_workers=START) for i in b)
    assert got == want == list(range(40))


def test_install_auto_overrides_the_count_a_library_chose() -> None:
    dl = DataLoader(Plain(16), batch_size=2, num_workers=1)
    fastload.install(num_workers="auto")
    try:
        assert [int(i) for b in dl for i in b] == list(range(16))
        assert fastload.stats(dl).workers == START  # type: ignore[union-attr]
    finally:
        fastload.uninstall()


@pytest.mark.parametrize("bad", ["many", "AUTO", "2"])
def test_other_num_workers_strings_are_refused_as_dataloader_refuses_them(bad: str) -> None:
    with pytest.raises(TypeError) as want:
        DataLoader(Plain(4), num_workers=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as got:
        FastLoader(Plain(4), num_workers=bad)
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="num_workers option of install"):
        fastload.install(num_workers=bad)
    assert not fastload.installed()


@pytest.mark.heavy
def test_resume_of_an_auto_loader_starts_with_the_saved_count() -> None:
    n = 400
    dl = FastLoader(Plain(n, delay=0.004), batch_size=4, num_workers="auto",
                    generator=torch.Generator().manual_seed(3), shuffle=True)
    order = [int(i) for b in FastLoader(Plain(n), batch_size=4, num_workers=0,
                                       generator=torch.Generator().manual_seed(3),
                                       shuffle=True) for i in b]
    it = iter(dl)
    first = [int(i) for _ in range(60) for i in next(it)]
    sd = dl.state_dict()
    assert sd["num_workers"] == "auto" and sd["workers_in_use"] == dl.stats().workers
    del it
    again = FastLoader(Plain(n), batch_size=4, num_workers="auto",
                       generator=torch.Generator().manual_seed(3), shuffle=True)
    again.load_state_dict(sd)
    it = iter(again)
    rest = [int(i) for b in it for i in b]
    assert first + rest == order
    assert again.stats().workers <= sd["workers_in_use"]  # type: ignore[union-attr]


def test_a_worker_that_cannot_be_started_keeps_the_count(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    # Out of processes (EAGAIN from fork) when the rule asks for more: a
    # warning, the epoch goes on with the workers it has, every index once.
    from fastload.pool.worker_pool import WorkerPool

    def grow(self: Any, n: int) -> List[int]:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(WorkerPool, "grow", grow)
    n = 240
    dl = FastLoader(SlowProbe(n, delay=0.005), batch_size=4, num_workers="auto")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        batches = _epoch(dl)
    assert [int(i) for b in batches for i in b["index"]] == list(range(n))
    assert dl.stats().workers == START  # type: ignore[union-attr]
    warned = [r for r in caplog.records if "could not start more workers" in r.getMessage()]
    assert len(warned) == 1  # once: the count's cap is now the count it has


def test_a_break_while_workers_retire_leaves_the_next_epoch_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The count shrinks while the workers past it still hold tasks, and the
    # loop breaks out then: the next iter() on the warm pool must not wait
    # for the retired workers' batches, which nobody makes any more.
    from fastload.iterator.auto_count import AutoCount

    decided: List[int] = []

    def shrink_once(self: Any, now: int, meter: Any, pids: Any, n: int) -> Any:
        if decided or n < 2:
            return None
        decided.append(n - 1)
        return n - 1

    monkeypatch.setattr(AutoCount, "due", lambda self, now: True)
    monkeypatch.setattr(AutoCount, "decide", shrink_once)
    n = 24
    dl = FastLoader(_SlowPastWorker0(n), batch_size=1, num_workers="auto", prefetch_factor=2,
                    hang_timeout=20.0)
    it = iter(dl)
    first = [int(next(it)) for _ in range(2)]  # batch 1: worker 1's, 1 s
    assert decided, "the count did not shrink"
    del it  # broke out with the retiring worker's tasks in flight
    assert [int(b) for b in dl] == list(range(n))
    assert first == [0, 1]


class _SlowPastWorker0(Plain):
    """Workers past the first take 1 s a sample: at the break, the retiring
    workers' tasks are still out."""

    def __getitem__(self, i: int) -> Any:
        info = get_worker_info()
        if info is not None and info.id >= 1:
            time.sleep(1.0)
        return super().__getitem__(i)
