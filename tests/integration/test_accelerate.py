"""🤗 Accelerate under ``fastload.install()``.

``accelerator.prepare`` rebuilds the user's DataLoader inside its own
wrapper, so passing a FastLoader is not enough; ``fastload.install()`` must
make the loader it builds iterate on fastload, with the same losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("accelerate")]


def test_accelerate_prepare_under_install(tmp_path: Path) -> None:
    """A user adds ``fastload.install()`` to a script that runs
    ``Accelerator(cpu=True).prepare(model, optimizer, DataLoader(..., num_workers=2))``."""
    steps = script("accelerate_steps.py", tmp_path)
    expected = json_result(run([sys.executable, str(steps)], cwd=tmp_path, timeout=300))
    got = json_result(run([sys.executable, str(steps), "--install"], cwd=tmp_path, timeout=300))
    assert expected["iterators"] == [TORCH_ITER] * 2
    assert got["loader"] == expected["loader"]
    assert got["iterators"] == [FASTLOAD_ITER] * 2, "the prepared loader did not iterate on fastload"
    assert got["losses"] == expected["losses"]
