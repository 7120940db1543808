"""The dataset of the fault-injection suite (``test_faults.py``).

Module level so spawned workers can import it by reference (pytest puts
``tests/`` on ``sys.path`` and spawn hands ``sys.path`` to the child).

``dataset[i]`` is a function of ``i`` alone (see :func:`sample`), so every
delivered batch can be checked for content, and the index it came from can
be read back from it. Faults that the dataset itself injects are switched on
and off by the test through marker files in a control directory, so the test
decides *when* (at which batch of which epoch) they land:

* ``raise-<i>``: ``dataset[i]`` raises :class:`InjectedFault`; every raise
  appends ``"<i> <time.monotonic()>"`` to ``raised.log`` (one line per call,
  so a retried index would show up twice).
* ``slow-<w>``: worker ``w`` sleeps ``slow_s`` before every sample while the
  file exists (a very slow, but never hung, worker); every slowed sample
  appends a line to ``slowed.log``.

The marker checks run only in worker processes (``get_worker_info()`` is
set), as the destructive behaviours of ``faulty_datasets`` do.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch
from torch.utils.data import Dataset, get_worker_info

WIDTH = 6


def sample(i: int) -> torch.Tensor:
    """``dataset[i]``: int64 row ``[i, 7i+1, 7i+2, ...]`` (index first, easy to read back)."""
    row = torch.arange(WIDTH, dtype=torch.int64) + 7 * i
    row[0] = i
    return row


class InjectedFault(ValueError):
    """What ``dataset[i]`` raises for an index the test marked."""


class Pattern(Dataset):
    """Deterministic map-style dataset with marker-controlled faults."""

    def __init__(self, n: int, ctl: Optional[str] = None, delay: float = 0.0,
                 slow_s: float = 0.0) -> None:
        self.n = n
        self.ctl = ctl
        self.delay = delay
        self.slow_s = slow_s

    def __len__(self) -> int:
        return self.n

    def _log(self, name: str, line: str) -> None:
        assert self.ctl is not None
        with open(os.path.join(self.ctl, name), "a") as f:
            f.write(line + "\n")

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        info = get_worker_info()
        if self.ctl is not None and info is not None:
            if self.slow_s and os.path.exists(os.path.join(self.ctl, f"slow-{info.id}")):
                self._log("slowed.log", f"{i} {info.id} {os.getpid()}")
                time.sleep(self.slow_s)
            if os.path.exists(os.path.join(self.ctl, f"raise-{i}")):
                self._log("raised.log", f"{i} {time.monotonic()!r}")
                raise InjectedFault(f"injected fault at index {i}")
        return sample(i)
