"""Datasets for tests/test_memory.py (importable by spawned workers)."""

from __future__ import annotations

from typing import List

import torch
from torch.utils.data import Dataset


class ManyPaths(Dataset):
    """A file list as many real datasets hold one: ``n`` short path strings
    and their labels in plain Python lists. Sample i reads both."""

    def __init__(self, n: int) -> None:
        self.paths = [f"/data/train/{i % 1000:03d}/img_{i:08d}.jpg" for i in range(n)]
        self.labels = [i % 1000 for i in range(n)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        return len(self.paths[i]) + self.labels[i]


def to_tensor(batch: List[int]) -> torch.Tensor:
    return torch.tensor(batch)
