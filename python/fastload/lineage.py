"""Where a pool's workers come from: the start method, and the zygotes.

``multiprocessing_context=None`` (the default) means workers forked from a
zygote of the pool's own (:class:`fastload.launch.Zygote`); an explicit
``'spawn'`` is real spawn, and ``'fork'`` forks this process, as DataLoader
does. A :class:`Lineage` is the zygote side of one pool: the zygotes it has
started (one is replaced when it dies, gets stuck unpickling a session, or
is left with threads in it), and the session the current one holds, so
that workers forked from it share that session's pages copy-on-write
instead of each unpickling a copy (docs/design.md, "Warm workers").
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, List, Optional

from . import crossing, launch
from .launch import Zygote
from .wire import hidden_env

log = logging.getLogger("fastload")

ZYGOTE = "fastload-zygote"
"""The context that stands for ``multiprocessing_context=None``."""


def default_context() -> Any:
    """What ``multiprocessing_context=None`` runs on."""
    return ZYGOTE


def launcher_of(ctx: Any) -> Optional[str]:
    """'zygote' or 'spawn' when fastload starts the workers itself (they then
    never run ``__main__``), None for a multiprocessing context that forks
    from this process (workers inherit the dataset, as DataLoader's)."""
    if ctx == ZYGOTE:
        return "zygote"
    method = ctx if isinstance(ctx, str) else ctx.get_start_method()
    if method == "spawn":
        return "spawn"
    if method == "forkserver":  # a fork server that imports nothing of __main__
        return "zygote"
    return None


def start_zygote(hide_accelerators: bool) -> Zygote:
    """A zygote launched now, in the background (see launch.Zygote)."""
    return Zygote(hide_accelerators, env=hidden_env(hide_accelerators))


class Lineage:
    """The zygotes one pool forks its workers from, and what they hold.

    Sessions are numbered per pool. After :meth:`preload`, the current
    zygote holds session :attr:`preloaded` (or none, if it could not), and
    :meth:`fork` records per worker the session it was forked with:
    :meth:`inherits` tells whether a worker already has the current one.
    """

    def __init__(self, num_workers: int, hide_accelerators: bool,
                 zygote: Optional[Zygote] = None) -> None:
        self._hide = hide_accelerators
        # Every zygote started for the pool, oldest first; the last is current.
        self.zygotes: List[Zygote] = [zygote if zygote is not None
                                      else start_zygote(hide_accelerators)]
        self._numbers = itertools.count(1)
        self.preloaded: Optional[int] = None  # the session the current zygote holds
        self._holder: Optional[Zygote] = None  # the zygote holding it
        self._forked_with: List[Optional[int]] = [None] * num_workers
        self._ok = True  # False once a session of this pool could not be preloaded

    @property
    def current(self) -> Zygote:
        return self.zygotes[-1]

    def _live(self) -> Zygote:
        """The zygote to fork from; a new one if the last was lost (the OOM
        killer likes its size)."""
        if self.current.gone():
            log.warning("fastload: the zygote the workers are forked from is gone; "
                        "starting a new one")
            self.zygotes.append(start_zygote(self._hide))
        return self.current

    def fork(self, worker: int, target: str, parcel: crossing.Parcel) -> launch.Child:
        """Fork worker ``worker`` running ``target(parcel)`` from the current zygote."""
        zygote = self._live()
        child = zygote.start(target, parcel)
        self._forked_with[worker] = self.preloaded if zygote is self._holder else None
        return child

    def inherits(self, worker: int) -> bool:
        """Whether ``worker`` was forked from the zygote holding the current session."""
        number = self._forked_with[worker]
        return number is not None and number == self.preloaded

    def forget(self) -> None:
        """The pool's workers are retired: the zygote holding the session
        lets go of it (no worker will be forked with it again)."""
        holder, self.preloaded, self._holder = self._holder, None, None
        if holder is not None:
            holder.forget()

    def preload(self, parcel: crossing.Parcel, timeout: Optional[float]) -> None:
        """A new session: have the current zygote unpickle ``parcel`` (within
        ``timeout`` s) so that the workers forked next inherit it. If it
        cannot, the workers unpickle their own from now on, and a zygote
        left unsafe to fork from (threads, a GPU context, stuck) is replaced."""
        self.preloaded = self._holder = None
        number = next(self._numbers)
        if not self._ok:
            return
        zygote = self._live()
        outcome, why = zygote.preload(parcel, number, timeout)
        if outcome == launch.PRELOADED:
            self.preloaded, self._holder = number, zygote
            return
        # The dataset is the same next epoch: don't pay its unpickling in
        # the zygote again. Each worker unpickles its own copy.
        self._ok = False
        level = logging.DEBUG if outcome == launch.DECLINED else logging.WARNING
        log.log(level, "fastload: workers unpickle the dataset themselves "
                       "(not shared through the zygote): %s", why)
        if outcome != launch.DECLINED:
            zygote.stop()
            self.zygotes.append(start_zygote(self._hide))
