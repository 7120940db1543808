"""``fastload.install()``: run DataLoaders that libraries build on fastload.

Ultralytics, Hugging Face Trainer/accelerate, Lightning and others build the
``DataLoader`` themselves, often from a subclass of their own defined at
import time, and ``accelerate.prepare()`` rebuilds any loader it is given as
its own class. Swapping the class cannot reach them; every one of them,
though, gets its multi-process iterator from ``DataLoader._get_iterator()``
(``DataLoader.__iter__`` calls it for fresh and persistent iterators). That
method is the one hook: replaced on ``torch.utils.data.DataLoader`` itself,
it reaches loaders of every subclass, defined before or after the call, and
loaders created before it, while each class keeps its own ``__iter__``,
``__len__``, samplers and everything else.

A class that overrides ``_get_iterator`` without calling
``super()._get_iterator()`` (``FastLoader`` itself, torchdata's
``StatefulDataLoader``) keeps its own iterator.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, List, Optional

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .iterator.multi_process import FastLoaderIter
from .stats.autoscale import AUTO
from .launching.fork_server import ServerLease, lease_fork_server
from .loader import STATE_ATTR, FastLoader, LoaderOptions, _fail_as_dataloader_iterator
from .iterator.loader_runtime import LoaderRuntime

__all__ = ["install", "uninstall", "installed"]

log = logging.getLogger("fastload")

_lock = threading.Lock()
_active = False
_defaults = LoaderOptions()
_announced = False  # the INFO line for the first loader iterated since install()
# install()'s lease on the fork server, taken at once so that the server
# imports torch while the script builds its model; released by uninstall()
# (each hooked loader holds a lease of its own).
_lease: List[ServerLease] = []
# DataLoader._get_iterator as found when install() replaced it.
_original: Optional[Callable[[DataLoader], _BaseDataLoaderIter]] = None


def install(
    *,
    allow_gpu_in_workers: bool = False,
    slot_bytes: Optional[int] = None,
    held_batches: int = 4,
    reuse_workers: bool = True,
    hang_timeout: Optional[float] = 300.0,
    max_worker_restarts: int = 0,
    device: Optional[Any] = None,
    num_workers: Optional[str] = None,
) -> None:
    """Make every ``torch.utils.data.DataLoader`` with workers run on fastload.

    From this call on, iterating any DataLoader (of any subclass, created
    before or after the call) with ``num_workers > 0`` uses fastload's
    workers and shared-memory ring instead of DataLoader's
    ``_MultiProcessingDataLoaderIter``; ``num_workers=0`` is left to
    DataLoader. Batches, order, seeds, ``len()``, samplers and the loader's
    own methods are unchanged; what differs is what differs for
    :class:`fastload.FastLoader` (workers start from fastload's zygote unless
    ``multiprocessing_context`` is given, and the warm pool is kept between
    epochs).

    The keyword arguments are FastLoader's own options (see
    :class:`fastload.FastLoader`), checked the same way, and apply to every
    loader that is not a FastLoader. Calling ``install()`` again replaces
    them; they apply from each loader's next iterator (a persistent
    iterator keeps the options it started with).

    One INFO line on the ``"fastload"`` logger tells when the first loader
    runs on fastload. The fork server every loader's workers come from is
    started now, in the background: it imports torch while the script
    builds its model, so the first epoch does not wait for it.

    ``num_workers="auto"`` overrides the count every loader with workers
    was given (by the user or by a library): fastload chooses it, and keeps
    choosing it as the loader runs (see ``FastLoader``'s ``num_workers``).
    Loaders with ``num_workers=0`` stay in the main process.

    Raises:
        TypeError: an unknown option.
        ValueError: a bad value for an option.
    """
    if num_workers is not None and num_workers != AUTO:
        raise ValueError(f"num_workers option of install() should be None or 'auto', but got "
                         f"{num_workers!r}")
    _activate(LoaderOptions(
        allow_gpu_in_workers=allow_gpu_in_workers, slot_bytes=slot_bytes,
        held_batches=held_batches, reuse_workers=reuse_workers, hang_timeout=hang_timeout,
        max_worker_restarts=max_worker_restarts, device=device,
        auto_workers=num_workers == AUTO,
    ), start_server_now=True)


def install_for_process_tree() -> None:
    """``install()`` as ``FASTLOAD_INSTALL=1`` runs it, in every Python process
    of a tree that imports torch's DataLoader: with the default options and
    no fork server started ahead (launchers, compile workers and tools in
    the tree install too, and most of them never iterate a loader; the
    first loader that needs the server starts it)."""
    _activate(LoaderOptions(), start_server_now=False)


def _activate(options: LoaderOptions, start_server_now: bool) -> None:
    global _active, _defaults, _announced, _original
    with _lock:
        _defaults = options
        if _active:
            return
        if start_server_now and not _lease:
            _lease.append(lease_fork_server(not options.allow_gpu_in_workers))
        if _original is None:  # else our hook is still in place (see uninstall)
            _original = DataLoader.__dict__["_get_iterator"]
            DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign]
        _announced = False
        _active = True
    log.debug("fastload: installed on torch.utils.data.DataLoader._get_iterator")


def uninstall() -> None:
    """Undo :func:`install`: ``DataLoader._get_iterator`` is the original again.

    Iterators already made keep running on fastload until they end; warm
    worker pools end with their loaders. Does nothing if not installed.
    """
    global _active, _original
    with _lock:
        if not _active:
            return
        _active = False
        while _lease:
            _lease.pop().release()
        if DataLoader.__dict__.get("_get_iterator") is _get_iterator:
            assert _original is not None
            DataLoader._get_iterator = _original  # type: ignore[method-assign]
            _original = None
        else:
            # Someone wrapped our hook after install(): restoring the original
            # would drop their wrapper too. Ours, still inside theirs, now
            # just calls the original (and a later install() turns it back on).
            log.warning("fastload: DataLoader._get_iterator was replaced after "
                        "fastload.install(); leaving it in place, fastload is off")


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _active


def _get_iterator(self: DataLoader) -> _BaseDataLoaderIter:
    """DataLoader._get_iterator while fastload is installed."""
    original = _original
    assert original is not None
    if not _active or self.num_workers == 0 or isinstance(self, FastLoader):
        return original(self)
    self.check_worker_number_rationality()
    _fail_as_dataloader_iterator(self)
    # The instance __dict__ directly: a subclass may guard __setattr__.
    state = self.__dict__.get(STATE_ATTR)
    if state is None:
        state = self.__dict__[STATE_ATTR] = LoaderRuntime(_defaults)
        if self.multiprocessing_context is None:
            state.pools.lease_fork_server(state.options.hide_accelerators)
            weakref.finalize(self, state.pools.release)
    elif state.options is not _defaults:  # install() was called again since
        state.options = _defaults
    _announce(self)
    return FastLoaderIter(self, state, stream_ops=state.stream_ops(),
                          device_runtime=state.device_runtime)


def _announce(loader: DataLoader) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    log.info("fastload: installed: %s (num_workers=%d) is the first loader to run on fastload; "
             "every DataLoader with workers does from now on", type(loader).__qualname__,
             loader.num_workers)



