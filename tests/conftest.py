"""Shared fixtures: every test is checked for leaked processes, fds and /dev/shm entries."""

from __future__ import annotations

import gc
import os
import time
from typing import List

import psutil
import pytest


def _children() -> List[psutil.Process]:
    from multiprocessing import forkserver

    me = psutil.Process()
    out = []
    # multiprocessing's resource tracker and its process-wide forkserver are
    # shared helpers that live as long as this process. A pool's own zygote
    # (also a forkserver) is not: it must end with its pool.
    shared_forkserver = forkserver._forkserver._forkserver_pid
    for c in me.children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
            if "resource_tracker" in cmd or c.pid == shared_forkserver:
                continue
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def _fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def _foreign(name: str) -> bool:
    """A torch_<pid>_* entry of a live process outside this test process's
    tree (another test run on the same machine)."""
    try:
        pid = int(name.split("_")[1])
        p = psutil.Process(pid)
        return pid != os.getpid() and os.getpid() not in {a.pid for a in p.parents()}
    except (IndexError, ValueError, psutil.Error):
        return False


def _shm() -> set:
    try:
        names = {n for n in os.listdir("/dev/shm") if "fastload" in n or n.startswith("torch_")}
    except FileNotFoundError:
        return set()
    return {n for n in names if not (n.startswith("torch_") and _foreign(n))}


def wait_no_children(timeout: float = 10.0) -> List[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        kids = _children()
        if not kids or time.monotonic() > deadline:
            return kids
        time.sleep(0.05)


@pytest.fixture(scope="session", autouse=True)
def _resource_tracker_running():
    """The first spawn starts multiprocessing's resource tracker, whose pipe
    stays open in this process for good: start it before any fd snapshot."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a worker process, an fd or a /dev/shm entry behind."""
    fds_before = _fds()
    shm_before = _shm()
    yield
    kids = wait_no_children()
    assert not kids, f"worker processes left behind: {[(k.pid, k.cmdline()) for k in kids]}"
    gc.collect()
    deadline = time.monotonic() + 5
    while True:
        leaked = _fds() - fds_before
        # fds that no longer resolve were closed between listing and checking
        leaked = {fd for fd in leaked if os.path.exists(f"/proc/self/fd/{fd}")}
        if not leaked or time.monotonic() > deadline:
            break
        gc.collect()
        time.sleep(0.05)
    targets = {}
    for fd in leaked:
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    assert not targets, f"file descriptors left open: {targets}"
    assert _shm() - shm_before == set(), f"/dev/shm entries left: {_shm() - shm_before}"
