"""A few training steps with 🤗 Accelerate on the CPU, optionally under ``fastload.install()``.

    python accelerate_steps.py [--install]
    python -m fastload run accelerate_steps.py

The script itself only knows ``torch.utils.data.DataLoader``; with
``--install`` it calls ``fastload.install()`` first, the one line a user adds;
``python -m fastload run`` installs fastload without changing the script.
Prints one JSON line: every step's loss, the class of the prepared loader and
of every iterator a DataLoader handed out.
"""

import argparse
import json

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

ITERATORS = []


def record_iterator_classes():
    """Note the class of every iterator any DataLoader (or subclass) hands out."""
    original = DataLoader.__iter__

    def __iter__(self):
        it = original(self)
        ITERATORS.append(f"{type(it).__module__}.{type(it).__qualname__}")
        return it

    DataLoader.__iter__ = __iter__


class Regression(Dataset):
    """48 noisy points of a linear function; the noise is drawn in the worker."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        x = torch.tensor([i / 48.0, (i % 7) / 7.0, 1.0]) + 0.01 * torch.randn(3)
        return x, x @ torch.tensor([0.5, -1.0, 2.0])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--install", action="store_true")
    args = parser.parse_args()
    if args.install:
        import fastload

        fastload.install()

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    record_iterator_classes()
    set_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Regression(), batch_size=4, shuffle=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for epoch in range(2):
        for x, y in loader:
            loss = F.mse_loss(model(x).squeeze(-1), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    print(json.dumps({"losses": losses, "loader": type(loader).__qualname__, "iterators": ITERATORS}))


if __name__ == "__main__":
    main()
