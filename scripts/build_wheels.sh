#!/usr/bin/env bash
# Release: build the fastload wheels, one per supported CPython, at
# manylinux_2_28 (zig as the compiler, auditwheel to prove and set the tag),
# and run the same checks as CI (.ci/wheel: built without torch, each
# installed from the repaired file into a fresh venv of its Python and
# smoke-tested there); only wheels that passed are copied into wheelhouse/
# (or the directory given).
#
#   scripts/build_wheels.sh [DIR]                  # default: <repo>/wheelhouse
#   PYTHONS="3.11 3.12" scripts/build_wheels.sh    # fewer Pythons (default 3.10-3.13)
#
# .ci/wheel --help lists the other settings (TORCH_PYTHON, TORCH_SPEC).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec bash "$ROOT/.ci/wheel" --out "${1:-$ROOT/wheelhouse}"
