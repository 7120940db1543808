"""torchdata's StatefulDataLoader: a state it saved is taken over by a FastLoader.

Its state carries the position and the order (its sampler keeps the
generator state the epoch's permutation was drawn from), so a FastLoader
made with the same arguments, given that state, delivers the rest of
StatefulDataLoader's epoch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import json_result, requires, run, script

pytestmark = [pytest.mark.integration, requires("torchdata")]


@pytest.mark.parametrize("args", [
    ("--workers", "2", "--stop", "3"),
    ("--workers", "0", "--stop", "5"),
    ("--workers", "2", "--stop", "4", "--no-shuffle"),
    ("--workers", "1", "--stop", "0"),
], ids=["shuffled-2-workers", "shuffled-0-workers", "sequential", "before-the-first-batch"])
def test_stateful_dataloader_state_is_taken_over(tmp_path: Path, args: tuple) -> None:
    handover = script("stateful_dataloader_handover.py", tmp_path)
    got = json_result(run([sys.executable, str(handover), *args], cwd=tmp_path, timeout=300))
    stop = len(got["head"])
    assert got["head"] == got["full"][:stop]
    assert got["rest"] == got["full"][stop:]
