"""Memory: the ring's and the workers'.

A slot keeps its pages once written, so one outlier batch would pin its size
for the rest of training; free slots give those pages back when the next
epoch starts. A dataset holding big Python containers costs each worker a
share of one copy (forked from a zygote that unpickled it), not a copy each."""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import tracemalloc

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastload import FastLoader
from fastload.bench.copy_on_read import ManyPaths, int_collate
from fastload.debug import debug_view

OUTLIER = 5
BIG = 48 << 20  # bytes of the outlier sample; the others are 64 KiB


class OneOutlier(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        n = BIG if i == OUTLIER else 64 << 10
        return torch.full((n // 4,), float(i))


def _allocated(ring) -> int:
    return os.fstat(ring.fd).st_blocks * 512


@pytest.mark.parametrize("persistent", [False, True])
def test_an_outlier_batch_s_pages_are_given_back_at_the_next_epoch(persistent: bool) -> None:
    loader = FastLoader(OneOutlier(), batch_size=1, num_workers=2, persistent_workers=persistent)
    try:
        seen = [b[0, 0].item() for b in loader]
        assert seen == [float(i) for i in range(12)]
        view = debug_view(loader)
        ring = view.iterator.ring if persistent else view.idle_pool.ring
        del view
        assert _allocated(ring) >= BIG  # the outlier's slot kept its pages
        it = iter(loader)  # the next epoch starts
        assert debug_view(it).ring == ring  # the same (warm or persistent) ring
        assert _allocated(ring) < BIG // 4
        assert [b[0, 0].item() for b in it] == seen  # and the epoch is whole
        del it, ring
    finally:
        del loader
        gc.collect()


def test_normal_batches_keep_their_slots() -> None:
    """Slots are trimmed to twice the recent median batch: a run of normal
    batches keeps its pages (no page churn at every epoch)."""
    loader = FastLoader(torch.zeros(16, 1 << 18), batch_size=2, num_workers=2,
                        persistent_workers=True)
    try:
        for _ in loader:
            pass
        ring = debug_view(loader).iterator.ring
        before = _allocated(ring)
        for _ in loader:
            pass
        assert _allocated(ring) == before
        del ring
    finally:
        del loader
        gc.collect()


class ImageAndLabel(Dataset):
    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple:
        return torch.full((1 << 20,), float(i)), i  # 4 MB; a batch of 2 is 8 MB


def test_keeping_each_batch_s_labels_keeps_only_the_labels() -> None:
    """Metric code keeps each batch's labels and drops its images. Past the
    batches that may stay in their slots (``held_batches``), each batch is
    copied out, each tensor into memory of its own, as DataLoader's arrive:
    the labels alone stay, not a copy of the whole batch each."""
    loader = FastLoader(ImageAndLabel(), batch_size=2, num_workers=2)
    me = psutil.Process()
    libc = ctypes.CDLL(None)

    def live() -> int:  # less the freed heap memory malloc keeps for later
        libc.malloc_trim(0)
        return me.memory_full_info().uss

    labels = []
    try:
        for k, (images, label) in enumerate(loader):
            labels.append(label)
            del images
            if k == 8:  # well past the held batches
                start = live()
        grown = live() - start
        assert torch.cat(labels).tolist() == list(range(96))
        # A copy of each whole batch kept would be 8 MB a batch, 312 MB; the
        # allocator's own ups and downs reach a few batches' worth.
        assert grown < 8 * 8 * MB, f"{grown / MB:.0f} MB more over 39 batches of 8 MB"
    finally:
        del loader
        gc.collect()


class BigArray(Dataset):
    """A dataset whose pickle is ``BLOB`` bytes (a ``bytes`` object crosses
    as bytes; an array of that size would cross by reference)."""

    def __init__(self) -> None:
        self.data = bytes(BLOB)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return int(self.data[i])


BLOB = 32 << 20


@pytest.mark.parametrize("how", ["default", "persistent", "spawn", "restartable"])
def test_the_training_process_lets_go_of_the_pickled_dataset(how: str) -> None:
    """The session's pickle is as big as the dataset. Once the workers have
    it, only a replacement worker could need it: the training process keeps
    it only where a restart can happen, not for the iterator's life."""
    kw: dict = {"persistent": dict(persistent_workers=True),
                "spawn": dict(multiprocessing_context="spawn"),
                "restartable": dict(max_worker_restarts=1)}.get(how, {})
    loader = FastLoader(BigArray(), batch_size=2, num_workers=2, **kw)
    tracemalloc.start()
    try:
        it = iter(loader)
        assert next(it).tolist() == [0, 0]
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    try:
        if how == "restartable":
            assert held >= BLOB  # kept for a replacement worker
        else:
            assert held < BLOB // 4
        assert len(list(it)) == 7
    finally:
        del it, loader
        gc.collect()


def test_between_epochs_the_zygote_keeps_one_copy_of_the_dataset() -> None:
    """The zygote unpickles each epoch's dataset once for the workers it
    forks, and keeps it after the epoch only to reuse it if the next epoch's
    is the same: a dataset that changes every epoch costs it one copy, never
    one per epoch."""
    loader = FastLoader(BigArray(), batch_size=2, num_workers=2)
    try:
        sizes = []
        for epoch in range(4):
            loader.dataset.data = bytes([epoch]) * BLOB  # a new dataset each epoch
            it = iter(loader)
            assert next(it).tolist() == [epoch, epoch]
            zygote = psutil.Process(debug_view(it).pool.zygote_pid)
            assert len(list(it)) == 7
            del it
            sizes.append(zygote.memory_info().rss)
        assert max(sizes[1:]) - sizes[0] < BLOB // 2, [s / MB for s in sizes]
    finally:
        del loader
        gc.collect()


# ---------------------------------------------------------------------------
# a dataset holding big Python containers: shared, as with fork, not copied


def _memory(pids):
    """(PSS, USS) in bytes of each process in ``pids``."""
    out = []
    for pid in pids:
        m = psutil.Process(pid).memory_full_info()
        out.append((m.pss, m.uss))
    return out


def _epoch_memory(loader, pids_of) -> list:
    """Iterate one epoch; the workers' memory once the next-to-last batch is
    in (every worker has made all its batches but that last one, and all
    still run: fastload's end as the last batch is handed out, DataLoader's
    at StopIteration), as the copy-on-read benchmark measures it."""
    it = iter(loader)
    n, got = len(loader), None
    for k, batch in enumerate(it):
        if k == 0:
            pids = pids_of(it)
        if k == n - 2:
            got = _memory(pids)
    del it
    return got


def _summary(mem) -> tuple:
    return sum(p for p, _u in mem), statistics.median(u for _p, u in mem)


MB = 1 << 20


@pytest.mark.slow  # DataLoader fork and spawn beside fastload on 1.5M strings: ~11 s
@pytest.mark.filterwarnings("ignore:This DataLoader will create .* worker processes in total")
def test_workers_share_the_dataset_as_forked_dataloader_workers_do() -> None:
    """Workers forked from a zygote that unpickled the dataset share its
    pages, as DataLoader's forked workers share the training process's; a
    spawned DataLoader worker pays a copy of torch and of the dataset."""
    ds = ManyPaths(1_500_000)
    kw = dict(batch_size=50_000, num_workers=3, collate_fn=int_collate)
    dl_pids = lambda it: [w.pid for w in it._workers]  # noqa: E731
    fork = _summary(_epoch_memory(DataLoader(ds, multiprocessing_context="fork", **kw), dl_pids))
    spawn = _summary(_epoch_memory(DataLoader(ds, multiprocessing_context="spawn", **kw), dl_pids))
    loader = FastLoader(ds, **kw)
    try:
        fl_pids = lambda it: list(debug_view(it).worker_pids)  # noqa: E731
        first = _summary(_epoch_memory(loader, fl_pids))
        second = _summary(_epoch_memory(loader, fl_pids))  # the warm pool, fresh workers
        zygote = debug_view(loader).idle_pool.zygote_pid
        zygote_pss = _memory([zygote])[0][0]
    finally:
        del loader
        gc.collect()
    figures = (f"total PSS / median USS (MB): fork {fork[0] / MB:.0f} / {fork[1] / MB:.0f}, "
               f"spawn {spawn[0] / MB:.0f} / {spawn[1] / MB:.0f}, fastload {first[0] / MB:.0f} / "
               f"{first[1] / MB:.0f}, second epoch {second[0] / MB:.0f} / {second[1] / MB:.0f}, "
               f"its zygote's PSS {zygote_pss / MB:.0f}")
    print(figures)
    for total, median_uss in (first, second):
        assert total <= 1.1 * fork[0], figures
        assert median_uss <= 1.5 * fork[1], figures
        assert total <= 0.6 * spawn[0], figures
