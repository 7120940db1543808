"""Objects crossing to a worker process: pickled bytes plus the fds they need.

A worker receives everything it needs this way: its start-up spec (the
ring, its socket) and each session's ``(dataset, collate_fn,
worker_init_fn, ...)``. The rules are DataLoader's sharing semantics:

* What ``multiprocessing`` and ``torch.multiprocessing`` know how to share
  stays shared: tensors and storages already in shared memory
  (``share_memory_()``, torch's shared storages), ``multiprocessing``
  ``Value``/``Array``/``Lock``/``Event``/``Queue``/connections and manager
  proxies. Their reducers are the ones DataLoader's workers get theirs
  through (``multiprocessing.reduction.ForkingPickler``'s table, which
  torch extends); their file descriptors travel beside the bytes, with
  ``SCM_RIGHTS`` or as inherited fds, and are handed back on unpickling.
* What fork would share without copying crosses by reference
  (:mod:`fastload.launching.references`): a big tensor is moved once into
  a memfd (as a spawned DataLoader worker's would be moved into
  ``/dev/shm``, which fastload never uses), a memory-mapped array is mapped
  again from its file, other big buffers are copied once per loader into
  memfds; the receiving side maps them copy-on-write. Small tensors and
  arrays are copied, as a forked DataLoader worker sees a copy.
* What plain pickle cannot name (classes and functions of ``__main__``,
  lambdas, closures) travels by value (cloudpickle), so workers never need
  to import the training script.

The reducers of ``multiprocessing`` objects only agree to pickle while a
process is being started (``assert_spawning``): :func:`pack` presents
itself as that start (``multiprocessing.context.set_spawning_popen``, the
one private name used here, pinned by a test), collecting every fd the
reducers hand over.

Which process calls what: :func:`pack` in the main process, :func:`unpack`
in the worker. A session's bytes travel in a memfd: :func:`memfd_of` on the
sending side, :func:`read_memfd` on the receiving one.
"""

from __future__ import annotations

import io
import logging
import mmap
import multiprocessing
import os
import pickle
import threading
import warnings
from collections import ChainMap
from dataclasses import dataclass, field
from multiprocessing import context as mp_context
from multiprocessing import reduction
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch  # noqa: F401 - registers torch.multiprocessing's reducers (_sharing_table)

from ..common import pickling
from . import references
from .buffer_copies import SharedBuffers
from .references import Packing
from ..common.errors import add_note
from .start_methods import default_context, launcher_of

log = logging.getLogger("fastload")

__all__ = ["Parcel", "pack", "unpack", "memfd_of", "read_memfd", "ForkOnlyError"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class ForkOnlyError(RuntimeError):
    """The object can reach another process only by being inherited through
    ``fork`` (a ``multiprocessing`` lock or value made in the fork context,
    the default on Linux)."""


@dataclass
class Parcel:
    """Pickled bytes and the fds they refer to, owned by the parcel (dups)."""

    data: bytes
    fds: List[int] = field(default_factory=list)

    def close(self) -> None:
        """Close the parcel's fds (idempotent)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass

    def __del__(self) -> None:
        self.close()


class _FdCollector:
    """Stands in for multiprocessing's Popen while :func:`pack` pickles:
    ``reduction.DupFd(fd)`` asks it for a handle the child can detach."""

    def __init__(self) -> None:
        self.fds: List[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(os.dup(fd))
        return len(self.fds) - 1

    def DupFd(self, index: int) -> "PassedFd":  # noqa: N802 - multiprocessing's name
        return PassedFd(index)


class PassedFd:
    """The receiving side of one collected fd (what ``DupFd(...).detach()``
    returns in the child). Pickled by reference."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        receiving = getattr(_receiving, "fds", None)
        if receiving is None:
            raise RuntimeError("fastload: a passed fd was unpickled outside "
                               "fastload.launching.parcels.unpack")
        fd = receiving[self.index]
        if fd < 0:
            raise RuntimeError(f"fastload: passed fd {self.index} was detached twice")
        receiving[self.index] = -1  # the caller owns it now
        return fd


# The fds of the parcel being unpickled in this thread: what PassedFd.detach
# hands out, as multiprocessing's forkserver children read their inherited fds
# from a module-level list. Set only for the duration of one unpack().
_receiving = threading.local()


def _is_shared_cpu(obj: Any) -> bool:
    try:
        with warnings.catch_warnings():  # TypedStorage's deprecation warning
            warnings.simplefilter("ignore")
            return obj.device.type == "cpu" and bool(obj.is_shared())
    except Exception:  # noqa: BLE001 - not a tensor/storage we know
        return False


def _share_if_shared(reduce: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch's reducer for tensors already in shared memory; a copy (its
    plain pickle) for the rest."""

    def reduce_tensor_or_storage(obj: Any) -> Any:
        if _is_shared_cpu(obj):
            return reduce(obj)
        return obj.__reduce_ex__(_PROTOCOL)

    return reduce_tensor_or_storage


def _sharing_table() -> Dict[type, Callable[[Any], Any]]:
    """ForkingPickler's reducers (multiprocessing's and torch's), with
    torch's limited to what is already shared."""
    table = dict(reduction.ForkingPickler(io.BytesIO()).dispatch_table)
    for cls, reduce in list(table.items()):
        if getattr(reduce, "__module__", "").startswith("torch.multiprocessing"):
            table[cls] = _share_if_shared(reduce)
    return table


class _SharingPickler(pickling.Pickler):
    """cloudpickle (by value where plain pickle cannot name), with the
    sharing reducers above taking precedence over copying, and what fork
    would share sent by reference (``packing``)."""

    def __init__(self, file: io.BytesIO, packing: Packing) -> None:
        # Made anew each time: modules register their reducers when imported
        # (multiprocessing.heap's for Value/Array, say). Set before the base
        # __init__: the C pickler reads its table there.
        self.dispatch_table = ChainMap(_sharing_table(), pickling.Pickler.dispatch_table)
        self._packing = packing
        super().__init__(file, protocol=_PROTOCOL, buffer_callback=packing.buffer_callback)

    def reducer_override(self, obj: Any) -> Any:
        rv = references.reduce_by_reference(obj, self._packing)
        if rv is not NotImplemented:
            return rv
        return super().reducer_override(obj)


class _WithBuffers:
    """A pickle whose big pickle-5 buffers went out of band, and where their
    copies are (unpickled with them, as ``pickle.loads(data, buffers=...)``)."""

    def __init__(self, data: bytes, buffers: List[Any]) -> None:
        self.data, self.buffers = data, buffers

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _load_with_buffers, (self.data, self.buffers)


def _load_with_buffers(data: bytes, buffers: List[memoryview]) -> Any:
    return pickle.loads(data, buffers=buffers)


def pack(obj: Any, what: str, names: Sequence[Optional[str]] = (),
         buffers: Optional[SharedBuffers] = None) -> Parcel:
    """Pickle ``obj`` for a worker process (main process side).

    Errors name ``what`` (and, for a tuple, which of its ``names`` cannot be
    sent). Raises :class:`ForkOnlyError` when ``obj`` holds something only
    ``fork`` can hand over. ``buffers``: where big arrays and buffers are
    copied once, to cross by reference (without it they cross as bytes).
    """
    collector = _FdCollector()
    packing = Packing(buffers)
    if buffers is not None:
        buffers.begin()
    mp_context.set_spawning_popen(collector)
    try:
        buf = io.BytesIO()
        try:
            _SharingPickler(buf, packing).dump(obj)
            if packing.out_of_band:
                inner, buf = buf.getvalue(), io.BytesIO()
                _SharingPickler(buf, packing).dump(_WithBuffers(inner, packing.out_of_band))
        except RuntimeError as e:
            if "fork context" in str(e):  # multiprocessing's SemLock.__getstate__
                raise ForkOnlyError(str(e)) from e
            pickling.explain(e, obj, what, names)
            raise
        except Exception as e:  # pickling errors come as many types
            pickling.explain(e, obj, what, names)
            raise
        if buffers is not None:
            buffers.finish()
        return Parcel(buf.getvalue(), collector.fds)
    except BaseException:
        if buffers is not None:
            buffers.abort()
        for fd in collector.fds:
            os.close(fd)
        raise
    finally:
        mp_context.set_spawning_popen(None)


def unpack(data: Any, fds: Sequence[int]) -> Any:
    """Rebuild what :func:`pack` made (worker side), ``fds`` being the
    parcel's fds as received here. fds nobody took are closed."""
    receiving = list(fds)
    _receiving.fds = receiving
    try:
        return pickle.loads(data)
    finally:
        _receiving.fds = None
        for fd in receiving:
            if fd >= 0:
                os.close(fd)



def memfd_of(data: bytes) -> int:
    """A new memfd holding ``data`` (close-on-exec)."""
    fd = os.memfd_create("fastload-dataset", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, len(data))
        if data:
            with mmap.mmap(fd, len(data)) as mm:
                mm[:] = data
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_memfd(fd: int) -> bytes:
    """The bytes of memfd ``fd``, which is closed."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b""
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            return mm[:]
    finally:
        os.close(fd)

def pack_session(payload: tuple, ctx: Any, keeper: Any) -> Tuple[Optional[Parcel], Any, Optional[tuple]]:
    """The session a loader's workers get: ``payload`` = (inherited settings,
    dataset, collate_fn, worker_init_fn, dataset_kind, auto_collation,
    drop_last) packed for ``ctx``'s workers (the state first: see
    :mod:`fastload.common.inherited`). Returns (parcel, context, None), or
    (None, a fork context, payload) where the workers are to be forked from
    this process with the objects themselves, never pickled, as DataLoader's
    are: under an explicit ``fork`` context (a dataset holding an open file,
    a lock or a database connection works there with DataLoader, so it must
    here), and where only fork can hand the objects over (a fork-context
    ``multiprocessing`` object) and the loader asked for no start method:
    DataLoader's default on Linux is fork, so fastload does what DataLoader
    does for this dataset, and says so once per loader
    (``keeper.warned_fork``; ``keeper``: the loader's
    :class:`~fastload.pool.keeper.PoolKeeper`, whose ``buffers`` hold the
    copies of big buffers the session carries)."""
    if launcher_of(ctx) is None:
        return None, ctx, payload
    try:
        return pack(payload, "dataset, collate_fn and worker_init_fn",
                    names=(None, "dataset", "collate_fn", "worker_init_fn"),
                    buffers=keeper.buffers), ctx, None
    except ForkOnlyError as e:
        if ctx != default_context():
            add_note(e, "fastload: create it from the loader's start method, e.g. "
                       "multiprocessing.get_context('spawn').Value(...), or pass "
                       "multiprocessing_context='fork'")
            raise
    except Exception as e:  # pickling errors come as many types
        add_note(e, "fastload: or pass multiprocessing_context='fork': the workers are then "
                    "forked from this process and inherit the dataset as it is, unpickled, "
                    "as DataLoader's are with its Linux default")
        raise
    if not keeper.warned_fork:
        keeper.warned_fork = True
        log.warning("fastload: the dataset holds a multiprocessing object made in the "
                    "fork context, which only fork can hand over: its workers are "
                    "forked from this process, as DataLoader's are. Make it with "
                    "multiprocessing.get_context('spawn') to keep workers apart "
                    "from this process.")
    return None, multiprocessing.get_context("fork"), payload
