"""Iterating a loader like a training loop that survives errors, and reading
the errors it got (DataLoader's and fastload's are compared)."""

from __future__ import annotations

import re
import traceback
from typing import Any, Callable, List, Optional

import torch


def exc_text(exc: BaseException) -> str:
    """``str(exc)`` plus any PEP 678 notes (where fastload adds its context)."""
    return "".join(traceback.format_exception_only(type(exc), exc))


def outcomes(loader: Any, max_steps: int = 100,
             describe: Optional[Callable[[BaseException], Any]] = None) -> List[tuple]:
    """Iterate ``loader`` like a training loop that survives errors.

    Returns ``("ok", batch)`` / ``("err", type, message, detail)`` per
    ``next()`` call until StopIteration; ``detail`` is ``describe(exc)``, by
    default the types of the exception's args. Exceptions are not kept
    (their tracebacks would keep the iterator alive).
    """
    out: List[tuple] = []
    it = iter(loader)
    try:
        for _ in range(max_steps):
            try:
                batch = next(it)
            except StopIteration:
                return out
            except Exception as e:  # noqa: BLE001 - recorded for comparison
                detail = describe(e) if describe else tuple(type(a).__name__ for a in e.args)
                out.append(("err", type(e), str(e), detail))
                del e
                continue
            out.append(("ok", batch.tolist() if isinstance(batch, torch.Tensor) else batch))
            del batch
        raise AssertionError(f"no StopIteration after {max_steps} steps: {out}")
    finally:
        del it


def shape_of(results: List[tuple]) -> List[Any]:
    """The comparable skeleton of :func:`outcomes`: batches, and exception types."""
    return [r[1] for r in results]


def worker_no(msg: str) -> str:
    """The worker id in DataLoader's "Caught ... in DataLoader worker process N"."""
    m = re.search(r"in DataLoader worker process (\d+)", msg)
    assert m, msg
    return m.group(1)


def last_line(msg: str) -> str:
    """The original exception's own line, at the end of a worker traceback."""
    return msg.rstrip().splitlines()[-1]
