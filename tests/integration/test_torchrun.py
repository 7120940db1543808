"""torchrun: two ranks on CPU (gloo), each with a DistributedSampler and 2 workers.

Every rank's batches (indices and the noise its workers draw) must equal
DataLoader's on the same rank, the ranks must split the dataset, and under
``FASTLOAD_INSTALL=1`` a script that only knows DataLoader must iterate on
fastload and give the same batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, check, run, script

pytestmark = pytest.mark.integration


def _torchrun(where: Path, loaders: str, env: dict) -> dict:
    out = where / "out"
    out.mkdir()
    train = script("torchrun_epochs.py", where)
    check(run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               str(train), "--loaders", loaders, "--out", str(out)],
              cwd=where, timeout=600, env=env))
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1]
    return ranks


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DataLoader and FastLoader in the same ranks, one after the other."""
    return _torchrun(tmp_path_factory.mktemp("torchrun"), "torch,fastload", {})


def _indices(epoch_batches: list) -> list:
    return [i for index, _ in epoch_batches for i in index]


def test_torchrun_ranks(plain_run: dict) -> None:
    """A user launches ``python -m torch.distributed.run --nproc_per_node=2
    --standalone train.py`` where train.py uses a DistributedSampler and FastLoader."""
    for rank in plain_run.values():
        assert rank["world_size"] == 2
        assert rank["iterators"] == [TORCH_ITER] * 2 + [FASTLOAD_ITER] * 2
        assert rank["batches"]["fastload"] == rank["batches"]["torch"], \
            f"rank {rank['rank']}: FastLoader's batches differ from DataLoader's"
    for epoch in range(2):
        first = _indices(plain_run[0]["batches"]["fastload"][epoch])
        second = _indices(plain_run[1]["batches"]["fastload"][epoch])
        assert not set(first) & set(second), f"epoch {epoch}: both ranks got some indices"
        assert sorted(first + second) == list(range(40)), f"epoch {epoch}: the ranks miss indices"


def test_torchrun_fastload_install(plain_run: dict, tmp_path: Path) -> None:
    """A user keeps ``torch.utils.data.DataLoader`` in train.py and runs the
    same torchrun command with ``FASTLOAD_INSTALL=1`` in the environment."""
    installed = _torchrun(tmp_path, "torch", {"FASTLOAD_INSTALL": "1"})
    for r, rank in installed.items():
        assert rank["iterators"] == [FASTLOAD_ITER] * 2, \
            f"rank {r}: DataLoader did not iterate on fastload under FASTLOAD_INSTALL=1"
        assert rank["batches"]["torch"] == plain_run[r]["batches"]["torch"]
