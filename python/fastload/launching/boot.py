"""The first code that runs in a fresh interpreter fastload starts.

:func:`fastload.launch.spawn` and :class:`fastload.launch.Zygote` start
``python -c "import fastload.boot as b; b.boot(FD)"``; :func:`boot` reads
the child's *header* (a pickle the main side writes) from pipe ``FD`` and
either becomes the zygote (:func:`fastload.zygote.serve`) or runs a worker's
entry point through :func:`run`. A worker the zygote forks runs :func:`run`
too.

:func:`run` sets ``sys.path``, ``sys.argv`` and the ``multiprocessing``
authkey as the parent has them (spawn's preparation data, without the main
module), unpacks the entry point's argument and calls it. A child that fails
before its loop runs writes its traceback to stderr and to its *death note*
pipe, which the main process quotes (:class:`fastload.child.Child`).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from typing import Any, Dict, Sequence

from . import crossing
from .child import NOTE_MAX

__all__ = ["boot", "run"]


def _import(target: str) -> Any:
    module, _, name = target.partition(":")
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)


def run(header: Dict[str, Any], fds: Sequence[int]) -> int:
    """Set up as the parent asked, run the entry point; the exit code."""
    note_fd = header["note_fd"]
    try:
        import multiprocessing

        sys.path[:] = header["sys_path"]
        sys.argv[:] = header["sys_argv"]
        me = multiprocessing.current_process()
        me.authkey = header["authkey"]  # managers and mp connections check it
        target = _import(header["target"])
        arg = crossing.unpack(header["data"], fds)
        target(arg)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported to the parent, then exit 1
        text = traceback.format_exc()
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        try:
            os.write(note_fd, text.encode(errors="replace")[-NOTE_MAX:])
        except OSError:
            pass
        return 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass


def boot(fd: int) -> None:
    """Entry point of a spawned child (``python -c``): read the header from
    pipe ``fd`` and run it; ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with os.fdopen(fd, "rb") as f:
        header = pickle.load(f)
    if header["target"] == "zygote":
        from .zygote import serve

        serve(header)
        os._exit(0)
    # As a forked DataLoader worker ends: no interpreter teardown (with torch
    # loaded it takes seconds, and a stopping loader waits for it).
    os._exit(run(header, header["fds"]))
