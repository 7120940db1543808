"""A handle on a worker process that fastload started itself.

:class:`Child` stands for a worker started by
:func:`fastload.launching.spawn.spawn` or forked by a
:class:`fastload.launching.zygote.Zygote`, in the main process. It
quacks like ``multiprocessing.Process`` where the pool needs it: ``pid``,
``exitcode`` (negative for a signal), ``is_alive()``, ``join()``,
``terminate()``, ``kill()``. A spawned child is watched through its
``Popen``; a forked one through a pidfd, its exit status coming from the
zygote that reaped it.

It also reads the child's *death note*: a child that fails before its loop
runs (an import error, an unpicklable spec) writes its traceback to a pipe
(:func:`fastload.launching.entry.run`), at most :data:`NOTE_MAX` bytes of it, and the
main process quotes it in the error instead of "details are lost".
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from typing import List, Optional, Protocol, Tuple

__all__ = ["Child", "ExitReports", "NOTE_MAX", "note_pipe"]

NOTE_MAX = 1 << 16  # the most of a death note that is kept


class ExitReports(Protocol):
    """What a :class:`Child` forked by a zygote asks of it: the exit codes
    it reports for the processes it reaped (a
    :class:`fastload.launching.zygote.Zygote` is one)."""

    @property
    def alive(self) -> bool:
        """Whether the zygote still runs (and so can still report)."""
        ...

    def exit_code(self, pid: int, wait: float = 0.0) -> Optional[int]:
        """The exit code reported for ``pid``, waiting up to ``wait`` s for it."""
        ...


class Child:
    """A worker process started by fastload (spawned or forked by a zygote)."""

    def __init__(self, pid: int, note_fd: int, popen: Optional[subprocess.Popen] = None,
                 zygote: Optional[ExitReports] = None) -> None:
        self.pid = pid
        self._popen = popen
        self._zygote = zygote
        self._note_fd = note_fd
        self._note = b""
        self._code: Optional[int] = None
        self._pidfd: Optional[int] = None
        if popen is None:
            try:
                self._pidfd = os.pidfd_open(pid)
            except ProcessLookupError:  # already gone (and reaped by the zygote)
                self._pidfd = None
        self._closed = False

    # -- multiprocessing.Process's surface ------------------------------------
    @property
    def exitcode(self) -> Optional[int]:
        if self._code is None:
            self._code = self._poll()
            if self._code is not None:
                self._read_note()
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._wait_gone(0.05 if left is None else min(0.05, left))

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    # -- fastload's additions ---------------------------------------------------
    @property
    def pidfd(self) -> Optional[int]:
        """The child's pidfd, if this handle holds one (a zygote's child)."""
        return None if self._closed else self._pidfd

    @property
    def death_note(self) -> str:
        """What the child wrote before dying of an error at start-up, if anything."""
        self._read_note()
        return self._note.decode(errors="replace").strip()

    def held_fds(self) -> List[int]:
        """The fds this handle holds (its death-note pipe, its pidfd)."""
        if self._closed:
            return []
        return [fd for fd in (self._note_fd, self._pidfd) if fd is not None]

    def close(self) -> None:
        """Release the handle's fds (the process must be gone or not our concern)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._note_fd, self._pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __del__(self) -> None:
        self.close()

    # -- internals --------------------------------------------------------------
    def _poll(self) -> Optional[int]:
        if self._popen is not None:
            return self._popen.poll()
        assert self._zygote is not None
        code = self._zygote.exit_code(self.pid)
        if code is not None:
            return code
        if self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]:
            return None  # still running
        # Gone; its zygote reports the status once it has reaped it.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            code = self._zygote.exit_code(self.pid, wait=0.05)
            if code is not None:
                return code
            if not self._zygote.alive:
                break
        return 255  # exited; the zygote that could tell how is gone (multiprocessing's code)

    def _wait_gone(self, timeout: float) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        elif self._pidfd is not None:
            select.select([self._pidfd], [], [], timeout)
        else:
            time.sleep(timeout)

    def _signal(self, sig: int) -> None:
        if self._code is not None:
            return
        try:
            if self._popen is not None:
                self._popen.send_signal(sig)
            elif self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
        except (ProcessLookupError, OSError):
            pass

    def _read_note(self) -> None:
        if self._closed:
            return
        try:
            while True:
                chunk = os.read(self._note_fd, NOTE_MAX)
                if not chunk:
                    break
                self._note = (self._note + chunk)[-NOTE_MAX:]
        except (BlockingIOError, OSError):
            pass


def note_pipe() -> Tuple[int, int]:
    """A death-note pipe: (read end, non-blocking; write end, for the child)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w
