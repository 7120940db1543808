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
object``. We refuse them as plain pickle does: silently shipping a file's
contents to every worker is not what a dataset holding a handle means.

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
import pickle
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
            # Raises plain pickle's TypeError for real files; BytesIO and
            # StringIO reduce fine and go on to pickle's usual path.
            obj.__reduce_ex__(_PROTOCOL)
        return super().reducer_override(obj)


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
