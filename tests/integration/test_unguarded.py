"""Scripts without an ``if __name__ == "__main__":`` guard.

Under fork, DataLoader never re-runs the user's script; spawn-started workers
normally import it again, which runs its top-level code (and fails as soon as
that code builds a loader). FastLoader's workers must never run it: the
script's top-level code runs once, and batches of classes the script defines
come back as the script's own classes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .helpers import SCRIPTS, json_result, run, script

pytestmark = pytest.mark.integration


def _check(result, runs: Path) -> None:
    lines = runs.read_text().splitlines() if runs.exists() else []
    assert len(lines) == 1, (
        f"the script's top-level code ran {len(lines)} times, not once: {lines}\n"
        f"--- stderr\n{result.stderr[-3000:]}"
    )
    report = json_result(result)
    for kind in ("namedtuple", "dataclass"):
        got, expected = report[kind]["fastload"], report[kind]["dataloader"]
        assert [b["own_class"] for b in got] == [True] * len(got), \
            f"{kind}: batches are not the script's own class: {[b['class'] for b in got]}"
        assert got == expected, f"{kind}: FastLoader's batches differ from DataLoader's"


@pytest.mark.parametrize("context", ["default", "spawn", "forkserver"])
def test_unguarded_script(tmp_path: Path, context: str) -> None:
    """A user runs ``python train.py`` where train.py has no main guard and
    defines its dataset, a namedtuple and a dataclass at top level."""
    train = script("unguarded.py", tmp_path)
    runs = tmp_path / "runs.txt"
    result = run([sys.executable, str(train), context, str(runs)], cwd=tmp_path, timeout=180)
    _check(result, runs)


@pytest.mark.parametrize("context", ["default", "spawn"])
def test_unguarded_python_c(tmp_path: Path, context: str) -> None:
    """A user pastes the same code into ``python -c "..."`` (no file behind __main__)."""
    runs = tmp_path / "runs.txt"
    code = (SCRIPTS / "unguarded.py").read_text()
    result = run([sys.executable, "-c", code, context, str(runs)], cwd=tmp_path, timeout=180)
    _check(result, runs)


@pytest.mark.parametrize("context", ["default", "spawn"])
def test_unguarded_python_m(tmp_path: Path, context: str) -> None:
    """A user runs the same code as a module of a package: ``python -m trainpkg.train``."""
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((SCRIPTS / "unguarded.py").read_text())
    runs = tmp_path / "runs.txt"
    result = run([sys.executable, "-m", "trainpkg.train", context, str(runs)],
                 cwd=tmp_path, timeout=180)
    _check(result, runs)
