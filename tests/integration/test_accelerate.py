"""🤗 Accelerate under ``fastload.install()`` and ``python -m fastload run``.

``accelerator.prepare`` rebuilds the user's DataLoader inside its own
wrapper, so passing a FastLoader is not enough; installing fastload must make
the loader it builds iterate on fastload, with the same losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import FASTLOAD_ITER, TORCH_ITER, json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("accelerate")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The script as it is, with DataLoader's own workers."""
    where = tmp_path_factory.mktemp("accelerate")
    report = json_result(run([sys.executable, str(script("accelerate_steps.py", where))],
                             cwd=where, timeout=300))
    assert report["iterators"] == [TORCH_ITER] * 2
    return report


def test_accelerate_prepare_under_install(plain: dict, tmp_path: Path) -> None:
    """A user adds ``fastload.install()`` to a script that runs
    ``Accelerator(cpu=True).prepare(model, optimizer, DataLoader(..., num_workers=2))``."""
    steps = script("accelerate_steps.py", tmp_path)
    got = json_result(run([sys.executable, str(steps), "--install"], cwd=tmp_path, timeout=300))
    assert got["loader"] == plain["loader"]
    assert got["iterators"] == [FASTLOAD_ITER] * 2, "the prepared loader did not iterate on fastload"
    assert got["losses"] == plain["losses"]


def test_accelerate_under_fastload_run(plain: dict, tmp_path: Path) -> None:
    """A user leaves the script untouched and runs it as
    ``python -m fastload run accelerate_steps.py``."""
    steps = script("accelerate_steps.py", tmp_path)
    got = json_result(run([sys.executable, "-m", "fastload", "run", str(steps)],
                          cwd=tmp_path, timeout=300))
    assert got["iterators"] == [FASTLOAD_ITER] * 2, "the prepared loader did not iterate on fastload"
    assert got["losses"] == plain["losses"]
