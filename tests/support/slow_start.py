"""Spawned workers whose start-up, before they join the ring, takes as long
as a test says: busy on the CPU, or blocked.

A fresh interpreter imports ``sitecustomize`` from its ``sys.path`` as it
starts, before any of fastload's code runs; a directory put first on
``PYTHONPATH`` decides which one. :func:`slow_start` writes such a
``sitecustomize`` and puts its directory there for the processes the test
starts. It acts only in a spawned fastload worker (a fresh interpreter
running ``fastload.launching.boot``, not a zygote): it burns ``busy_s``
seconds of CPU time, then sleeps ``sleep_s`` seconds, then marks the
worker's pid as started in the directory. The worker then starts as usual:
it imports fastload and torch and joins the ring.

This is the part of a start-up the hang watchdog credits with the CPU time
it uses (``fastload.pool.supervisor``): what comes after the worker has joined,
its session set-up (unpickling the dataset, importing the dataset's module,
``worker_init_fn``), is a task held to ``hang_timeout`` like a batch, so a
slow dataset could not stand in for a slow start-up.
"""

from __future__ import annotations

import os
from typing import Dict

import pytest

_SITECUSTOMIZE = '''\
import os
import sys
import time

if any("fastload.launching.boot" in a and "zygote" not in a for a in sys.orig_argv):
    _t0 = time.process_time()
    while time.process_time() - _t0 < {busy_s!r}:
        pass
    time.sleep({sleep_s!r})
    with open(os.path.join({marks!r}, "started-%d" % os.getpid()), "w") as _f:
        _f.write(repr(time.process_time() - _t0))
'''


def slow_start(monkeypatch: pytest.MonkeyPatch, directory: str, *, busy_s: float = 0.0,
               sleep_s: float = 0.0) -> None:
    """Have the fastload workers spawned from now on (until ``monkeypatch``
    undoes it) spend ``busy_s`` seconds of CPU time, then ``sleep_s``
    seconds asleep, at the very start of their start-up."""
    with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(busy_s=busy_s, sleep_s=sleep_s, marks=directory))
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", directory + (os.pathsep + path if path else ""))


def started(directory: str) -> Dict[int, float]:
    """The workers that got through the slow part of their start-up: pid ->
    CPU seconds it took them."""
    out = {}
    for name in os.listdir(directory):
        if name.startswith("started-"):
            with open(os.path.join(directory, name)) as f:
                out[int(name.split("-")[1])] = float(f.read())
    return out
