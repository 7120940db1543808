"""What the user is told about a worker that died or hangs.

DataLoader's own wording for a worker's exit (so that code matching its
messages keeps working), and a hung worker's Python stack, which the worker
dumps with faulthandler into a memfd the pool keeps for it when it is sent
:data:`STACK_SIGNAL` (docs/design.md, "Never hang silently").
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import time
from typing import Any, Optional

from ..common.protocol import STACK_SIGNAL

# Asks a worker for its Python stack: the worker has faulthandler dump it
# on this signal (fastload.worker.loop), into the memfd the pool keeps for it.


def exited_unseen(proc: Any) -> bool:
    """A ``multiprocessing`` worker that has exited though its ``exitcode``
    never comes: this process ignores SIGCHLD (``SIG_IGN``), so the kernel
    reaped it and its status is lost. Its sentinel (the read end of a pipe
    only the worker held) says it is gone. False for fastload's own
    :class:`~fastload.launching.child.Child` handles, which learn their exit codes."""
    sentinel = getattr(proc, "sentinel", None)
    if sentinel is None or signal.getsignal(signal.SIGCHLD) != signal.SIG_IGN:
        return False
    return bool(multiprocessing.connection.wait([sentinel], 0))


def describe_exit(pid: int, exitcode: Optional[int], note: str = "") -> str:
    """DataLoader's wording for a worker that died; with the worker's own
    last words when it left some (an error at start-up). ``exitcode`` None:
    the status is lost (this process ignores SIGCHLD, so the kernel reaped
    the worker)."""
    if exitcode is None:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly; its exit status is unknown "
                "because this process ignores SIGCHLD (signal.SIG_IGN), so the system reaped "
                "it. " + (f"It failed with:\n{note}\n" if note else ""))
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
            desc = signal.strsignal(-exitcode) or name
        except ValueError:
            desc = f"signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {desc}. "
    if note:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                f"It failed with:\n{note}\n")
    return (
        f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
        "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
        "better error trace. "
    )


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP) or a tracer."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def cpu_ticks(pid: int) -> int:
    """The CPU time ``pid`` has used (user + system, in clock ticks); -1
    when it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # stat's fields 14 and 15
    except (OSError, IndexError, ValueError):
        return -1


def dump_stack(pid: int, stack_fd: int, wait_s: float = 0.5) -> str:
    """Worker ``pid``'s Python stack: it is asked to write it into
    ``stack_fd`` (its own duplicate of that memfd), which is read back
    within ``wait_s`` seconds. A stopped worker is resumed first (it could
    not answer), and the text says so."""
    os.ftruncate(stack_fd, 0)
    os.lseek(stack_fd, 0, os.SEEK_SET)  # the offset is shared with the worker's dup
    note = ""
    try:
        if is_stopped(pid):
            os.kill(pid, signal.SIGCONT)
            note = "(the worker was stopped by a signal; it was resumed to dump this)\n"
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return "(the worker is gone)"
    deadline = time.monotonic() + wait_s
    text = b""
    while time.monotonic() < deadline:
        time.sleep(0.05)
        text = os.pread(stack_fd, 1 << 20, 0)
        if text.endswith(b"\n") and b"most recent call first" in text:
            time.sleep(0.05)  # let the other threads' stacks follow
            text = os.pread(stack_fd, 1 << 20, 0)
            break
    stack = text.decode(errors="replace").rstrip() or "(no stack: the worker did not answer)"
    return note + stack
