"""Zygotes and fork servers played by the test, for tests of
:mod:`fastload.launching.fork_server` with no process.

:class:`FakeZygote` answers what the main process asks of a
:class:`fastload.launching.zygote.Zygote` (fork a zygote, start a
worker, preload a session and let go of it, import modules, stop) and
records each request; the test sets what a preload answers and makes a
zygote die. :func:`fake_servers` is a
:class:`fastload.launching.fork_server.ForkServers` whose servers are fakes.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional, Tuple

from fastload.launching.fork_server import ForkServers
from fastload.launching.zygote_protocol import PRELOADED

_pids = itertools.count(90001)  # made-up pids, never signalled


class FakeChild:
    """A worker a fake zygote started: its pid and where it came from."""

    def __init__(self, zygote: "FakeZygote", target: str) -> None:
        self.pid = next(_pids)
        self.zygote = zygote
        self.target = target


class FakeZygote:
    """A zygote (or, with no ``server``, a fork server) that forks nothing."""

    def __init__(self, hide_accelerators: bool, server: Optional["FakeZygote"] = None) -> None:
        self.hide_accelerators = hide_accelerators
        self.server = server  # the zygote it was forked from
        self.launched_pid = next(_pids)
        self.alive = True
        self.stopped = False  # stop() was called
        self.fork_fails = 0  # fork_zygote() raises this many times, as a dying server's does
        self.forked: List[FakeZygote] = []  # zygotes forked from it
        self.children: List[FakeChild] = []  # workers started from it
        # What preload() answers, and the modules unpickling "imported" meanwhile.
        self.preload_answer: Tuple[int, str] = (PRELOADED, "")
        self.imports_on_preload: List[str] = []
        self.preloads: List[int] = []  # the session numbers asked for
        self.session_imports: List[str] = []
        self.forgotten = 0  # forget() calls
        self.warmed: List[List[str]] = []  # warm_imports() calls
        self.closed_inherited = False  # close_inherited() was called

    @property
    def pid(self) -> Optional[int]:
        return self.launched_pid if self.alive else None

    def gone(self) -> bool:
        return not self.alive

    def die(self) -> None:
        """The process is gone without being asked (the OOM killer)."""
        self.alive = False

    def stop(self) -> None:
        self.alive = False
        self.stopped = True

    def held_fds(self) -> List[int]:
        return []

    def close_inherited(self) -> None:
        self.alive = False
        self.closed_inherited = True

    def fork_zygote(self, wait: bool = True) -> "FakeZygote":
        if self.fork_fails:
            self.fork_fails -= 1
            self.alive = False
            raise RuntimeError("fastload: the fork server is gone")
        if not self.alive:
            raise RuntimeError("fastload: the fork server is gone")
        zygote = FakeZygote(self.hide_accelerators, server=self)
        self.forked.append(zygote)
        return zygote

    def start(self, target: str, parcel: Any) -> FakeChild:
        child = FakeChild(self, target)
        self.children.append(child)
        return child

    def preload(self, parcel: Any, token: int, timeout: Optional[float] = None) -> Tuple[int, str]:
        self.preloads.append(token)
        self.session_imports = list(self.imports_on_preload)
        return self.preload_answer

    def forget(self) -> None:
        self.forgotten += 1

    def warm_imports(self, modules: List[str]) -> None:
        self.warmed.append(list(modules))


def fake_servers() -> Tuple[ForkServers, List[FakeZygote]]:
    """Fork servers whose servers are fakes, and the list of those started,
    oldest first."""
    started: List[FakeZygote] = []

    def start(hide_accelerators: bool) -> FakeZygote:
        server = FakeZygote(hide_accelerators)
        started.append(server)
        return server

    return ForkServers(start_server=start), started  # type: ignore[arg-type]
