"""Loaders in a process that multiprocessing started: the script is ``__mp_main__``.

A DDP rank started by ``torch.multiprocessing.spawn`` (PyTorch's DDP
tutorial), a ``multiprocessing.Process`` under spawn or forkserver and a
``ProcessPoolExecutor`` worker all import the training script as
``__mp_main__``. Its dataset, sampler, ``collate_fn`` and ``worker_init_fn``
must reach fastload's workers (which never import the script) as
``__main__``'s do, by value, and the script's classes must come back in
batches as the rank's own (``type(b) is Pair``). Each case runs
``tests/scripts/spawned_rank.py`` in a fresh interpreter and compares every
fastload start method's batches against torch's DataLoader's in the same rank.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "spawned_rank.py"


def _run(launcher: str, tmp_path: Path) -> dict:
    script = tmp_path / "train.py"  # a user's own file, outside the test tree
    shutil.copyfile(SCRIPT, script)
    out = subprocess.run([sys.executable, str(script), launcher], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out.stdout + out.stderr
    return json.loads(lines[0][len("RESULT "):])


def _check(got: dict) -> None:
    assert got["module"] == "__mp_main__"  # the case this file is about
    expected = got["result"].pop("DataLoader")
    assert all(b["same_class"] for b in expected)
    assert [x for b in expected for x in b["y"]] == list(range(23, -1, -1))
    for name, batches in got["result"].items():
        assert batches == expected, name


@pytest.mark.heavy
def test_ddp_rank_from_torch_multiprocessing_spawn(tmp_path: Path) -> None:
    _check(_run("mp_spawn", tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["process_spawn", "process_forkserver",
                                      "pool_spawn", "pool_forkserver"])
def test_process_started_by_multiprocessing(tmp_path: Path, launcher: str) -> None:
    _check(_run(launcher, tmp_path))
