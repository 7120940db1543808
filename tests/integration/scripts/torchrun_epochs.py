"""Two epochs of a DistributedSampler-fed loader on every rank, under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        torchrun_epochs.py --loaders torch,fastload --out DIR

``torch`` is a plain ``torch.utils.data.DataLoader`` (which iterates on
fastload when the process tree runs with ``FASTLOAD_INSTALL=1``),
``fastload`` a FastLoader. Each rank writes ``DIR/rank<r>.json``: for each
loader, every batch of each epoch; and the class of every iterator a
DataLoader handed out in that process.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from fastload import FastLoader

ITERATORS = []


def record_iterator_classes():
    """Note the class of every iterator any DataLoader (or subclass) hands out."""
    original = DataLoader.__iter__

    def __iter__(self):
        it = original(self)
        ITERATORS.append(f"{type(it).__module__}.{type(it).__qualname__}")
        return it

    DataLoader.__iter__ = __iter__


class Noisy(Dataset):
    """Sample i and a little noise drawn in the worker (so seeding shows)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i, torch.rand(2)


def epochs(loader_class):
    dataset = Noisy()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = loader_class(dataset, batch_size=4, sampler=sampler, num_workers=2)
    out = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        out.append([[index.tolist(), noise.tolist()] for index, noise in loader])
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loaders", default="torch,fastload")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    record_iterator_classes()
    report = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "batches": {}}
    for name in args.loaders.split(","):
        torch.manual_seed(0)
        report["batches"][name] = epochs({"torch": DataLoader, "fastload": FastLoader}[name])
    report["iterators"] = ITERATORS
    dist.barrier()
    dist.destroy_process_group()
    (args.out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
