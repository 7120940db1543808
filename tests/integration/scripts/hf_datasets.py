"""Hugging Face ``datasets`` through a loader with 2 workers.

    python hf_datasets.py

1. A map-style ``Dataset.from_dict(...).with_format("torch")``, shuffled.
2. ``to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=8)`` with
   ``persistent_workers=True`` and ``set_epoch(e)`` before each of 3 epochs:
   the dataset keeps its epoch in shared memory, so the persistent workers
   see each new epoch and reshuffle.

Prints one JSON line: for DataLoader and FastLoader, the map-style batches and
the order of each epoch.
"""

import json

import datasets
import torch
from torch.utils.data import DataLoader

from fastload import FastLoader

options = dict(batch_size=4, num_workers=2)


def map_style(loader_class):
    table = datasets.Dataset.from_dict({
        "x": [[float(i), float(i * i)] for i in range(30)],
        "label": [i % 3 for i in range(30)],
    }).with_format("torch")
    torch.manual_seed(0)
    loader = loader_class(table, shuffle=True, **options)
    return [{key: value.tolist() for key, value in batch.items()} for batch in loader]


def iterable_epochs(loader_class):
    stream = datasets.Dataset.from_dict({"i": list(range(64))}).to_iterable_dataset(num_shards=4)
    stream = stream.shuffle(seed=0, buffer_size=8)
    torch.manual_seed(0)
    loader = loader_class(stream, persistent_workers=True, **options)
    orders = []
    for epoch in range(3):
        stream.set_epoch(epoch)
        orders.append([i for batch in loader for i in batch["i"].tolist()])
    return orders


def main():
    report = {}
    for name, loader_class in (("dataloader", DataLoader), ("fastload", FastLoader)):
        report[name] = {"map_style": map_style(loader_class), "epochs": iterable_epochs(loader_class)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
