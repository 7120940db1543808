"""Resume a Lightning fit mid-epoch from a checkpoint, with a FastLoader.

    python lightning_resume.py full --out DIR           # 2 epochs, never stopped
    python lightning_resume.py stop --out DIR           # checkpoints every 5 steps, stops at step 7
    python lightning_resume.py resume --ckpt PATH --out DIR   # fit(ckpt_path=PATH) to the end

Each run writes ``DIR/<mode>.json``: the global step, the sample indices and
the worker-drawn noise of every training step it ran. Lightning saves the
loader's ``state_dict()`` in the checkpoint and calls ``load_state_dict()``
on the new loader before iterating (its ``_Stateful`` protocol), so the
resumed steps must be exactly the never-stopped run's steps after the
checkpoint.
"""

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from fastload import FastLoader


class Noisy(Dataset):
    """Noise drawn in the worker: a resumed worker must draw the same."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.tensor([i / 40.0, 1.0]) + 0.1 * torch.randn(2)
        return i, x, x @ torch.tensor([0.5, -1.0])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.steps = []

    def train_dataloader(self):
        return FastLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.steps.append([self.global_step, index.tolist(), [round(v, 6) for v in x.flatten().tolist()]])
        return F.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["full", "stop", "resume"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path)
    args = parser.parse_args()

    L.seed_everything(0, workers=True)
    model = Tiny()
    callbacks, kw = [], {}
    if args.mode == "stop":
        callbacks = [ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=5,
                                     save_top_k=-1, save_on_train_epoch_end=False)]
        kw["max_steps"] = 7
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, deterministic=True, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, **kw,
    )
    trainer.fit(model, ckpt_path=str(args.ckpt) if args.ckpt else None)
    (args.out / f"{args.mode}.json").write_text(json.dumps({"steps": model.steps}))


if __name__ == "__main__":
    main()
