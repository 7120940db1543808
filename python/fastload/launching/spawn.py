"""Starting fresh interpreters that never run the training script (main side).

``multiprocessing``'s spawn and forkserver start a child by re-importing the
parent's ``__main__`` (the script, as ``__mp_main__``): a script without an
``if __name__ == "__main__":`` guard then runs its top-level code once per
worker, and a worker that builds a loader there dies with "An attempt has been
made to start a new process before the current process has finished its
bootstrapping phase". fastload's workers need nothing from ``__main__``:
everything they use travels by value (:mod:`fastload.launching.parcels`).
So fastload starts its children itself, each a fresh interpreter running
:data:`BOOT_COMMAND`: :func:`fastload.launching.boot.boot` reads the child's
*header* (:func:`child_header`) from a pipe, sets ``sys.path`` and
``sys.argv`` as the parent has them, and calls the child's entry point.
Two launchers start them:

* :func:`spawn` — a fresh interpreter per worker. Real spawn: nothing is
  inherited but the fds named in the header.
* :class:`fastload.launching.zygote.Zygote` — one such interpreter
  that imports torch once and then forks a worker per request.

Both put the child in a process group of its own: Ctrl-C at the terminal
goes to the foreground process group, so to the training process alone, which
raises KeyboardInterrupt and stops the workers, and no SIGINT has to be
blocked or ignored in the training process while a worker starts. The child
stays in the training process's session (no ``setsid``), as DataLoader's
workers do: where the kernel groups the scheduler's fair share by session
(``sched_autogroup``, on in most distributions' kernels), the workers and the
training process share one group, as with DataLoader, rather than the workers
being a group of their own that busy neighbours in other sessions squeeze to
its even share. Workers end when the training process does (see
``worker._MainWatch``).

Both return a :class:`fastload.launching.child.Child`, a handle that quacks
like ``multiprocessing.Process`` and reads the child's death note.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from typing import Any, Dict, Mapping, Optional

from . import parcels
from .child import Child, note_pipe
from ..common.protocol import ACCELERATOR_ENV

__all__ = ["spawn", "child_header", "child_env", "hidden_env", "ACCELERATOR_ENV",
           "OWN_PROCESS_GROUP", "BOOT_COMMAND", "ZYGOTE_BOOT_COMMAND"]

# The child leads a process group of its own (``setpgid(0, 0)`` before exec).
# 3.10's Popen has no ``process_group``; ``os.setpgrp`` is one system call.
OWN_PROCESS_GROUP: Dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp})

BOOT_COMMAND = "import fastload.launching.boot as b; b.boot({fd})"
# A zygote's command line is told apart from its workers' in process lists.
ZYGOTE_BOOT_COMMAND = BOOT_COMMAND + "  # fastload zygote"


def child_header(target: str, note_fd: int, parcel: parcels.Parcel) -> bytes:
    """What a child needs before anything else: the parent's import path and
    argv (spawn's preparation data, without the main module), the entry
    point, the death-note fd and the parcel's fd numbers."""
    me = multiprocessing.current_process()
    return pickle.dumps({
        "sys_path": list(sys.path),
        "sys_argv": list(sys.argv),
        "authkey": bytes(me.authkey),
        "target": target,
        "note_fd": note_fd,
        "fds": list(parcel.fds),
        "data": parcel.data,
    }, protocol=pickle.HIGHEST_PROTOCOL)


def hidden_env(hide: bool) -> Dict[str, str]:
    """The environment overlay that hides accelerators from a fresh
    interpreter (it reads the variables before any of our code runs; a
    worker forked from a zygote sets them again first thing)."""
    return {k: "" for k in ACCELERATOR_ENV} if hide else {}


def child_env(env: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """A child's environment: this process's, ``env`` overlaid."""
    out = dict(os.environ)
    if env:
        out.update(env)
    return out


def spawn(target: str, parcel: parcels.Parcel, env: Optional[Mapping[str, str]] = None) -> Child:
    """Start ``target(unpacked parcel)`` (``"module:function"``) in a fresh
    interpreter; ``env`` is overlaid on this process's environment."""
    note_r, note_w = note_pipe()
    r, w = os.pipe()
    try:
        header = child_header(target, note_w, parcel)
        popen = subprocess.Popen(
            [sys.executable, "-c", BOOT_COMMAND.format(fd=r)],
            pass_fds=(r, note_w, *parcel.fds), env=child_env(env), **OWN_PROCESS_GROUP,
        )
    except BaseException:
        for fd in (r, w, note_r, note_w):
            os.close(fd)
        raise
    os.close(r)
    os.close(note_w)
    child = Child(popen.pid, note_r, popen=popen)
    try:
        with os.fdopen(w, "wb") as f:
            f.write(header)
    except BrokenPipeError:  # it died at once; its exit code says the rest
        pass
    return child
