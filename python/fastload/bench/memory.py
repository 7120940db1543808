"""Peak memory of a run's process tree, and whether a process group still runs.

The parent samples the child and all its descendants (workers,
multiprocessing's resource tracker) while the run goes: RSS every 50 ms from
``/proc/<pid>/statm`` and PSS every second from ``/proc/<pid>/smaps_rollup``.
Shared memory is counted once: the PSS of a page mapped by several processes
is split between them, which holds for DataLoader's ``/dev/shm`` tensors and
for fastload's ring alike.

The sampler takes CPU from the run it measures, and on a machine the
workers keep busy that shows in the figures. Reading ``smaps_rollup`` walks
the page tables: a sweep of a 2-worker run (4 torch processes) takes about
17 ms, so PSS every 0.25 s cost 0.05-0.06 of a core, 3% of a 2-core machine
(``jpeg``); every second it costs 0.02 of a core, RSS sampling included. Each
run reports what its sampler used (``sampler_cpu_s``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple


def _tree_by_scan(root: int) -> List[int]:
    """``root`` and its descendants, by reading every ``/proc/<pid>/stat``
    (for kernels without ``CONFIG_PROC_CHILDREN``)."""
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(name))
        except (OSError, ValueError, IndexError):
            pass
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo += kids.get(out[-1], [])
    return out


class MemSampler(threading.Thread):
    """Samples the memory of ``pid`` and all its descendants (module docstring)."""

    def __init__(self, pid: int, every: float = 0.05, pss_every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every = every
        self.pss_every = pss_every
        self.samples: List[Tuple[float, int, Optional[int], int]] = []  # t, rss, pss, procs
        self.has_pss = os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")
        self.cpu_s = 0.0  # CPU time this thread used, known once it has stopped
        self._halt = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._children_files = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")

    def tree(self) -> List[int]:
        """``pid`` and all its live descendants."""
        if not self._children_files:
            return _tree_by_scan(self.pid)
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for tid in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{tid}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
        return out

    def _rss(self, pid: int) -> int:
        """Resident bytes of ``pid``."""
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _pss(pid: int) -> int:
        """Proportional set size of ``pid`` in bytes."""
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        """Sample until :meth:`stop`."""
        next_pss = 0.0
        while not self._halt.is_set():
            now = time.time()
            rss, pss, n = 0, 0 if self.has_pss and now >= next_pss else None, 0
            for p in self.tree():
                try:
                    rss += self._rss(p)
                    if pss is not None:
                        pss += self._pss(p)
                    n += 1
                except (OSError, ValueError):
                    pass
            if pss is not None:
                next_pss = now + self.pss_every
            if n:
                self.samples.append((now, rss, pss, n))
            self._halt.wait(self.every)
        self.cpu_s = time.thread_time()

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self._halt.set()
        self.join()

    def peak(self, t0: float, t1: float) -> Dict[str, Any]:
        """Peak memory between ``t0`` and ``t1`` (wall clock; all samples if none fall there)."""
        win = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples
        rss = max((s[1] for s in win), default=0)
        # A window shorter than the PSS interval may hold RSS samples only:
        # then the PSS samples nearest to it stand in, so that both loaders'
        # figures stay PSS.
        with_pss = [s for s in win if s[2] is not None] or sorted(
            (s for s in self.samples if s[2] is not None),
            key=lambda s: min(abs(s[0] - t0), abs(s[0] - t1)))[:2]
        pss = max((s[2] for s in with_pss), default=None)
        return {"peak_mem_mb": (pss if pss is not None else rss) / 2**20,
                "mem_kind": "PSS" if pss is not None else "RSS",
                "peak_rss_sum_mb": rss / 2**20, "max_procs": max((s[3] for s in win), default=0),
                "sampler_cpu_s": self.cpu_s}


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting for
    init to reap them do not count)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False
