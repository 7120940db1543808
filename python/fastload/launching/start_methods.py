"""Which launcher a loader's ``multiprocessing_context`` stands for.

``multiprocessing_context=None`` (the default) is :data:`ZYGOTE`: workers
forked from a zygote of the pool's own (:mod:`fastload.launching.fork_server`).
``'forkserver'`` means the same. An explicit ``'spawn'`` is real spawn
(:func:`fastload.launching.spawn.spawn`), and ``'fork'`` (or any context
that forks) forks this process through ``multiprocessing``, as DataLoader
does.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["ZYGOTE", "default_context", "launcher_of"]

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
