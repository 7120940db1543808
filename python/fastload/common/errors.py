"""Exceptions fastload raises beyond DataLoader's own."""

from __future__ import annotations

from typing import Any, List, Sequence


class WorkerHangError(RuntimeError):
    """A worker held a batch for ``hang_timeout`` seconds without progress.

    The message names the worker id, its pid, the batch and sample indices it
    held, and the worker's Python stack at that moment.
    """


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` as PEP 678 describes (shown under its
    traceback).

    Python 3.11 has ``BaseException.add_note``. On 3.10 the note goes into
    ``__notes__`` the same way, which the ``exceptiongroup`` backport and
    pytest print, but the interpreter's own traceback does not.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)


def short_list(items: Sequence[Any], limit: int = 8) -> str:
    """``items`` for an error message: the first ``limit`` and how many in all."""
    shown = ", ".join(repr(i) for i in items[:limit])
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return f"[{shown}{more}]"


def as_list(index: Any) -> List[Any]:
    """A sampler's output (one index or a batch of them) as a list."""
    return list(index) if isinstance(index, (list, tuple)) else [index]
