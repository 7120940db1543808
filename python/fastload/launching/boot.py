"""The first code that runs in a fresh interpreter fastload starts.

:func:`fastload.launching.spawn.spawn` and
:class:`fastload.launching.zygote.Zygote` start ``python -c "import
fastload.launching.boot as b; b.boot(FD)"``; :func:`boot` reads the child's
*header* (a pickle the main side writes) from pipe ``FD`` and either becomes
the zygote (:func:`fastload.launching.zygote_main.serve`) or runs a worker's
entry point (:func:`fastload.launching.entry.run`).
"""

from __future__ import annotations

import os
import pickle
import signal

from .entry import run
from .zygote_main import serve

__all__ = ["boot"]


def boot(fd: int) -> None:
    """Entry point of a spawned child (``python -c``): read the header from
    pipe ``fd`` and run it; ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with os.fdopen(fd, "rb") as f:
        header = pickle.load(f)
    if header["target"] == "zygote":
        serve(header)
        os._exit(0)
    # As a forked DataLoader worker ends: no interpreter teardown (with torch
    # loaded it takes seconds, and a stopping loader waits for it).
    os._exit(run(header, header["fds"]))
