"""What every child fastload starts runs first: set up, then the entry point.

A spawned worker (through :func:`fastload.launching.boot.boot`) and a worker
a zygote forks (:mod:`fastload.launching.zygote_main`) both call :func:`run`
with their *header*, a dict the main side pickled for them
(:func:`fastload.launching.spawn.child_header`). :func:`run` sets ``sys.path``,
``sys.argv`` and the ``multiprocessing`` authkey as the parent has them
(spawn's preparation data, without the main module), unpacks the entry
point's argument and calls it. A child that fails before its loop runs
writes its traceback to stderr and to its *death note* pipe, which the main
process quotes (:class:`fastload.launching.child.Child`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from typing import Any, Dict, Sequence

from . import parcels
from .child import NOTE_MAX

__all__ = ["run"]


def _import(target: str) -> Any:
    module, _, name = target.partition(":")
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)


def run(header: Dict[str, Any], fds: Sequence[int]) -> int:
    """Set up as the parent asked, run the entry point; the exit code."""
    note_fd = header["note_fd"]
    try:
        sys.path[:] = header["sys_path"]
        sys.argv[:] = header["sys_argv"]
        me = multiprocessing.current_process()
        me.authkey = header["authkey"]  # managers and mp connections check it
        target = _import(header["target"])
        arg = parcels.unpack(header["data"], fds)
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

