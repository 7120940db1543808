"""Smoke test of an *installed* fastload wheel; run by .ci/wheel.

.ci/wheel copies this file into an empty directory outside the source tree
and runs it there with the python of a fresh venv holding torch and the
repaired wheel, so ``import fastload`` can only come from that venv:

    python wheel_smoke.py SOURCE_TREE

Checks: fastload and its extension are the venv's, and the venv holds
torch and fastload's own dependencies only (no numpy: torch does not need
it, so neither may fastload); a 2-worker epoch of FastLoader, under its
default start (the zygote) and under spawn, gives the same batches as torch's
DataLoader for the same generator seed, every index exactly once, also when
the loop keeps every batch alive (which copies batches out of the ring);
no accelerator context was created; the extension needs only the C/C++
runtime (readelf -d).
Prints ``wheel smoke: OK (N checks)`` at the end, or raises.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from elf_check import check_needed  # copied beside this script by .ci/wheel

N_ITEMS = 37  # not a multiple of the batch size: the last batch is short
BATCH = 4
WORKERS = 2
SEED = 20240607



class Squares(Dataset):
    """Deterministic map-style dataset; each sample also draws from torch's
    generator inside the worker, so worker seeding must match DataLoader's."""

    def __len__(self) -> int:
        return N_ITEMS

    def __getitem__(self, i: int):
        return {
            "idx": i,
            "x": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i + i * i,
            "noise": torch.rand(3),
        }


def under(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def epoch(cls, ctx, hold):
    gen = torch.Generator().manual_seed(SEED)
    loader = cls(Squares(), batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                 generator=gen, multiprocessing_context=ctx)
    if hold:
        # Every batch kept alive, as `torch.cat([b for b in loader])` keeps
        # them: past held_batches, FastLoader copies batches out of the ring.
        return list(loader)
    # Clone: FastLoader batches view a ring slot that goes back to the
    # workers once the batch is dropped.
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def main() -> None:
    source_tree = sys.argv[1]
    checks = 0

    import fastload
    import fastload._core as core

    venv = sys.prefix
    assert venv != sys.base_prefix, f"not running in a venv: {sys.prefix}"
    for mod in (fastload, core):
        assert under(mod.__file__, venv), f"{mod.__name__} from {mod.__file__}, not from the venv {venv}"
        assert not under(mod.__file__, source_tree), f"{mod.__name__} from the source tree: {mod.__file__}"
    print(f"fastload {fastload.__version__} from {os.path.dirname(fastload.__file__)}")
    checks += 1
    # One version: the wheel's metadata is read from fastload.__version__.
    from importlib.metadata import version

    assert version("fastload") == fastload.__version__, (version("fastload"), fastload.__version__)
    checks += 1

    # A torch-only environment: what fastload needs at run time is torch
    # and its declared dependencies, nothing torch does not bring.
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("numpy is installed in the smoke venv: it must hold torch and fastload only")
    checks += 1

    from fastload import FastLoader

    for ctx, hold in ((None, False), (None, True), ("spawn", False), ("spawn", True)):
        t0 = time.monotonic()
        theirs = epoch(DataLoader, "spawn", hold=False)
        t1 = time.monotonic()
        ours = epoch(FastLoader, ctx, hold)
        t2 = time.monotonic()
        print(f"DataLoader(spawn) epoch {t1 - t0:.1f}s, FastLoader({ctx or 'default'}"
              f"{', every batch held' if hold else ''}) epoch {t2 - t1:.1f}s "
              f"({WORKERS} workers, {len(ours)} batches)")
        assert len(ours) == len(theirs) == -(-N_ITEMS // BATCH), (len(ours), len(theirs))
        for n, (a, b) in enumerate(zip(ours, theirs)):
            assert list(a) == list(b), f"{ctx}, batch {n}: keys {list(a)} != {list(b)}"
            for k in a:
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (ctx, n, k, a[k], b[k])
                assert torch.equal(a[k], b[k]), f"{ctx}, batch {n}[{k!r}]: {a[k]} != {b[k]}"
        checks += 1
        seen = torch.cat([b["idx"] for b in ours]).tolist()
        assert sorted(seen) == list(range(N_ITEMS)), f"indices not each exactly once: {seen}"
        assert seen != list(range(N_ITEMS)), "shuffle=True gave the identity order"
        checks += 1

    assert not torch.cuda.is_initialized(), "an accelerator context was created in the main process"
    checks += 1

    print(check_needed(core.__file__))
    checks += 1

    print(f"wheel smoke: OK ({checks} checks)")


if __name__ == "__main__":
    main()
