"""Sending the dataset, ``collate_fn`` and ``worker_init_fn`` to spawned workers.

Everything a worker needs is pickled **once** per pool start into bytes,
with cloudpickle: it pickles importable objects by reference, as pickle
does, and what pickle cannot name — classes and functions defined in
``__main__`` of a notebook or ``python -c``, lambdas, closures — by value.
The bytes are then handed to each worker as they are.
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle


def dumps_by_value(obj: Any, what: str) -> bytes:
    """Pickle ``obj`` for a spawned worker; errors name ``what`` and the remedy."""
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pickling errors come as many types
        note = (
            f"fastload: cannot send the {what} to worker processes: "
            f"{type(e).__name__}: {e}. Objects such as open files, locks, sockets or "
            "generators cannot cross processes: open them lazily in the worker "
            "(e.g. in __getitem__ or worker_init_fn) or drop them in __getstate__."
        )
        if hasattr(e, "add_note"):
            e.add_note(note)
            raise
        raise type(e)(note) from e


def loads(data: bytes) -> Any:
    return pickle.loads(data)
