#!/usr/bin/env bash
# Release: build the fastload wheel, auditwheel-repair it to manylinux and
# run the same checks as CI (.ci/wheel: built without torch, installed from
# the repaired file into a fresh venv with torch, smoke-tested there); only a
# wheel that passed them is copied into wheelhouse/ (or the directory given).
#
#   scripts/build_wheels.sh [DIR]                    # default: <repo>/wheelhouse
#   PYTHON=python3.12 TORCH_SPEC='torch==X' scripts/build_wheels.sh   # another CPython
#
# The wheel is for the CPython that builds it (cp311 by default here); run
# once per Python version to release. Its manylinux tag is the oldest glibc
# this machine's build allows (manylinux_2_34 on Debian 12).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec bash "$ROOT/.ci/wheel" --out "${1:-$ROOT/wheelhouse}"
