"""Well-behaved datasets, samplers and collate functions.

Every sample is a function of its index, so batches are easy to check and
to compare with DataLoader's. Module level so that workers unpickle them by
reference (see ``support/__init__``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate, get_worker_info

ACCEL_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
UNSET = "<unset>"


class Plain(Dataset):
    """``dataset[i] == torch.tensor(i)``; with ``width``, the row
    ``torch.full((width,), i, dtype=dtype)``. ``delay``: seconds every sample takes."""

    def __init__(self, n: int, *, delay: float = 0.0, width: Optional[int] = None,
                 dtype: torch.dtype = torch.int64) -> None:
        self.n = n
        self.delay = delay
        self.width = width
        self.dtype = dtype

    def __len__(self) -> int:
        return self.n

    def row(self, i: int, width: Optional[int] = None) -> torch.Tensor:
        """The sample for ``i`` (a row of ``width`` if given, else of ``self.width``)."""
        width = self.width if width is None else width
        if width is None:
            return torch.tensor(i)
        return torch.full((width,), i, dtype=self.dtype)

    def __getitem__(self, i: int) -> Any:
        if self.delay:
            time.sleep(self.delay)
        return self.row(i)


class GrowingRows(Plain):
    """float32 rows of ``width``, four times as wide for the second half of
    the indices: later batches outgrow the bytes a slot registered earlier."""

    def __init__(self, n: int, width: int) -> None:
        super().__init__(n, width=width, dtype=torch.float32)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.row(i, self.width * (1 + 3 * (i >= self.n // 2)))  # type: ignore[operator]


class BigSample(Dataset):
    """``numel`` int32 values per sample: ``arange(numel) + i`` (every element checkable)."""

    def __init__(self, n: int, numel: int) -> None:
        self.n = n
        self.numel = numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        t = torch.arange(self.numel, dtype=torch.int32)
        t += i
        return t


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


class EnvProbe(Dataset):
    """Each sample reports what the process making it sees: the accelerator
    variables (``UNSET`` if not set), pid, threads, get_worker_info()."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        info = get_worker_info()
        out: Dict[str, Any] = {var: os.environ.get(var, UNSET) for var in ACCEL_VARS}
        out.update(
            index=i,
            pid=os.getpid(),
            threads=torch.get_num_threads(),
            has_info=info is not None,
            worker_id=-1 if info is None else info.id,
            num_workers=-1 if info is None else info.num_workers,
            seed=-1 if info is None else info.seed,
            info_dataset_is_probe=info is not None and isinstance(info.dataset, EnvProbe),
        )
        return out


class Empty(Dataset):
    """A map-style dataset of length 0."""

    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int) -> torch.Tensor:  # pragma: no cover - never called
        raise IndexError(i)


class EmptyIterable(IterableDataset):
    """An IterableDataset that yields nothing."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(())


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
    """``range(n + extra)``: ``extra`` indices past the end of a dataset of ``n``."""

    def __init__(self, n: int, extra: int) -> None:
        self.n = n
        self.extra = extra

    def __len__(self) -> int:
        return self.n + self.extra

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n + self.extra))


# ---------------------------------------------------------------------------
# collate functions


def keep_collate(batch: List[Dict[str, Any]]) -> Dict[str, Any]:
    """For ``{"t": tensor, "extra": anything}`` samples: stacks the tensors,
    keeps the extras as they are."""
    return {"t": torch.stack([s["t"] for s in batch]), "extra": [s["extra"] for s in batch]}


def meta_collate(batch: List[torch.Tensor]) -> Dict[str, Any]:
    """A CPU batch plus a tensor on the ``meta`` device (stand-in for CUDA)."""
    x = torch.stack(batch)
    return {"x": x, "on_device": torch.empty((len(batch), 3), device="meta")}


def strided_collate(batch: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Views and layouts of an :class:`Images` batch and of fresh tensors."""
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


class Straggler(Plain):
    """``Plain`` whose samples take ``slow`` seconds in worker ``worker_id``
    and ``delay`` in the others: one worker lagging behind."""

    def __init__(self, n: int, *, delay: float, slow: float, worker_id: int = 1) -> None:
        super().__init__(n, delay=delay)
        self.slow = slow
        self.worker_id = worker_id

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        time.sleep(self.slow if info is not None and info.id == self.worker_id else self.delay)
        return self.row(i)


class SlowProbe(EnvProbe):
    """:class:`EnvProbe` whose samples sleep ``delay`` seconds (I/O, not CPU)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i: int) -> Dict[str, Any]:
        time.sleep(self.delay)
        return super().__getitem__(i)
