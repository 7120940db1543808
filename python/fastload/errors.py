"""Exceptions fastload raises beyond DataLoader's own."""

from __future__ import annotations


class WorkerHangError(RuntimeError):
    """A worker held a batch for ``hang_timeout`` seconds without progress.

    The message names the worker id, its pid, the batch and sample indices it
    held, and the worker's Python stack at that moment.
    """
