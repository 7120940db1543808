"""Datasets, collate functions and worker_init_fns of the DataLoader-equality
tests: nested samples of everything default_collate knows, every dtype,
randomness drawn in workers, IterableDatasets split among workers, custom
batch results. FastLoader's batches must equal DataLoader's for all of them.

Module level so that workers unpickle them by reference (see ``support/__init__``).
"""

from __future__ import annotations

import os
import random
import time
from collections import namedtuple
from typing import Any, Dict, List

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info
from torch.utils.data import default_collate

Point = namedtuple("Point", ["x", "y"])

# Set in a worker by ``worker_init`` and read back by the datasets.
WORKER_STATE: Dict[str, Any] = {}


def worker_init(worker_id: int) -> None:
    """A worker_init_fn with side effects the samples report back."""
    WORKER_STATE["init"] = worker_id * 10 + 7
    # Draws from the freshly seeded generators: later draws depend on it.
    WORKER_STATE["rand_at_init"] = torch.rand(1).item() + random.random()


def _worker_fields() -> Dict[str, Any]:
    info = get_worker_info()
    return {
        "wid": info.id if info is not None else -1,
        "nw": info.num_workers if info is not None else 0,
        "seed": info.seed if info is not None else -1,
        "initial_seed": torch.initial_seed(),
        "init": WORKER_STATE.get("init", -1),
        "rand_at_init": WORKER_STATE.get("rand_at_init", -1.0),
    }


def _draws() -> Dict[str, Any]:
    return {
        "torch": torch.rand(3),
        "torch_int": torch.randint(0, 1 << 30, (2,)),
        "py": random.random(),
        "py_int": random.randint(0, 1 << 30),
        "np": np.random.rand(2),
        "np_int": np.random.randint(0, 1 << 30),
    }


class NestedDataset(Dataset):
    """Map-style; nested samples of everything default_collate knows about.

    With ``randomness=True`` each sample also carries values drawn from
    torch/random/numpy inside the worker and the worker's get_worker_info().
    """

    def __init__(self, n: int = 23, randomness: bool = False) -> None:
        self.n = n
        self.randomness = randomness

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        sample: Dict[str, Any] = {
            "idx": i,
            "f": i / 4,
            "name": f"s{i}",
            "flag": i % 2 == 0,
            "x": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i,
            "pair": (torch.tensor([i, -i]), [torch.full((2,), i % 3 == 0), f"p{i}"]),
            "nt": Point(x=torch.tensor(i, dtype=torch.int16), y=float(i) * 1.5),
            "np": np.arange(4, dtype=np.float64) * i,
            "np_i32": np.int32(i),
            "np_f32": np.float32(i / 2),
            "deep": {"a": [(i, f"d{i}")], "b": {"c": torch.tensor([[i]], dtype=torch.int8)}},
        }
        if self.randomness:
            sample["rand"] = _draws()
            sample["worker"] = _worker_fields()
        return sample


class RandomDataset(Dataset):
    """Map-style; samples are mostly randomness drawn inside the worker."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        out = _draws()
        out["idx"] = i
        out["worker"] = _worker_fields()
        out["is_replica"] = get_worker_info() is not None and get_worker_info().dataset is self
        return out


class DtypeDataset(Dataset):
    """Map-style; one tensor per dtype, zero-size and 0-dim tensors."""

    DTYPES = (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )

    def __init__(self, n: int = 9) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        base = torch.arange(-3, 4, dtype=torch.float64) * (i + 1) / 2
        out: Dict[str, Any] = {}
        for dt in self.DTYPES:
            if dt == torch.bool:
                out[str(dt)] = base > 0
            elif dt.is_complex:
                out[str(dt)] = torch.complex(base, -base).to(dt)
            elif dt == torch.uint8:
                out[str(dt)] = (base.abs() * 2).to(dt)
            else:
                out[str(dt)] = base.to(dt)
        out["empty_1d"] = torch.empty(0)
        out["empty_2d"] = torch.zeros(3, 0, dtype=torch.int32)
        out["scalar"] = torch.tensor(i * 1.25)
        out["np_f16"] = np.full((2, 2), i / 8, dtype=np.float16)
        out["np_bool"] = np.array([i % 2 == 0, True])
        out["np_u8"] = np.arange(3, dtype=np.uint8) + i
        out["np_empty"] = np.zeros((0, 2), dtype=np.float32)
        out["x"] = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
        out["idx"] = i
        return out


class VarSizeDataset(Dataset):
    """Map-style; tensors of a different length per sample."""

    def __init__(self, n: int = 17) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.arange(i % 6, dtype=torch.float32) + i, i


def list_collate(batch: List[Any]) -> Any:
    """Variable-size samples: a list of tensors and a tensor of indices."""
    return [t for t, _ in batch], torch.tensor([i for _, i in batch])


class Box:
    """A custom (non-collatable) result type; compared through ``vars()``."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def weird_collate(batch: List[Any]) -> Any:
    """Returns a custom object full of odd things, views and layouts."""
    stacked = default_collate(batch)  # its tensors may live in fastload's ring
    x = stacked["x"]  # (B, 2, 3) float32
    c = stacked["torch.complex64"]
    idx = stacked["idx"] if "idx" in stacked else torch.arange(len(batch))
    arr = np.arange(12, dtype=np.int64).reshape(3, 4) * int(x.sum().item() + 1)
    return Box(
        default=stacked,
        t_view=x.transpose(1, 2),  # non-contiguous view of a collated tensor
        strided=x[:, :, ::2],
        expanded=torch.tensor([1.5, 2.5]).expand(4, 2),  # stride 0
        fresh_t=torch.arange(20, dtype=torch.float64).reshape(4, 5).t(),
        narrow=torch.arange(100)[10:20:3],
        conj=c.conj(),  # lazily conjugated view
        neg=torch.arange(4.0).neg(),
        requires_grad=torch.ones(3, requires_grad=True),
        zero_dim=torch.tensor(7, dtype=torch.int32),
        empty=torch.empty(2, 0, 5),
        arr=arr,
        arr_f=np.asfortranarray(arr),
        arr_view=arr[:, ::2],
        arr_empty=np.zeros((0, 4), dtype=np.float32),
        arr_str=np.array(["ab", "c"]),
        np_scalar=np.float64(3.25),
        raw=b"\x00\x01fastload" * 3,
        raw_array=bytearray(b"xyz"),
        nothing=None,
        flag=True,
        number=len(batch),
        ratio=len(batch) / 3,
        text="héllo",
        shape=x.shape,
        dtype=x.dtype,
        nested=[(idx, {"k": [None, b"b", 1j]})],
        aset=frozenset({1, 2, 3}),
        param=torch.nn.Parameter(x[0, 0].clone()),
    )


class BigDataset(Dataset):
    """Map-style; every sample is a float32 tensor of ``numel`` elements (~20 MB)."""

    def __init__(self, n: int = 5, numel: int = 5_000_000) -> None:
        self.n = n
        self.numel = numel

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        t = torch.arange(self.numel, dtype=torch.float32)
        t[::997] = -float(i)
        return {"big": t, "idx": i}


def big_mixed_collate(batch: List[Any]) -> Any:
    """A batch well past 1 MiB with tensors, numpy arrays and bytes."""
    collated = default_collate(batch)
    big = collated["big"]
    return {
        "small": collated["idx"],
        "big_t": big.t() if big.dim() == 2 else big,
        "big_np": big[0, :400_000].numpy().copy() * 2,
        "big_bytes": bytes(range(256)) * 6000,  # ~1.5 MB pickled in band
        "tail": torch.arange(5) * collated["idx"][0],
    }


def empty_and_big_numpy_collate(batch: List[Any]) -> Any:
    """A zero-length numpy array next to one larger than a 1 MiB slot."""
    i = int(batch[0])
    return [np.zeros((0,), dtype=np.float32), np.full(400_000, i, dtype=np.float32)]


class IndexDataset(Dataset):
    """Map-style; sample i is a small tensor made of i."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, 2 * i])


class CachingCollateDataset(Dataset):
    """Map-style, for batch_size=None: each item is a small stacked batch,
    made once with default_collate and then served from a per-worker cache."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.cache: Dict[int, Any] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i not in self.cache:
            self.cache[i] = default_collate([torch.full((4,), float(i)), torch.full((4,), -float(i))])
        return self.cache[i]


class ShardedIterable(IterableDataset):
    """Splits ``sizes`` among workers: worker w yields ``sizes[w]`` samples.

    Without workers it yields everything. Samples carry randomness drawn in
    the worker, which only depends on that worker's own stream.
    """

    def __init__(self, sizes: List[int]) -> None:
        self.sizes = list(sizes)

    def _range(self, w: int) -> range:
        start = sum(self.sizes[:w])
        return range(start, start + self.sizes[w])

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None:
            rng = range(sum(self.sizes))
            wid = -1
        else:
            assert info.num_workers == len(self.sizes)
            rng = self._range(info.id)
            wid = info.id
        for i in rng:
            yield {"i": i, "wid": wid, "t": torch.tensor([i, i * i]), "r": torch.rand(2),
                   "py": random.random()}


class UnshardedIterable(IterableDataset):
    """Yields the same stream in every worker (duplicates, like DataLoader)."""

    def __init__(self, n: int = 7) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid = info.id if info is not None else -1
        for i in range(self.n):
            yield {"i": i, "wid": wid, "np": np.random.rand(1)}


class SizedIterable(IterableDataset):
    """An IterableDataset whose ``__len__`` under-reports what it yields."""

    def __init__(self, n: int, reported: int) -> None:
        self.n = n
        self.reported = reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Any:
        return iter(range(self.n))


class RandomBatchSampler(Sampler):
    """A custom batch sampler: random batch sizes and contents from a generator."""

    def __init__(self, n: int, num_batches: int, generator: torch.Generator) -> None:
        self.n = n
        self.num_batches = num_batches
        self.generator = generator

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Any:
        for _ in range(self.num_batches):
            size = int(torch.randint(1, 6, (1,), generator=self.generator))
            yield torch.randint(0, self.n, (size,), generator=self.generator).tolist()


class RangeIterable(IterableDataset):
    """torch's documented IterableDataset example: worker_init_fn shards it."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end

    def __iter__(self) -> Any:
        return iter(range(self.start, self.end))


def shard_range_init(worker_id: int) -> None:
    """Splits the worker's RangeIterable replica, through get_worker_info().dataset."""
    info = get_worker_info()
    ds = info.dataset
    start, end = ds.start, ds.end
    per = -(-(end - start) // info.num_workers)
    ds.start = start + worker_id * per
    ds.end = min(ds.start + per, end)


def aliasing_collate(batch: List[Any]) -> Any:
    """The same tensor twice and a view of it, for a collated tensor and a fresh one
    (think ``{"input_ids": x, "labels": x}``)."""
    x = default_collate(batch)
    y = torch.stack(batch) * 1
    return {"x": x, "x_again": x, "x_tail": x[:, 1:], "y": y, "y_again": y, "y_tail": y[:, 1:]}


class SlowFirstBigDataset(BigDataset):
    """BigDataset where, in a worker, sample 0 waits until sample 3 has been
    made (by the other worker, batch_size=2) and then 0.2 s more: batch 1 is
    ready before batch 0 without depending on how fast the workers start."""

    def __init__(self, n: int, numel: int, marker: str) -> None:
        super().__init__(n, numel)
        self.marker = marker

    def __getitem__(self, i: int) -> Any:
        if get_worker_info() is not None:
            if i == 0:
                deadline = time.monotonic() + 20
                while not os.path.exists(self.marker) and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)
            elif i == 3:
                open(self.marker, "a").close()
        return super().__getitem__(i)


# ---------------------------------------------------------------------------
# comparing batches


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Recursive equality of two batches: types, structure, dtypes, shapes, values."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert a.layout == b.layout, f"{path}: layout {a.layout} != {b.layout}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        assert torch.equal(a.detach(), b.detach()), f"{path}: values differ:\n{a}\n!=\n{b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.array_equal(a, b), f"{path}: values differ:\n{a}\n!=\n{b}"
        assert a.flags.writeable == b.flags.writeable, f"{path}: writeable flag differs"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a == b, f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, tuple) and hasattr(a, "_fields"):  # namedtuple
        assert a._fields == b._fields, f"{path}: fields {a._fields} != {b._fields}"
        for k, x, y in zip(a._fields, a, b):
            assert_same(x, y, f"{path}.{k}")
    elif isinstance(a, (list, tuple)):  # includes torch.Size
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(
        a, (str, bytes, bytearray, bool, int, float, complex, type(None), frozenset, set, torch.dtype)
    ):
        assert a == b, f"{path}: {a!r} != {b!r}"
    elif hasattr(a, "__dict__"):  # custom objects: their attributes
        assert_same(vars(a), vars(b), f"{path}.__dict__")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_epochs_same(got: List[List[Any]], expected: List[List[Any]]) -> None:
    assert len(got) == len(expected)
    for e, (g, x) in enumerate(zip(got, expected)):
        assert len(g) == len(x), f"epoch {e}: {len(g)} batches != {len(x)}"
        for i, (gb, xb) in enumerate(zip(g, x)):
            assert_same(gb, xb, f"epoch {e} batch {i}")
