"""The extension's ELF dependencies, checked by both wheel smoke tests.

The wheel must need only the C and C++ runtimes (no torch, CUDA or HIP
library) and carry no search path into a build directory (auditwheel adds
``$ORIGIN``-relative ones only when it grafts libraries, which it should
not need to). Copied beside the smoke scripts by ``.ci/wheel``.
"""

from __future__ import annotations

import os
import re
import subprocess

ALLOWED = re.compile(r"^(libc|libm|libdl|libstdc\+\+|libgcc_s|libpthread|librt|ld-linux[-\w]*)\.so")


def check_needed(path: str) -> str:
    """Raise AssertionError unless ``path`` needs only allowed libraries and
    has no foreign RPATH/RUNPATH; returns a line saying what it needs."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    assert needed, out
    bad = [n for n in needed if not ALLOWED.match(n)]
    assert not bad, f"{path} needs {bad} (all: {needed})"
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library (?:rpath|runpath): \[([^\]]*)\]", out)
    bad_paths = [p for p in ":".join(paths).split(":") if p and not p.startswith("$ORIGIN")]
    assert not bad_paths, f"{path} has RPATH/RUNPATH {bad_paths}"
    return f"{os.path.basename(path)} NEEDED: {', '.join(needed)}"
