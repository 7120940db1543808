"""The extension links no torch, CUDA or HIP: one wheel serves every torch build."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import fastload._core as core

ALLOWED = re.compile(r"^(libc|libm|libstdc\+\+|libgcc_s|libpthread|librt|libdl|ld-linux[-\w]*)\.so")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) not installed")
def test_extension_needs_only_the_c_runtime() -> None:
    out = subprocess.run(
        ["readelf", "-d", core.__file__], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    assert needed, out
    bad = [n for n in needed if not ALLOWED.match(n)]
    assert not bad, f"{core.__file__} needs {bad}"


def test_import_does_not_initialise_an_accelerator() -> None:
    import torch

    import fastload  # noqa: F401

    assert not torch.cuda.is_initialized()
