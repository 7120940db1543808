"""Torch-free smoke test of an *installed* fastload wheel; run by .ci/wheel.

For the Pythons that have no torch here: .ci/wheel installs the repaired
wheel (without its dependencies) into a fresh venv of that interpreter and
runs this file from an empty directory outside the source tree:

    python wheel_smoke_core.py SOURCE_TREE

Checks: the extension ``fastload._core`` is the venv's and loads; its
version metadata is fastload.__version__; a ring made here round-trips bytes
with a child process that attaches to its memfd: the child takes the task,
reads it from the slot and writes its reply there, the parent reads it back;
the extension needs only the C/C++ runtime (readelf -d).
Prints ``wheel core smoke: OK (N checks)`` at the end, or raises.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from types import ModuleType

from elf_check import check_needed  # copied beside this script by .ci/wheel

TASK = b"ping from the parent"
REPLY = b"pong from the child"
SEQ = 7
WORKER = 0



def load_core() -> ModuleType:
    """Load fastload/_core*.so without running fastload/__init__.py.

    ``import fastload._core`` would run the package's __init__, which imports
    torch, and these venvs have none. find_spec of the top-level package only
    locates it (it does not execute it); the extension is then loaded from
    that directory under its real name, as the import system would, so this
    checks the very file a user's ``import fastload`` gets.
    """
    pkg = importlib.util.find_spec("fastload")
    assert pkg is not None and pkg.submodule_search_locations, "fastload is not installed"
    spec = importlib.machinery.PathFinder.find_spec("fastload._core", list(pkg.submodule_search_locations))
    assert spec is not None and spec.origin, f"no fastload/_core extension in {pkg.submodule_search_locations}"
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)  # type: ignore[union-attr]
    assert "fastload" not in sys.modules, "loading the extension ran fastload/__init__.py"
    return core


def child(fd: int) -> None:
    """The worker side: attach to the parent's ring through fd, take the
    task, answer it in the same slot."""
    core = load_core()
    ring = core.WorkerRing.attach(fd)
    ring.worker_started(WORKER, os.getpid())
    st, slot, seq, n = ring.next_task(10.0)
    assert st == core.WaitResult.READY, st
    assert seq == SEQ and n == len(TASK), (seq, n)
    mv = memoryview(ring.payload_region())
    start = slot * ring.slot_bytes
    assert bytes(mv[start:start + n]) == TASK, bytes(mv[start:start + n])
    mv[start:start + len(REPLY)] = REPLY
    del mv
    ring.commit(slot, 0, len(REPLY), 0, 0)


def under(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def main() -> None:
    source_tree = sys.argv[1]
    checks = 0

    core = load_core()
    venv = sys.prefix
    assert venv != sys.base_prefix, f"not running in a venv: {sys.prefix}"
    assert under(core.__file__, venv), f"{core.__file__} is not from the venv {venv}"
    assert not under(core.__file__, source_tree), f"{core.__file__} is from the source tree"
    print(f"Python {sys.version.split()[0]}: {core.__file__}")
    checks += 1

    # The wheel's version is fastload.__version__ (read from __init__.py's
    # text: importing it would import torch).
    init = os.path.join(os.path.dirname(core.__file__), "__init__.py")
    with open(init, encoding="utf-8") as f:
        written = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    assert written, f"no __version__ in {init}"
    assert importlib.metadata.version("fastload") == written.group(1), (
        importlib.metadata.version("fastload"), written.group(1))
    print(f"fastload {written.group(1)}")
    checks += 1

    ring = core.Ring.create(2, 1, 1 << 16)
    slot = ring.pop_free_slot()
    assert slot is not None
    ring.assign(slot, SEQ, WORKER, TASK)
    proc = subprocess.run([sys.executable, __file__, "--child", str(ring.fd)],
                          pass_fds=(ring.fd,), timeout=60)
    assert proc.returncode == 0, f"child exited {proc.returncode}"
    assert ring.wait_ready(slot, SEQ, 10.0) == core.WaitResult.READY
    kind, data_len, _, _, _ = ring.result(slot)
    assert (kind, data_len) == (0, len(REPLY)), ring.result(slot)
    mv = memoryview(ring.payload_region())
    start = slot * ring.slot_bytes
    assert bytes(mv[start:start + data_len]) == REPLY, bytes(mv[start:start + data_len])
    del mv
    ring.release(slot)
    assert ring.free_slot_count() == 2
    print(f"ring ({ring.backend}): {len(TASK)} bytes to a child process, {len(REPLY)} bytes back")
    checks += 1

    print(check_needed(core.__file__))
    checks += 1

    print(f"wheel core smoke: OK ({checks} checks)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        main()
