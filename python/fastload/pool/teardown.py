"""Stopping a worker pool: what :meth:`fastload.pool.worker_pool.WorkerPool.shutdown`
and the pool's finalizer run (NOTE [ Shutdown ] in iterator/workers.py).

The ring's shutdown flag first (every worker sees it at its next look at
the ring and exits), then SIGTERM for a worker that does not stop within
the grace period, then SIGKILL; the zygotes after their workers; last, this
process's ends of the channels, stack memfds, overflow segments and the
ring's fd. Idempotent and safe at interpreter exit: it never raises.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, List, Sequence

from .. import _core
from .exits import exited_unseen
from ..launching.child import Child
from ..launching.zygote import Zygote
from .handles import WorkerHandles

log = logging.getLogger("fastload")


def stop_pool(ring: "_core.Ring", workers: WorkerHandles, zygotes: List[Zygote], owner_pid: int,
              grace_s: float = 2.0, leases: Sequence[Any] = ()) -> None:
    """Stop workers and release our ends; idempotent; safe at interpreter exit.

    In a process forked from the owner (which inherited the pool object and
    may collect it) only this process's copies of the fds are closed: the
    ring, the workers and the zygote are the owner's."""
    if os.getpid() != owner_pid:
        _close_fds(workers, ring)
        return
    procs = workers.procs
    try:
        ring.shutdown()
    except Exception:  # pragma: no cover - never let clean-up raise
        pass
    for i, p in enumerate(procs):
        try:
            # Still starting (importing torch): it would only see the
            # shutdown flag seconds from now. Nothing of ours runs in it yet.
            if p.pid is not None and ring.worker_pid(i) == 0 and p.is_alive():
                p.terminate()
        except Exception:  # pragma: no cover
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # pragma: no cover
            pass
    for p in procs:
        try:
            if p.pid is not None and p.is_alive() and not exited_unseen(p):
                # Not a warning: a worker inside a slow __getitem__ cannot
                # see the stop until it returns; DataLoader terminates such
                # workers silently too.
                log.info("fastload worker pid %s did not stop in %.1fs; terminating it",
                         p.pid, grace_s)
                p.terminate()
                p.join(1.0)
                if p.is_alive():
                    p.kill()
                    p.join(1.0)
        except Exception:  # pragma: no cover
            pass
    for zygote in zygotes:  # after its workers
        try:
            zygote.stop()
        except Exception:  # pragma: no cover
            pass
    for lease in leases:  # on the fork server the zygotes came from
        try:
            lease.release()
        except Exception:  # pragma: no cover
            pass
    for p in procs:
        if isinstance(p, Child):
            p.close()  # its pidfd and death-note pipe; its exit code stays readable
    _close_fds(workers, ring)


def _close_fds(workers: WorkerHandles, ring: "_core.Ring") -> None:
    workers.close_fds()
    try:
        ring.close_fd()
    except Exception:  # pragma: no cover
        pass
