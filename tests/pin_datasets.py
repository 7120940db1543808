"""Datasets for tests/test_pinning.py (importable by spawned workers)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class IndexedRows(Dataset):
    """Sample i: a float32 row filled with i (content checkable from the index)."""

    def __init__(self, n: int = 96, width: int = 4096) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i < 0 or i >= self.n:
            raise IndexError(i)
        return torch.full((self.width,), float(i))


class GrowingRows(IndexedRows):
    """Like IndexedRows, but later samples are wider, so batches outgrow the
    bytes registered for their slot earlier."""

    def __getitem__(self, i: int) -> torch.Tensor:
        width = self.width * (1 + 3 * (i >= self.n // 2))
        return torch.full((width,), float(i))


class FailsAt(IndexedRows):
    """IndexedRows whose sample ``bad`` raises."""

    def __init__(self, bad: int, n: int = 40, width: int = 16) -> None:
        super().__init__(n, width)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise ValueError(f"sample {i} is bad")
        return super().__getitem__(i)
