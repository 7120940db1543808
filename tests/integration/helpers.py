"""Running a user's script the way the user runs it, and reading what it printed.

Every run is a real subprocess with a timeout. Each run's process tree is
marked by an environment variable that all its descendants inherit (workers,
zygotes, Jupyter kernels, torchrun's and Lightning's rank processes), so a
process left behind is found even after it was re-parented, reported as a
failure, and killed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import psutil
import pytest

import fastload

SCRIPTS = Path(__file__).parent / "scripts"

_RUN_MARK = "FASTLOAD_INTEGRATION_RUN"

# What a test skipped for a missing library tells the user to run.
INTEGRATION_EXTRA = "pip install -c .ci/constraints.txt '.[integration]'"


def requires(*modules: str) -> pytest.MarkDecorator:
    """Skip (with the install command) when a library is not installed.

    The libraries run only in subprocesses, so they are looked up, not
    imported, here: importing them in the test process would cost seconds
    and let their import-time warnings meet pytest's ``error`` filter.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"needs {', '.join(missing)} (not installed): {INTEGRATION_EXTRA}",
    )


def script(name: str, where: Path) -> Path:
    """Copy ``scripts/<name>`` into ``where``, as a user's own file would lie."""
    target = where / name
    shutil.copyfile(SCRIPTS / name, target)
    return target


def _pythonpath() -> str:
    """PYTHONPATH for the child: the fastload package this test imported
    (a source checkout on PYTHONPATH, or installed), then the caller's."""
    root = str(Path(fastload.__file__).resolve().parent.parent)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in site.getsitepackages() and root not in parts:
        parts.insert(0, root)
    return os.pathsep.join(parts)


def _environment(extra: Optional[Dict[str, str]], mark: str, home: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_INSTALL"}
    env.update(
        PYTHONPATH=_pythonpath(),
        PYTHONUNBUFFERED="1",
        # One intra-op thread per process (torchrun's default too): a run starts
        # many processes, and this keeps them from oversubscribing the cores.
        OMP_NUM_THREADS="1",
        # No network: nothing may be fetched from a hub, and caches stay in tmp.
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(home / "hf"),
        TOKENIZERS_PARALLELISM="false",
        MPLCONFIGDIR=str(home / "mpl"),
        JUPYTER_PLATFORM_DIRS="1",
    )
    env.update(extra or {})
    env[_RUN_MARK] = mark
    return env


def _marked(mark: str) -> List[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(_RUN_MARK) == mark:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def _kill(procs: Sequence[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def _describe(procs: Sequence[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            out.append(f"pid {p.pid}")
    return "; ".join(out)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tail(text: str, n: int = 6000) -> str:
    """The end of a run's output, without terminal colours (Jupyter tracebacks have them)."""
    text = _ANSI.sub("", text)
    return text if len(text) <= n else "...\n" + text[-n:]


def _shown(cmd: Sequence[str]) -> str:
    """A command line for messages (the code of ``python -c`` cut to its first line)."""
    return " ".join(a if len(a) < 120 else a.splitlines()[0][:80] + " ..." for a in cmd)


def run(
    cmd: Sequence[str],
    *,
    cwd: Path,
    timeout: float,
    env: Optional[Dict[str, str]] = None,
    linger: float = 10.0,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion and return its exit status and output.

    Fails the test if it runs past ``timeout`` seconds, or if any process it
    started is still alive ``linger`` seconds after it exited; either way
    every process of the run is killed first.
    """
    mark = uuid.uuid4().hex
    # Output goes to files, not pipes: a process left behind holding a pipe
    # would keep the wait open until the timeout and hide what it is.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=_environment(env, mark, Path(cwd)),
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(_marked(mark))
            proc.kill()
            proc.wait()
            out.seek(0)
            err.seek(0)
            pytest.fail(
                f"{_shown(cmd)} did not finish within {timeout} s\n"
                f"--- stdout\n{tail(out.read())}\n--- stderr\n{tail(err.read())}"
            )
        deadline = time.monotonic() + linger
        left = _marked(mark)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _marked(mark)
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(list(cmd), proc.returncode, out.read(), err.read())
    if left:
        what = _describe(left)
        _kill(left)
        pytest.fail(
            f"{_shown(cmd)} left processes behind {linger} s after it exited: {what}\n"
            f"--- stderr\n{tail(result.stderr)}"
        )
    return result


def run_python(args: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    return run([sys.executable, *args], **kw)


def check(result: subprocess.CompletedProcess) -> None:
    """Fail with the run's output if it exited with an error."""
    if result.returncode != 0:
        pytest.fail(
            f"{_shown(result.args)} exited with {result.returncode}\n"
            f"--- stdout\n{tail(result.stdout)}\n--- stderr\n{tail(result.stderr)}"
        )


def json_result(result: subprocess.CompletedProcess) -> Dict[str, Any]:
    """The last line of stdout that is a JSON object (what the script reports)."""
    check(result)
    for line in reversed(result.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    pytest.fail(f"no JSON line in the output of {_shown(result.args)}\n"
                f"--- stdout\n{tail(result.stdout)}\n--- stderr\n{tail(result.stderr)}")


FASTLOAD_ITER = "fastload.iterator.multi_process.FastLoaderIter"
TORCH_ITER = "torch.utils.data.dataloader._MultiProcessingDataLoaderIter"
