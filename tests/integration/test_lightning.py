"""Lightning: a LightningModule whose ``train_dataloader`` returns a FastLoader.

Lightning wraps the loader, and under DDP re-creates it (same class, same
arguments, a DistributedSampler swapped in). The loader it trains on must
still be a FastLoader iterating on fastload, and train on what DataLoader
would give it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, check, requires, run, script

pytestmark = [pytest.mark.integration, requires("lightning")]


def _fit(tmp_path: Path, loader: str, *extra: str) -> dict:
    out = tmp_path / f"out-{loader}"
    out.mkdir()
    fit = script("lightning_fit.py", tmp_path)
    check(run([sys.executable, str(fit), "--loader", loader, "--out", str(out), *extra],
              cwd=tmp_path, timeout=600))
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_lightning_fit(tmp_path: Path) -> None:
    """A user fits with ``Trainer(accelerator="cpu", devices=1, max_epochs=2,
    deterministic=True)`` after swapping DataLoader for FastLoader."""
    expected = _fit(tmp_path, "torch")[0]
    got = _fit(tmp_path, "fastload")[0]
    assert expected["iterators"] == [TORCH_ITER] * 2  # the test itself sees what it should
    assert got["loaders"] == [["FastLoader", "RandomSampler"]] * 2
    assert got["iterators"] == [FASTLOAD_ITER] * 2
    assert got["indices"] == expected["indices"]
    assert got["losses"] == expected["losses"]


def test_lightning_ddp(tmp_path: Path) -> None:
    """A user fits with ``strategy="ddp", devices=2`` on CPU (gloo): Lightning
    launches the second rank and re-creates the FastLoader with a DistributedSampler."""
    ranks = _fit(tmp_path, "fastload", "--devices", "2", "--strategy", "ddp")
    assert sorted(ranks) == [0, 1]
    for rank in ranks.values():
        assert rank["world_size"] == 2
        assert rank["loaders"] == [["FastLoader", "DistributedSampler"]] * 2
        assert rank["iterators"] == [FASTLOAD_ITER] * 2
    for epoch in range(2):
        first, second = ranks[0]["indices"][epoch], ranks[1]["indices"][epoch]
        assert not set(first) & set(second), f"epoch {epoch}: both ranks trained on some indices"
        assert sorted(first + second) == list(range(48)), f"epoch {epoch}: the ranks miss indices"


def test_lightning_resumes_mid_epoch(tmp_path: Path) -> None:
    """``fit(ckpt_path=...)`` from a checkpoint taken at step 5 of a 10-step
    epoch: Lightning saves the FastLoader's ``state_dict()`` and loads it into
    the new loader; the resumed fit trains on exactly the batches (indices and
    worker-drawn noise) of the never-stopped fit from step 5 on, the next
    epoch included."""
    resume_script = script("lightning_resume.py", tmp_path)
    out = tmp_path / "out"
    out.mkdir()

    def fit(*args: str) -> list:
        check(run([sys.executable, str(resume_script), *args, "--out", str(out)],
                  cwd=tmp_path, timeout=600))
        return json.loads((out / f"{args[0]}.json").read_text())["steps"]

    full = fit("full")
    stopped = fit("stop")
    ckpt = out / "ckpt" / "epoch=0-step=5.ckpt"
    assert ckpt.exists()
    resumed = fit("resume", "--ckpt", str(ckpt))
    assert len(full) == 20 and stopped == full[:7]
    assert [s[0] for s in resumed] == list(range(5, 20))
    assert resumed == full[5:]
