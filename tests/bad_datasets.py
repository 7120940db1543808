"""Datasets, samplers and collate functions that feed a loader bad input.

For ``test_bad_input.py``. Module level so that spawned workers import them
by reference (pytest puts ``tests/`` on ``sys.path``, spawn hands
``sys.path`` to the child). Behaviours are switched by plain attributes so a
test can remove the cause in the main process and start a new epoch: the
dataset is pickled anew for every iterator.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate, get_worker_info


def _in_worker() -> bool:
    return get_worker_info() is not None


# ---------------------------------------------------------------------------
# 1. inconsistent shapes


class RaggedOn(Dataset):
    """``torch.full((width,), i)``, except index ``bad`` has ``width + 1`` elements
    (and ``bad = -1`` turns that off)."""

    def __init__(self, n: int, bad: int, width: int = 3) -> None:
        self.n = n
        self.bad = bad
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        w = self.width + 1 if i == self.bad else self.width
        return torch.full((w,), i, dtype=torch.int64)


# ---------------------------------------------------------------------------
# 2. samples that do not survive the trip to the main process


def _refuse_to_load(i: int) -> Any:
    raise ValueError(f"NoLoad({i}) cannot be rebuilt in this process")


class NoLoad:
    """Pickles fine; unpickling raises (in the main process: the worker never unpickles it)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> Any:
        return (_refuse_to_load, (self.i,))


class NoDump:
    """``pickle.dumps`` raises a ValueError (not the usual TypeError)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> Any:
        raise ValueError(f"NoDump({self.i}) refuses to be pickled")


class OddSample(Dataset):
    """``{"t": tensor(i), "extra": ...}``: for the index in ``kinds`` the extra
    is a lambda (``"lambda"``), a NoDump (``"nodump"``) or a NoLoad (``"noload"``).
    Use with ``keep_collate``."""

    def __init__(self, n: int, kinds: Dict[int, str]) -> None:
        self.n = n
        self.kinds = dict(kinds)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        kind = self.kinds.get(i)
        extra: Any = None
        if kind == "lambda":
            extra = lambda: i  # noqa: E731 - the point of the test
        elif kind == "nodump":
            extra = NoDump(i)
        elif kind == "noload":
            extra = NoLoad(i)
        return {"t": torch.tensor(i), "extra": extra}


def keep_collate(batch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Stacks the tensors, keeps the extras as they are."""
    return {"t": torch.stack([s["t"] for s in batch]), "extra": [s["extra"] for s in batch]}


# ---------------------------------------------------------------------------
# 3. datasets that cannot be pickled for spawn


class Holds(Dataset):
    """``dataset[i] == torch.tensor(i)``; holds one unpicklable attribute under a
    distinctive name (``row_lock``, ``log_handle`` or ``row_source``)."""

    ATTR = {"lock": "row_lock", "file": "log_handle", "generator": "row_source"}

    def __init__(self, n: int, kind: str, path: Optional[str] = None) -> None:
        self.n = n
        self.kind = kind
        self.plain_setting = "harmless"
        if kind == "lock":
            self.row_lock: Any = threading.Lock()
        elif kind == "file":
            assert path is not None
            self.log_handle: Any = open(path, "w")
        elif kind == "generator":
            self.row_source: Any = (x for x in range(3))
        else:
            raise AssertionError(kind)

    @property
    def attr(self) -> str:
        return self.ATTR[self.kind]

    def drop_cause(self) -> None:
        value = getattr(self, self.attr)
        if self.kind == "file":
            value.close()
        setattr(self, self.attr, None)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


# ---------------------------------------------------------------------------
# 4./5. indices past the end, lying __len__


class ListDataset(Dataset):
    """Backed by a Python list: ``self.rows[i]`` raises the plain
    ``IndexError: list index out of range`` (which does not name the index).
    ``reported`` is what ``__len__`` says (default: the truth)."""

    def __init__(self, n: int, reported: Optional[int] = None) -> None:
        self.rows = [torch.tensor(i) for i in range(n)]
        self.reported = n if reported is None else reported

    def __len__(self) -> int:
        return self.reported

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


class PastTheEnd(Sampler):
    """``range(len(dataset) + extra)``: ``extra`` indices past the end."""

    def __init__(self, n: int, extra: int) -> None:
        self.n = n
        self.extra = extra

    def __len__(self) -> int:
        return self.n + self.extra

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n + self.extra))


# ---------------------------------------------------------------------------
# 6. empty datasets


class EmptyIterable(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(())


# ---------------------------------------------------------------------------
# 7. memory


ABSURD_NUMEL = 1 << 50  # 8 PiB of int64


class HugeOn(Dataset):
    """Index ``bad`` asks torch for ``ABSURD_NUMEL`` int64 elements
    (in a worker only: never in the test process); ``bad = -1`` turns it off."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and _in_worker():
            return torch.empty(ABSURD_NUMEL, dtype=torch.int64)
        return torch.full((4,), i, dtype=torch.int64)


class HugeCollate:
    """Default collate, except a batch containing ``bad`` asks for an absurd allocation."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[torch.Tensor]) -> torch.Tensor:
        if any(int(x[0]) == self.bad for x in batch) and _in_worker():
            return torch.zeros(ABSURD_NUMEL, dtype=torch.uint8)
        return default_collate(batch)


class BigSample(Dataset):
    """``numel`` int32 values per sample: ``arange(numel) + i`` (so every
    element is checkable)."""

    def __init__(self, n: int, numel: int) -> None:
        self.n = n
        self.numel = numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        t = torch.arange(self.numel, dtype=torch.int32)
        t += i
        return t


# ---------------------------------------------------------------------------
# 8. a collate_fn returning a tensor that is not on the CPU


def meta_collate(batch: List[torch.Tensor]) -> Dict[str, Any]:
    """A CPU batch plus a tensor on the ``meta`` device (stand-in for CUDA)."""
    x = torch.stack(batch)
    return {"x": x, "on_device": torch.empty((len(batch), 3), device="meta")}


# ---------------------------------------------------------------------------
# 9. strided and non-contiguous results


class Images(Dataset):
    """``(3, h, w)`` float images; ``channels_last``: ``(1, 3, h, w)`` in
    channels_last memory format (strides ``(3hw, 1, 3w, 3)``)."""

    def __init__(self, n: int, channels_last: bool = False, h: int = 4, w: int = 5) -> None:
        self.n = n
        self.channels_last = channels_last
        self.h = h
        self.w = w

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        t = torch.arange(3 * self.h * self.w, dtype=torch.float32).reshape(3, self.h, self.w)
        t += 100 * i
        if self.channels_last:
            t = t.unsqueeze(0).contiguous(memory_format=torch.channels_last)
        return t


def strided_collate(batch: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Views and layouts of the batch and of fresh tensors."""
    x = default_collate(batch)  # (B, 3, 4, 5)
    big = torch.arange(10_000, dtype=torch.float64).reshape(100, 100) + float(x[0, 0, 0, 0])
    base = torch.arange(24, dtype=torch.int64) * (len(batch) + 1)
    return {
        "x": x,
        "t": x[:, 0, :, :].transpose(1, 2),  # (B, 5, 4) view of the stacked batch
        "step2": x[:, :, ::2, :],
        "fresh_t": torch.arange(12.0).reshape(3, 4).t(),
        "fresh_step2": torch.arange(20)[::2],
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        "as_strided": base.as_strided((4, 3), (2, 5), 1),  # overlapping windows
        "view_in_big": big[10:13, 20:30:3],  # small strided view of a big tensor
        "row_of_big": big[42],  # contiguous slice of a big tensor
        "channels_last": (x + 1).contiguous(memory_format=torch.channels_last),
    }


# ---------------------------------------------------------------------------
# 10. workers that write a lot to stdout / stderr


class Chatty(Dataset):
    """Every sample (in a worker) writes ``nbytes`` to stdout and to stderr."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n = n
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if _in_worker():
            line = (f"chatty-{i:04d} " + "x" * 1000 + "\n").encode()
            reps = max(1, self.nbytes // len(line))
            blob = line * reps
            for fd in (1, 2):
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
            # The newline inside the text: print()'s own end="\n" is a second
            # write(2) when stdio is unbuffered (PYTHONUNBUFFERED=1), and the
            # other worker's writes can land between the two.
            print(f"chatty-print-{i}\n", end="", flush=True)
            print(f"chatty-stderr-{i}\n", end="", file=sys.stderr, flush=True)
        return torch.full((64,), i, dtype=torch.int64)
