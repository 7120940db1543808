"""The ring's memory: a slot keeps its pages once written, so one outlier
batch would pin its size for the rest of training; free slots give those
pages back when the next epoch starts."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.utils.data import Dataset

from fastload import FastLoader
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
