"""A state saved by torchdata's StatefulDataLoader, taken over by a FastLoader.

    python stateful_dataloader_handover.py --workers N --stop K [--no-shuffle]

Prints one JSON line: the batches StatefulDataLoader delivers uninterrupted
(``full``), the ones it delivered before its state was saved at batch K
(``head``), and the ones a FastLoader made with the same arguments delivers
after ``load_state_dict()`` of that state (``rest``). The dataset draws no
randomness: StatefulDataLoader's resumed workers start fresh, so only the
order carries over.
"""

import argparse
import json

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from fastload import FastLoader


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--stop", type=int, default=3)
    p.add_argument("--no-shuffle", action="store_true")
    a = p.parse_args()
    ds = list(range(50))

    def kw():
        if a.no_shuffle:
            return {"batch_size": 4, "num_workers": a.workers}
        return {"batch_size": 4, "num_workers": a.workers, "shuffle": True,
                "generator": torch.Generator().manual_seed(11)}

    full = [b.tolist() for b in StatefulDataLoader(ds, **kw())]
    sdl = StatefulDataLoader(ds, **kw())
    it = iter(sdl)
    head = [next(it).tolist() for _ in range(a.stop)]
    state = sdl.state_dict()
    del it
    fast = FastLoader(ds, **kw())
    fast.load_state_dict(state)
    rest = [b.tolist() for b in fast]
    print(json.dumps({"full": full, "head": head, "rest": rest}))


if __name__ == "__main__":
    main()
