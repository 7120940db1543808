"""One measure in a fresh interpreter, for the bench modules whose every run
must start cold (a new process, torch imported anew, no loader before it):
the module is run with ``--child`` and the run's spec as JSON, and prints
its result as JSON on the last line of its output."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Dict


def run_fresh(module: str, payload: Dict[str, Any], what: str, timeout: float = 600) -> Dict[str, Any]:
    """``python -m module --child JSON(payload)``'s result; raises with the
    child's stderr if it fails (``what`` names the run in the message)."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(payload)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} run {payload} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
