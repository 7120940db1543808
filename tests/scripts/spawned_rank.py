"""A training script whose loaders run in a process that multiprocessing
started (a DDP rank from torch.multiprocessing.spawn, a pool worker).

There the script is imported as ``__mp_main__``: every class and function
below says ``__module__ == "__mp_main__"``. Each rank runs one epoch with
torch's DataLoader and one per fastload start method, and prints, per
loader, the batches and whether every batch came back as this process's
own ``Pair``. Usage: ``python spawned_rank.py LAUNCHER`` with LAUNCHER one
of mp_spawn, process_spawn, process_forkserver, pool_spawn, pool_forkserver.
"""

import json
import multiprocessing
import sys
from collections import namedtuple
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset, Sampler

import fastload

Pair = namedtuple("Pair", "x y")
CONTEXTS = [None, "spawn", "forkserver", "fork"]


class DS(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return Pair(torch.tensor([i]) + self.offset, i)

    offset = 0


class Backwards(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


def init(worker_id):
    torch.utils.data.get_worker_info().dataset.offset = 1000


def collate(samples):
    return Pair(torch.cat([s.x for s in samples]), [s.y for s in samples])


def epoch(loader_cls, ctx):
    kw = {} if loader_cls is DataLoader else {"multiprocessing_context": ctx}
    loader = loader_cls(DS(), batch_size=5, num_workers=2, sampler=Backwards(24),
                        worker_init_fn=init, collate_fn=collate, **kw)
    out = []
    for b in loader:
        out.append({"same_class": type(b) is Pair, "x": b.x.tolist(), "y": b.y})
    return out


def run(rank, *_):
    result = {"DataLoader": epoch(DataLoader, None)}
    for ctx in CONTEXTS:
        result[f"fastload-{ctx}"] = epoch(fastload.FastLoader, ctx)
    return {"rank": rank, "module": Pair.__module__, "result": result}


def print_run(rank, *_):
    print("RESULT " + json.dumps(run(rank)), flush=True)


if __name__ == "__main__":
    how = sys.argv[1]
    if how == "mp_spawn":
        mp.spawn(print_run, nprocs=1)
    elif how.startswith("process_"):
        p = multiprocessing.get_context(how.split("_")[1]).Process(target=print_run, args=(0,))
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
    elif how.startswith("pool_"):
        ctx = multiprocessing.get_context(how.split("_")[1])
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            print("RESULT " + json.dumps(pool.submit(run, 0).result()), flush=True)
    else:
        raise SystemExit(f"unknown launcher {how}")
