"""PyTorch's DDP tutorial: ranks started by ``torch.multiprocessing.spawn``.

In each rank the training script is imported as ``__mp_main__``; its
dataset, sample type and ``collate_fn`` must reach fastload's workers, and
its sample type come back in batches as the rank's own class. Every rank's
batches and losses (a DDP model step per batch, two epochs) must equal
DataLoader's in the same rank, and the ranks must split the dataset.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, check, run, script

pytestmark = pytest.mark.integration


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_ddp_ranks_from_torch_multiprocessing_spawn(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    train = script("ddp_mp_spawn.py", tmp_path)
    check(run([sys.executable, str(train), "--out", str(out), "--port", _free_port()],
              cwd=tmp_path, timeout=600))
    ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1]
    seen = []
    for r, rank in ranks.items():
        assert rank["module"] == "__mp_main__"
        torch_run, fast = rank["runs"]["torch"], rank["runs"]["fastload"]
        assert torch_run["iterators"] == [TORCH_ITER] * 2
        assert fast["iterators"] == [FASTLOAD_ITER] * 2
        assert fast["own_class"] and torch_run["own_class"]
        assert fast["batches"] == torch_run["batches"], f"rank {r}: batches differ from DataLoader's"
        assert fast["losses"] == torch_run["losses"], f"rank {r}: losses differ from DataLoader's"
        seen.append([i for index, _ in fast["batches"][:4] for i in index])  # epoch 0
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(64))
