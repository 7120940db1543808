"""PyTorch's DDP tutorial, with its loaders: ranks started by torch.multiprocessing.spawn.

Two ranks on CPU (gloo), each with a DistributedSampler, a model wrapped in
DistributedDataParallel and an optimizer step per batch, for two epochs
(``set_epoch``). The dataset, its sample type and the collate function are
defined here: in each rank this file is ``__mp_main__``. Each rank trains
once with torch's DataLoader and once with FastLoader (``--loaders``) from
the same initial weights, and writes, per loader, every batch's indices,
its targets' bytes, whether it came back as this rank's own ``Sample``,
and the losses, to ``OUT/rank<r>.json``.

    python ddp_mp_spawn.py --out DIR [--loaders torch,fastload]
"""

import argparse
import json
import os
from collections import namedtuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

Sample = namedtuple("Sample", "index x y")


class Regression(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(10, generator=g)
        return Sample(i, x, x.sum(dim=0, keepdim=True) + torch.rand(1))  # torch.rand: worker seeding


def collate(samples):
    return Sample(torch.tensor([s.index for s in samples]), torch.stack([s.x for s in samples]),
                  torch.stack([s.y for s in samples]))


def train(rank, world, loader_cls):
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(Regression(), num_replicas=world, rank=rank, shuffle=True, seed=5)
    loader = loader_cls(Regression(), batch_size=8, sampler=sampler, num_workers=2,
                        collate_fn=collate, generator=torch.Generator().manual_seed(7))
    out = {"batches": [], "losses": [], "own_class": True, "iterators": []}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        it = iter(loader)
        out["iterators"].append(f"{type(it).__module__}.{type(it).__qualname__}")
        for b in it:
            out["own_class"] = out["own_class"] and type(b) is Sample
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(b.x), b.y)
            loss.backward()
            opt.step()
            out["batches"].append([b.index.tolist(), b.y.flatten().tolist()])
            out["losses"].append(loss.item())
    return out


def run(rank, world, loaders, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import fastload

        classes = {"torch": DataLoader, "fastload": fastload.FastLoader}
        result = {"rank": rank, "module": Sample.__module__,
                  "runs": {name: train(rank, world, classes[name]) for name in loaders}}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--loaders", default="torch,fastload")
    parser.add_argument("--port", default="29533")
    args = parser.parse_args()
    os.environ["MASTER_PORT"] = args.port
    mp.spawn(run, args=(2, args.loaders.split(","), args.out), nprocs=2, join=True)
