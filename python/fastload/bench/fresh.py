"""What the benchmark's extra-table modules share, kept free of torch (some
of them run every measure in a child and stay light themselves):
:func:`run_fresh`, one measure in a fresh interpreter, for modules whose
every run must start cold (a new process, torch imported anew, no loader
before it): the module is run with ``--child`` and the run's spec as JSON,
and prints its result as JSON on the last line of its output; and
:func:`print_and_save`, a module's output when it runs alone, with
:func:`miss_note`, what a ``MISS`` in a report means."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, Optional


def run_fresh(module: str, payload: Dict[str, Any], what: str, timeout: float = 600,
              server_at_import: bool = False) -> Dict[str, Any]:
    """``python -m module --child JSON(payload)``'s result; raises with the
    child's stderr if it fails (``what`` names the run in the message).

    The child imports fastload (its measuring code lives there), which would
    start a fork server beside a DataLoader run: it does so only given
    ``server_at_import`` (a fastload run measured as a script that imports
    fastload at its top)."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(payload)]
    env = dict(os.environ, FASTLOAD_SERVER_AT_IMPORT="1" if server_at_import else "0")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} run {payload} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# Printed after any report that marks a target MISS, so that no one reads a
# missed target as a broken install or a failed check.
MISS_NOTE = ("MISS: a target this project set was not reached on this machine; a finding, not a "
             "failure (the exit status is 1 only if a run failed or a batch was wrong)\n")


def miss_note(text: str) -> str:
    """:data:`MISS_NOTE` if the report ``text`` marks a target ``MISS``, else ''."""
    return MISS_NOTE if "MISS" in text else ""


def print_and_save(text: str, res: Dict[str, Any], path: Optional[str]) -> None:
    """An extra table's module run alone: print its ``text`` (and what a
    MISS in it means) and, given a ``path``, write its runs and medians
    ``res`` there as JSON."""
    sys.stdout.write(text + miss_note(text))
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
