"""Processes, file descriptors and ``/dev/shm`` entries of this test process.

``conftest.no_leaks`` compares them before and after every test; tests use
them to wait for workers to go.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Dict, Iterable, List

import psutil


def children() -> List[psutil.Process]:
    """This process's live descendants, less the helpers that outlive a test.

    multiprocessing's resource tracker and its process-wide forkserver, and
    fastload's fork servers, are shared helpers that live as long as this
    process (fastload.launching.fork_server.fork_servers_held names the latter).
    A pool's own zygote (forked from a fork server) is not: it must end with
    its pool.
    """
    from multiprocessing import forkserver

    from fastload.launching.fork_server import fork_servers_held

    me = psutil.Process()
    out = []
    shared = {forkserver._forkserver._forkserver_pid, *fork_servers_held()[0]}
    for c in me.children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
            if "resource_tracker" in cmd or c.pid in shared:
                continue
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_no_children(timeout: float = 10.0) -> List[psutil.Process]:
    """Poll until :func:`children` is empty; returns what is left (empty on success)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        kids = children()
        if not kids or time.monotonic() > deadline:
            return kids
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a running (non-zombie) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_pids_gone(pids: Iterable[int], timeout: float = 10.0) -> List[int]:
    """Poll until none of ``pids`` runs; returns the survivors (empty on success)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def open_fds() -> set:
    """The names (numbers) of this process's open file descriptors."""
    return set(os.listdir("/proc/self/fd"))


def fds_left(before: set, timeout: float = 5.0) -> Dict[str, str]:
    """The fds open now that were not in ``before`` (an :func:`open_fds`
    listing), with what each points to, once they stay open for ``timeout``
    seconds (objects the collector frees close theirs meanwhile). Those this
    process holds for its fork servers, which outlive every loader by
    design, are not counted."""
    from fastload.launching.fork_server import fork_servers_held

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        servers = {str(fd) for fd in fork_servers_held()[1]}
        # fds that no longer resolve were closed between listing and checking
        left = {fd for fd in open_fds() - before - servers
                if os.path.exists(f"/proc/self/fd/{fd}")}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    targets = {}
    for fd in left:
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return targets


def _foreign(name: str) -> bool:
    """A torch_<pid>_* entry of a live process outside this test process's
    tree (another test run on the same machine)."""
    try:
        pid = int(name.split("_")[1])
        p = psutil.Process(pid)
        return pid != os.getpid() and os.getpid() not in {a.pid for a in p.parents()}
    except (IndexError, ValueError, psutil.Error):
        return False


def shm_entries() -> set:
    """``/dev/shm`` entries of fastload's (and torch's, of this process tree)."""
    try:
        names = {n for n in os.listdir("/dev/shm") if "fastload" in n or n.startswith("torch_")}
    except FileNotFoundError:
        return set()
    return {n for n in names if not (n.startswith("torch_") and _foreign(n))}
