"""A training-style script with no ``if __name__ == "__main__":`` guard.

    python unguarded.py CONTEXT RUNS_FILE

CONTEXT is ``default`` (FastLoader's own start method), ``spawn`` or
``forkserver``. Each time this file's top-level code runs, one line goes to
RUNS_FILE: a worker that re-ran the script would add one. Prints one JSON
line: every batch of DataLoader (its default start, fork) and of FastLoader,
with whether each batch is of this script's own class.
"""

import collections
import dataclasses
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from fastload import FastLoader

context, runs_file = sys.argv[1], sys.argv[2]
with open(runs_file, "a") as runs:
    runs.write(f"pid {os.getpid()} as {__name__}\n")

Pair = collections.namedtuple("Pair", ["index", "noise"])


@dataclasses.dataclass
class Batch:
    index: torch.Tensor
    noise: torch.Tensor


class Noisy(Dataset):
    """Sample i and a little noise drawn in the worker (so seeding shows)."""

    def __len__(self):
        return 22

    def __getitem__(self, i):
        return Pair(torch.tensor(i), torch.rand(3))


def to_batch(samples):
    return Batch(torch.stack([s.index for s in samples]), torch.stack([s.noise for s in samples]))


def epoch(loader):
    return [
        {"own_class": type(b) in (Pair, Batch), "class": type(b).__qualname__,
         "index": b.index.tolist(), "noise": b.noise.tolist()}
        for b in loader
    ]


options = dict(batch_size=4, shuffle=True, num_workers=2)
fast_options = dict(options)
if context != "default":
    fast_options["multiprocessing_context"] = context

report = {}
for collate in (None, to_batch):
    key = "namedtuple" if collate is None else "dataclass"
    torch.manual_seed(0)
    expected = epoch(DataLoader(Noisy(), collate_fn=collate, **options))
    torch.manual_seed(0)
    got = epoch(FastLoader(Noisy(), collate_fn=collate, **fast_options))
    report[key] = {"dataloader": expected, "fastload": got}

print(json.dumps(report))
