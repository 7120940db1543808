"""Fit a tiny LightningModule whose ``train_dataloader`` returns a FastLoader.

    python lightning_fit.py --loader fastload|torch [--devices 2 --strategy ddp] --out DIR

Each rank writes ``DIR/rank<r>.json``: the loss of every step, the indices it
trained on in each epoch, the class of the loader Lightning used (after it
re-created it with a DistributedSampler under DDP) and of every iterator a
DataLoader handed out in that process.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

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


class Regression(Dataset):
    """48 noisy points of a linear function; the noise is drawn in the worker."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        x = torch.tensor([i / 48.0, (i % 7) / 7.0, 1.0]) + 0.01 * torch.randn(3)
        return i, x, x @ torch.tensor([0.5, -1.0, 2.0])


class Tiny(L.LightningModule):
    def __init__(self, loader_class):
        super().__init__()
        self.loader_class = loader_class
        self.layer = nn.Linear(3, 1)
        self.losses = []
        self.indices = {}
        self.loaders = []

    def train_dataloader(self):
        return self.loader_class(Regression(), batch_size=4, shuffle=True, num_workers=2)

    def on_train_epoch_start(self):
        loader = self.trainer.train_dataloader
        self.loaders.append([type(loader).__qualname__, type(loader.sampler).__qualname__])

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        loss = F.mse_loss(self.layer(x).squeeze(-1), y)
        self.losses.append(loss.item())
        self.indices.setdefault(self.current_epoch, []).extend(index.tolist())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["fastload", "torch"], required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    record_iterator_classes()
    L.seed_everything(0, workers=True)
    model = Tiny(FastLoader if args.loader == "fastload" else DataLoader)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_epochs=2,
        deterministic=True, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    report = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "losses": model.losses,
        "indices": [model.indices[e] for e in sorted(model.indices)],
        "loaders": model.loaders,
        "iterators": ITERATORS,
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
