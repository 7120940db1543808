"""Sending the dataset, ``collate_fn`` and ``worker_init_fn`` to spawned workers.

Everything a worker needs is pickled **once** per pool start into bytes,
with cloudpickle: it pickles importable objects by reference, as pickle
does, and what pickle cannot name — classes and functions defined in
``__main__`` of a notebook or ``python -c``, lambdas, closures — by value.
The bytes are then handed to each worker as they are.

One exception to cloudpickle's rules: open files. cloudpickle sends a file
opened for reading as a copy of its *contents* and refuses one opened for
writing with a ``PicklingError``; plain pickle (what DataLoader uses under
spawn) refuses both with ``TypeError: cannot pickle '_io.TextIOWrapper'
object``. Under fork (DataLoader's Linux default) a dataset may hold a file
it opened in ``__init__``, so fastload sends what it can reopen as a
reference: a regular file opened only for reading (``open(p, "rb")``,
``open(p)``, ``io.FileIO``) is opened again by its path in the receiving
process at the same position, and an ``h5py`` file, group or dataset of a
file opened read-only is opened again by file name (h5py's documentation
warns against using a file opened before fork). Each worker then has its own
file offset; under fork they share one, and ``seek`` + ``read`` race. Any
other open file (written to, a pipe, a socket) is refused as plain pickle
refuses it: silently shipping a file's contents is not what a dataset
holding a handle means.

The training script counts as ``__main__`` under any name. In a process
that ``multiprocessing`` started with spawn or forkserver (a DDP rank from
``torch.multiprocessing.spawn``, a ``ProcessPoolExecutor`` worker), the
script was imported as ``__mp_main__``, its classes say
``__module__ == "__mp_main__"``, and cloudpickle would send them by
reference, to workers that never import the script. While fastload pickles,
that module is registered with cloudpickle as one to send by value (its
public ``register_pickle_by_value``), exactly as ``__main__`` is.

When pickling fails, the error gets a note naming the object that could not
be sent, by its path from the top (``dataset.row_lock``), and the remedy.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import sys
import threading
import types
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import cloudpickle

from .errors import add_note

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_SEARCH_DEPTH = 6  # how deep into attributes/containers the culprit is looked for
_SEARCH_WIDTH = 256  # children looked at per object (a dataset may hold a list of millions)


# Held while the script's module is registered with cloudpickle as sent by
# value (a registration is process-wide): one dump at a time sees it.
_BY_VALUE_LOCK = threading.Lock()


def script_module() -> Optional[types.ModuleType]:
    """The module the training script runs as when its name is not
    ``__main__`` (``__mp_main__`` in a process multiprocessing started with
    spawn or forkserver), else None."""
    main = sys.modules.get("__main__")
    name = getattr(main, "__name__", "__main__")
    if name == "__main__" or not isinstance(main, types.ModuleType) or sys.modules.get(name) is not main:
        return None
    return main


def is_script_name(module_name: Optional[str]) -> bool:
    """Whether ``module_name`` names the training script's module
    (``__main__``, or ``__mp_main__`` in a spawn-started process)."""
    return module_name in ("__main__", "__mp_main__")


class Pickler(cloudpickle.CloudPickler):
    """cloudpickle, except that open files fail as they do with plain pickle,
    and the script's module is sent by value under any name."""

    def dump(self, obj: Any) -> None:
        script = script_module()
        if script is None:
            return super().dump(obj)  # type: ignore[no-any-return]
        with _BY_VALUE_LOCK:
            if script.__name__ in cloudpickle.list_registry_pickle_by_value():
                return super().dump(obj)  # type: ignore[no-any-return]
            cloudpickle.register_pickle_by_value(script)
            try:
                return super().dump(obj)  # type: ignore[no-any-return]
            finally:
                cloudpickle.unregister_pickle_by_value(script)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, io.IOBase):
            reopen = _reopenable_file(obj)
            if reopen is not None:
                return reopen
            # Raises plain pickle's TypeError for real files; BytesIO and
            # StringIO reduce fine and go on to pickle's usual path.
            obj.__reduce_ex__(_PROTOCOL)
        h5py = sys.modules.get("h5py")
        if h5py is not None and isinstance(obj, (h5py.File, h5py.Group, h5py.Dataset)):
            reopen = _reopenable_h5(obj)
            if reopen is not None:
                return reopen
        return super().reducer_override(obj)


def _identity(st: os.stat_result) -> Tuple[int, int]:
    return st.st_dev, st.st_ino


def _reopenable_file(f: Any) -> Optional[Tuple[Any, Tuple[Any, ...]]]:
    """How to open ``f`` again elsewhere, if it is a regular file opened
    only for reading whose path still names it; else None."""
    raw = f
    while hasattr(raw, "buffer") or hasattr(raw, "raw"):
        raw = getattr(raw, "buffer", None) or getattr(raw, "raw")
    if not isinstance(raw, io.FileIO) or not isinstance(raw.name, (str, bytes, os.PathLike)):
        return None  # (an int name: opened from an fd)
    path = os.fsdecode(raw.name)
    try:
        if f.closed or not f.readable() or f.writable():
            return None
        st = os.fstat(raw.fileno())
        if not stat.S_ISREG(st.st_mode) or _identity(os.stat(path)) != _identity(st):
            return None
        position = f.tell()
    except (OSError, ValueError):
        return None
    if isinstance(f, io.TextIOWrapper):
        return _reopen_file, (path, "text", position, _identity(st), f.encoding, f.errors)
    if isinstance(f, io.BufferedReader):
        return _reopen_file, (path, "buffered", position, _identity(st), None, None)
    if f is raw:
        return _reopen_file, (path, "raw", position, _identity(st), None, None)
    return None


def _reopen_file(path: str, kind: str, position: int, identity: Tuple[int, int],
                 encoding: Optional[str], errors: Optional[str]) -> Any:
    """A file the dataset held open for reading, opened again here at the
    position it had (this process's own offset)."""
    if kind == "text":
        f: Any = open(path, "r", encoding=encoding, errors=errors)
    elif kind == "buffered":
        f = open(path, "rb")
    else:
        f = io.FileIO(path, "r")
    try:
        if _identity(os.fstat(f.fileno())) != identity:
            raise RuntimeError(f"fastload: {path} is no longer the file the dataset opened "
                               "(replaced since); workers cannot open it again")
        f.seek(position)
    except BaseException:
        f.close()
        raise
    return f


def _reopenable_h5(obj: Any) -> Optional[Tuple[Any, Tuple[Any, ...]]]:
    """How to open an h5py file, group or dataset again elsewhere, if its
    file is open read-only; else None (h5py's own error follows)."""
    try:
        f = obj.file
        if f.mode != "r" or not f.id.valid:
            return None
        whole = isinstance(obj, sys.modules["h5py"].File)
        return _reopen_h5, (f.filename, None if whole else obj.name)
    except Exception:  # noqa: BLE001 - a closed or odd object: h5py says what it is
        return None


def _reopen_h5(filename: str, name: Optional[str]) -> Any:
    import h5py
    f = h5py.File(filename, "r")
    return f if name is None else f[name]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    Pickler(buf, protocol=_PROTOCOL).dump(obj)
    return buf.getvalue()


def _children(obj: Any) -> Iterator[Tuple[str, Any]]:
    """(path suffix, child) of the parts pickle would send for ``obj``."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
        return
    try:
        state = obj.__getstate__() if hasattr(obj, "__getstate__") else getattr(obj, "__dict__", None)
    except Exception:  # noqa: BLE001 - a broken __getstate__ is itself the culprit
        return
    if isinstance(state, tuple) and len(state) == 2:  # (dict, slots dict)
        merged: dict = {}
        for part in state:
            if isinstance(part, dict):
                merged.update(part)
        state = merged
    if isinstance(state, dict):
        for k, v in state.items():
            yield f".{k}", v


def _culprit(obj: Any, path: str, depth: int = _SEARCH_DEPTH) -> Optional[str]:
    """The deepest path under ``obj`` that cannot be pickled, or None."""
    try:
        _dumps(obj)
        return None
    except Exception:  # noqa: BLE001 - pickling errors come as many types
        pass
    if depth > 0:
        for n, (suffix, child) in enumerate(_children(obj)):
            if n >= _SEARCH_WIDTH:
                break
            if child is obj:
                continue
            found = _culprit(child, path + suffix, depth - 1)
            if found is not None:
                return found
    return f"{path} (a {type(obj).__module__}.{type(obj).__qualname__})"


def dumps_by_value(obj: Any, what: str, names: Sequence[Optional[str]] = ()) -> bytes:
    """Pickle ``obj`` for a spawned worker; errors name ``what`` and the remedy.

    When ``obj`` is a tuple, ``names`` labels its items (None: not worth
    naming) so that the error can say which one, and which attribute of it,
    cannot be pickled.
    """
    try:
        return _dumps(obj)
    except Exception as e:  # pickling errors come as many types
        explain(e, obj, what, names)
        raise


def explain(e: BaseException, obj: Any, what: str, names: Sequence[Optional[str]] = ()) -> None:
    """Add a note to the pickling error ``e``: which part of ``obj`` could not
    be sent, and what to do about it."""
    culprits: List[str] = []
    if isinstance(obj, tuple):
        for name, item in zip(names, obj):
            if name is not None:
                found = _culprit(item, name)
                if found is not None:
                    culprits.append(found)
    where = f" ({'; '.join(culprits)} cannot be pickled)" if culprits else ""
    add_note(
        e,
        f"fastload: cannot send the {what} to worker processes{where}: "
        f"{type(e).__name__}: {e}. Objects such as open files, locks, sockets or "
        "generators cannot cross processes: open them lazily in the worker "
        "(e.g. in __getitem__ or worker_init_fn) or drop them in __getstate__."
    )


def loads(data: bytes) -> Any:
    return pickle.loads(data)
