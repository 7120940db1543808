"""``transformers.Trainer`` under ``fastload.install()``.

The Trainer builds its DataLoader itself (and hands it to Accelerate), so
the user cannot pass a FastLoader; ``fastload.install()`` must make that
loader iterate on fastload, with the same losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("transformers", "accelerate")]


def test_hf_trainer_under_install(tmp_path: Path) -> None:
    """A user adds ``fastload.install()`` to a script that trains a tiny BERT
    with ``Trainer`` and ``TrainingArguments(dataloader_num_workers=2, use_cpu=True)``."""
    train = script("hf_trainer.py", tmp_path)
    expected = json_result(run([sys.executable, str(train), "--out", str(tmp_path / "plain")],
                               cwd=tmp_path, timeout=300))
    got = json_result(run([sys.executable, str(train), "--out", str(tmp_path / "installed"),
                           "--install"], cwd=tmp_path, timeout=300))
    assert expected["iterators"] == [TORCH_ITER]
    assert len(expected["losses"]) == 6
    assert got["iterators"] == [FASTLOAD_ITER], "the Trainer's loader did not iterate on fastload"
    assert got["losses"] == expected["losses"]
