"""Corners where FastLoader must do what torch.utils.data.DataLoader does.

Each test runs DataLoader and FastLoader on the same input and compares:

* worker counts that are not integers (``num_workers=2.0``): DataLoader's
  constructor accepts them and its iterator raises; FastLoader raises the
  same error at the same moment, after the same warnings;
* a generator (or another bare iterator) passed as the dataset: DataLoader's
  error, not a pickling one;
* nested tensors in samples and batches: they arrive, with the same values;
* tensors sharing memory within a batch (a row of a table and the table, in
  either order; overlapping views): they share it after the trip too;
* a non-leaf tensor that requires grad: refused with torch's message.
"""

from __future__ import annotations

import copy
import io
import itertools
import mmap
import pickle
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastload import FastLoader
from fastload.transport.reader import read_batch
from fastload.transport.writer import SlotWriter
from support import torch_versions

NESTED_PROTOTYPE = "ignore:The PyTorch API of nested tensors is in prototype stage"
# Cleanup noise of DataLoader's own iterator when it fails in __init__: it
# fails again in __del__, and, failing after it made its queues, leaves their
# feeder threads and connections to fail on pipes already closed.
_DATALOADER_FAILURE_NOISE = [
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function _MultiProcessingDataLoaderIter.__del__"
        ":pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function _ConnectionBase.__del__"
        ":pytest.PytestUnraisableExceptionWarning"),
]


def dataloader_fails(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test in which DataLoader's iterator fails: ignore its cleanup noise."""
    for mark in _DATALOADER_FAILURE_NOISE:
        test = mark(test)
    return test


class Rows(Dataset):
    """Sample i: ``tensor([i])``."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def identity(batch: List[Any]) -> List[Any]:
    return batch


def clone_collate(batch: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t.clone() for t in batch]


Outcome = Tuple[str, Any, List[Tuple[type, str]]]


def attempt(cls: type, dataset: Any, **kwargs: Any) -> Outcome:
    """(where it stopped, the batches or the exception, the warnings on the way)."""
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        try:
            loader = cls(dataset, **kwargs)
        except Exception as e:  # noqa: BLE001 - any error is compared
            return "construction", e, _warnings(ws)
        try:
            it = iter(loader)
        except Exception as e:  # noqa: BLE001
            return "iter", e, _warnings(ws)
        try:
            batches = list(it)
        except Exception as e:  # noqa: BLE001
            return "next", e, _warnings(ws)
        del it
    return "ok", batches, _warnings(ws)


def _warnings(ws: List[warnings.WarningMessage]) -> List[Tuple[type, str]]:
    return [(w.category, str(w.message)) for w in ws if issubclass(w.category, UserWarning)]


def assert_same_failure(dl: Outcome, fl: Outcome) -> None:
    assert dl[0] != "ok", "DataLoader was expected to fail"
    assert (fl[0], type(fl[1]), str(fl[1])) == (dl[0], type(dl[1]), str(dl[1]))
    assert fl[2] == dl[2]


# ---------------------------------------------------------------------------
# 1. worker counts
# ---------------------------------------------------------------------------
# kwargs that DataLoader's constructor accepts: its iterator rejects the
# non-integer counts and takes the integer-like ones.
COUNTS: Dict[str, Dict[str, Any]] = {
    "num_workers=2.0": dict(num_workers=2.0),
    "num_workers=1.5": dict(num_workers=1.5),
    "num_workers=0.5": dict(num_workers=0.5),
    "num_workers=np.float64": dict(num_workers=np.float64(2.0)),
    "num_workers=float-tensor": dict(num_workers=torch.tensor(2.0)),
    "prefetch_factor=2.0": dict(num_workers=2, prefetch_factor=2.0),
    "prefetch_factor=1.5": dict(num_workers=1, prefetch_factor=1.5),
    "prefetch_factor=np.float64": dict(num_workers=2, prefetch_factor=np.float64(3.0)),
    # Warnings of the iterator's set-up come before the error.
    "num_workers=2.0-pin_memory": dict(num_workers=2.0, pin_memory=True),
    # The sampler's error, met first in the iterator's set-up, wins.
    "num_workers=2.0-bad-batch_sampler": dict(num_workers=2.0, batch_sampler=5),
    "num_workers=2.0-shuffle": dict(num_workers=2.0, shuffle=True),
    # Integers to DataLoader's iterator: the checks refuse nothing more.
    "num_workers=True": dict(num_workers=True),
    "num_workers=np.int64": dict(num_workers=np.int64(2)),
    "prefetch_factor=True": dict(num_workers=2, prefetch_factor=True),
    "prefetch_factor=np.int64": dict(num_workers=2, prefetch_factor=np.int64(1)),
    "timeout=np.float64": dict(num_workers=1, timeout=np.float64(30.0)),
    "timeout=True": dict(num_workers=1, timeout=True),
}


@dataloader_fails
@pytest.mark.parametrize("case", list(COUNTS))
def test_worker_counts_as_dataloader(case):
    kwargs = COUNTS[case]
    if kwargs.get("pin_memory") and torch_versions.accelerator_available():
        pytest.skip("an accelerator is available: pin_memory does not warn")
    dl_gen, fl_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    dl = attempt(DataLoader, Rows(), generator=dl_gen, **kwargs)
    fl = attempt(FastLoader, Rows(), generator=fl_gen, **kwargs)
    if dl[0] == "ok":
        assert fl[0] == "ok", fl[1]
        assert [b.tolist() for b in fl[1]] == [b.tolist() for b in dl[1]]
        assert fl[2] == dl[2]
    else:
        assert dl[0] == "iter"
        assert_same_failure(dl, fl)
    # The iterator drew its base seed (before failing, if it failed).
    assert torch.equal(fl_gen.get_state(), dl_gen.get_state())


@dataloader_fails
@pytest.mark.parametrize("value", [2.0, -1])
def test_num_workers_set_after_construction(value):
    """DataLoader lets ``num_workers`` be set after construction; its iterator
    then checks it."""
    outcomes = []
    for cls in (DataLoader, FastLoader):
        loader = cls(Rows(), num_workers=1)
        loader.num_workers = value
        outcomes.append(attempt(lambda _ds, **_kw: loader, None))
    dl, fl = outcomes
    assert dl[0] == fl[0] == "iter"
    assert type(fl[1]) is type(dl[1])
    if value == -1:
        # The same check; DataLoader's message names its iterator class (older
        # torch, 2.1, asserts it bare, with no message).
        assert str(dl[1]) in ("num_workers must be greater than 0 for MultiProcessingDataLoaderIter", "")
        assert str(fl[1]) == "num_workers must be greater than 0 for multi-process loading"
    else:
        assert str(fl[1]) == str(dl[1])


# ---------------------------------------------------------------------------
# 2. a generator as the dataset
# ---------------------------------------------------------------------------
def _numbers() -> Iterator[int]:
    yield from range(4)


@dataloader_fails
@pytest.mark.parametrize(
    "kwargs",
    [dict(num_workers=2), dict(num_workers=1, batch_size=None), dict(num_workers=2, batch_size=3),
     dict(num_workers=1, multiprocessing_context="fork")],
    ids=["default", "no-batching", "batch_size=3", "fork"],
)
@pytest.mark.parametrize("make", ["generator-expression", "generator-function", "open-file"])
def test_iterator_as_dataset_fails_as_dataloader(make, kwargs, tmp_path):
    """DataLoader's (forked) workers never pickle the dataset: the first index
    drawn fails on ``len(dataset)``, when the iterator is made."""
    path = tmp_path / "lines.txt"
    path.write_text("a\nb\nc\n")

    def dataset() -> Any:
        if make == "generator-expression":
            return (i for i in range(4))
        if make == "generator-function":
            return _numbers()
        return open(path)  # noqa: SIM115 - closed below

    dl_ds, fl_ds = dataset(), dataset()
    try:
        dl = attempt(DataLoader, dl_ds, **kwargs)
        fl = attempt(FastLoader, fl_ds, **kwargs)
    finally:
        for ds in (dl_ds, fl_ds):
            if hasattr(ds, "close"):
                ds.close()
    assert dl[0] == "iter" and type(dl[1]) is TypeError
    assert "has no len()" in str(dl[1])
    assert_same_failure(dl, fl)
    assert not getattr(fl[1], "__notes__", None)  # no pickling advice


# ---------------------------------------------------------------------------
# 3. nested tensors
# ---------------------------------------------------------------------------
class NestedSamples(Dataset):
    """Sample i: a nested tensor of two ragged matrices (like PyTorch's
    test_nested_tensor_multiprocessing, with ragged sizes), in a dict with a
    plain tensor and a transposed (non-contiguous) nested tensor."""

    def __init__(self, n: int = 5) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        parts = [torch.randn(2, 3, generator=g), torch.randn(i + 1, 3, generator=g)]
        nt = torch.nested.nested_tensor(parts)
        return {"nested": nt, "plain": torch.full((2,), float(i)), "nested_t": nt.transpose(1, 2)}


def _assert_same_nested(a: Any, b: Any) -> None:
    if isinstance(b, dict):
        assert a.keys() == b.keys()
        for k in b:
            _assert_same_nested(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_nested(x, y)
    else:
        assert type(a) is type(b) and a.is_nested == b.is_nested
        assert a.layout == b.layout and a.dtype == b.dtype
        if b.is_nested:
            pa, pb = a.unbind(), b.unbind()
            assert len(pa) == len(pb)
            assert all(torch.equal(x, y) for x, y in zip(pa, pb))
        else:
            assert torch.equal(a, b)


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
@torch_versions.needs_nested_pickling
@pytest.mark.parametrize(
    "kwargs",
    [dict(batch_size=1, collate_fn=identity), dict(batch_size=2, collate_fn=identity),
     dict(batch_size=None)],
    ids=["identity-collate", "identity-collate-2", "no-batching"],
)
def test_nested_tensors_arrive_as_with_dataloader(kwargs):
    dl = attempt(DataLoader, NestedSamples(), num_workers=2, **kwargs)
    fl = attempt(FastLoader, NestedSamples(), num_workers=2, **kwargs)
    assert dl[0] == "ok", dl[1]
    assert fl[0] == "ok", fl[1]
    assert len(fl[1]) == len(dl[1])
    _assert_same_nested(fl[1], dl[1])


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
@pytest.mark.skipif(torch_versions.NESTED_TENSORS_PICKLE,
                    reason=f"torch {torch.__version__} pickles nested tensors: the tests above")
def test_nested_tensors_fail_clearly_where_torch_cannot_pickle_them():
    """Where torch cannot pickle a nested tensor (2.1), DataLoader's workers
    lose such a batch and its loop waits forever (so it is not run here);
    fastload raises the worker's error, naming the batch."""
    fl = attempt(FastLoader, NestedSamples(), num_workers=2, batch_size=None)
    assert fl[0] == "next" and type(fl[1]) is RuntimeError, fl
    assert "in DataLoader worker process" in str(fl[1]) and "sample index" in str(fl[1])


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
@torch_versions.needs_nested_pickling
@pytest.mark.heavy
def test_nested_tensors_outlive_their_batch():
    """Nested tensors kept while the rest of their batch is dropped and the
    ring goes round several times: their buffers stay theirs."""
    kw = dict(num_workers=2, batch_size=None)
    got = [b["nested_t"] for b in FastLoader(NestedSamples(40), **kw)]
    expected = [b["nested_t"] for b in DataLoader(NestedSamples(40), **kw)]
    _assert_same_nested(got, expected)


@pytest.mark.filterwarnings(NESTED_PROTOTYPE)
@torch_versions.needs_nested_pickling
@pytest.mark.heavy
def test_nested_tensors_from_pytorchs_test():
    """PyTorch's own case: a list of 1-element nested tensors, batch_size=1,
    a collate_fn that clones (2 workers where PyTorch has 4, which warns on
    machines with fewer CPUs)."""
    dataset = [torch.nested.nested_tensor([torch.randn(5)]) for _ in range(10)]
    loader = FastLoader(dataset, batch_size=1, num_workers=2, collate_fn=clone_collate)
    got = list(loader)
    expected = list(DataLoader(dataset, batch_size=1, num_workers=2, collate_fn=clone_collate))
    assert len(got) == len(expected) == 10
    for i, (f, d) in enumerate(zip(got, expected)):
        _assert_same_nested(f, d)
        _assert_same_nested(f[0], dataset[i])


# ---------------------------------------------------------------------------
# 4. memory shared within a batch
# ---------------------------------------------------------------------------
class TableRows(Dataset):
    """Sample i: a row of a table and the table (or the reverse, or two
    overlapping windows of it, or a row alone)."""

    def __init__(self, order: str) -> None:
        self.order = order
        self.table = torch.arange(64 * 1024, dtype=torch.float32).reshape(1024, 64)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, ...]:
        t = self.table
        if self.order == "view-then-table":
            return (t[i], t)
        if self.order == "table-then-view":
            return (t, t[i])
        if self.order == "overlapping-views":
            return (t[i : i + 3], t[i + 1 : i + 5], t[900])
        return (t[i],)


def _memory_layout(tensors: List[torch.Tensor]) -> List[List[Any]]:
    """For each pair of tensors: whether they overlap in memory and, if so,
    the distance between their first elements."""
    out = []
    for a in tensors:
        row = []
        for b in tensors:
            a0, a1 = a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()
            b0, b1 = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
            row.append(a0 - b0 if a0 < b1 and b0 < a1 else None)
        out.append(row)
    return out


def _flat(batch: Any) -> List[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    return [t for item in batch for t in _flat(item)]


def _writes_show(tensors: List[torch.Tensor]) -> List[List[bool]]:
    """For each pair: whether a write through the first changes the second."""
    out = []
    for a in tensors:
        row = []
        for b in tensors:
            before = b.clone()
            saved = a.clone()
            a.fill_(-1.0)
            row.append(not torch.equal(b, before))
            a.copy_(saved)
        out.append(row)
    return out


@pytest.mark.parametrize("collate", ["no-batching", "identity-collate"])
@pytest.mark.parametrize("order", ["view-then-table", "table-then-view", "overlapping-views"])
@pytest.mark.heavy
def test_shared_memory_within_a_batch_as_with_dataloader(order, collate):
    kwargs = dict(batch_size=None) if collate == "no-batching" else dict(batch_size=2,
                                                                         collate_fn=identity)
    dl = attempt(DataLoader, TableRows(order), num_workers=2, **kwargs)
    fl = attempt(FastLoader, TableRows(order), num_workers=2, **kwargs)
    assert dl[0] == "ok" and fl[0] == "ok", (dl[1], fl[1])
    assert len(fl[1]) == len(dl[1])
    for f, d in zip(fl[1], dl[1]):
        ft, dt = _flat(f), _flat(d)
        assert len(ft) == len(dt)
        assert all(torch.equal(a, b) for a, b in zip(ft, dt))
        assert [a.stride() for a in ft] == [b.stride() for b in dt]
        assert _memory_layout(ft) == _memory_layout(dt)
        assert _writes_show(ft) == _writes_show(dt)


class MixedDtypes(Dataset):
    """A float sample, its int label, a uint8 mask and a row of a table with
    the table: the batch's tensors differ in dtype, and two of them alias."""

    def __init__(self) -> None:
        self.table = torch.arange(24, dtype=torch.float64).reshape(6, 4)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Tuple[Any, ...]:
        return (torch.full((3,), float(i)), i, torch.ones(5, dtype=torch.uint8) * i,
                (self.table[i % 6], self.table))


@pytest.mark.parametrize("held", ["in-the-slot", "copied-out"])
@pytest.mark.parametrize("kwargs", [dict(batch_size=4), dict(batch_size=2, collate_fn=identity)],
                         ids=["default-collate", "identity-collate"])
@pytest.mark.heavy
def test_each_tensor_has_a_storage_of_its_own_as_with_dataloader(held, kwargs):
    """Through DataLoader each tensor of a batch arrives in shared memory of
    its own: one tensor saved, pickled or deep-copied carries its own bytes,
    and a batch whose tensors differ in dtype can be saved. The same holds
    for batches that view their slot and for batches copied out of it (the
    loop keeps more than ``held_batches``); tensors that alias still share
    one storage."""
    extra = {"held_batches": 1} if held == "copied-out" else {}
    dl = attempt(DataLoader, MixedDtypes(), num_workers=2, **kwargs)
    fl = attempt(FastLoader, MixedDtypes(), num_workers=2, **kwargs, **extra)
    assert dl[0] == fl[0] == "ok", (dl[1], fl[1])
    def tensors(batch: Any) -> List[torch.Tensor]:
        if isinstance(batch, torch.Tensor):
            return [batch]
        return [t for item in batch for t in tensors(item)] if isinstance(batch, (list, tuple)) else []

    for f, d in zip(fl[1], dl[1]):  # all batches kept alive: later ones copied out
        ft, dt = tensors(f), tensors(d)
        assert all(torch.equal(a, b) for a, b in zip(ft, dt))
        assert ([a.untyped_storage().nbytes() for a in ft]
                == [b.untyped_storage().nbytes() for b in dt])
        assert _memory_layout(ft) == _memory_layout(dt)
        for a, b in zip(ft, dt):
            assert len(pickle.dumps(a)) == len(pickle.dumps(b))
        saved = io.BytesIO()
        torch.save(f, saved)
        saved.seek(0)
        again = torch.load(saved, weights_only=False)
        assert all(torch.equal(a, b) for a, b in zip(tensors(again), dt))
        assert all(torch.equal(a, b) for a, b in zip(tensors(copy.deepcopy(f)), dt))
        with pytest.raises(RuntimeError, match="not resizable"):
            ft[0].resize_(10_000)


def _slot_round_trip(obj: Any) -> Tuple[Any, int]:
    """``obj`` through a SlotWriter and read_batch: (the copy, bytes the slot used)."""
    slot_bytes = 1 << 20
    mm = mmap.mmap(-1, slot_bytes)
    writer = SlotWriter(mm, slot_bytes)
    writer.begin(0)
    data_len, meta_off, meta_len, overflow_fd, _ = writer.finish(obj)
    assert overflow_fd is None
    base = torch.frombuffer(mm, dtype=torch.uint8)
    return read_batch(bytes(mm[meta_off : meta_off + meta_len]), [base]), data_len


def test_overlapping_views_of_different_dtypes_keep_values_and_aliasing():
    """Views of one float64 buffer as uint8, int16, int32 and float64, at
    starts that are not multiples of the largest element, in 200 random
    selections and orders: every value arrives, tensors that overlapped
    still overlap at the same distance and share one storage."""
    import random

    t = torch.arange(64, dtype=torch.float64)
    views = [t.view(torch.uint8)[1:9], t, t[1:].view(torch.int32)[1:],
             t.view(torch.int16)[3:], t[5:9], t[2:4], t.view(torch.uint8)[100:103], t[40:41]]

    def span(a: torch.Tensor) -> Tuple[int, int]:
        return a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()

    def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
        (a0, a1), (b0, b1) = span(a), span(b)
        return a0 < b1 and b0 < a1

    rng = random.Random(0)
    for _ in range(200):
        picked = rng.sample(views, rng.randint(1, len(views)))
        out, _used = _slot_round_trip(tuple(picked))
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(out, picked))
        for x, y in itertools.combinations(range(len(picked)), 2):
            assert overlap(out[x], out[y]) == overlap(picked[x], picked[y])
            if overlap(picked[x], picked[y]):
                assert (out[x].data_ptr() - out[y].data_ptr()
                        == picked[x].data_ptr() - picked[y].data_ptr())
                assert out[x].untyped_storage().data_ptr() == out[y].untyped_storage().data_ptr()


def test_small_view_of_a_big_storage_copies_only_the_view():
    """A row of a 256 KiB table, without the table: the slot gets the row
    (DataLoader's workers would move the whole table to shared memory)."""
    table = TableRows("row").table
    (row, again), used = _slot_round_trip((table[3], table[3]))  # two views of row 3
    assert torch.equal(row, table[3]) and again.data_ptr() == row.data_ptr()
    assert used < 4096 < table.untyped_storage().nbytes()
    (row, tab), used = _slot_round_trip((table[3], table))
    assert used == table.untyped_storage().nbytes()
    assert row.data_ptr() == tab[3].data_ptr()


# ---------------------------------------------------------------------------
# 5. tensors that require grad
# ---------------------------------------------------------------------------
class GradSamples(Dataset):
    def __init__(self, leaf: bool) -> None:
        self.leaf = leaf

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        t = torch.full((3,), float(i), requires_grad=True)
        return t if self.leaf else t * 2


@pytest.mark.heavy
def test_tensors_that_require_grad():
    """A leaf arrives as with DataLoader: a leaf that requires grad. A
    non-leaf: DataLoader's worker sends with torch's tensor reduction, which
    refuses it (DataLoader then never delivers the batch); FastLoader raises
    that error for the batch."""
    dl = attempt(DataLoader, GradSamples(leaf=True), num_workers=1, batch_size=None)
    fl = attempt(FastLoader, GradSamples(leaf=True), num_workers=1, batch_size=None)
    assert dl[0] == fl[0] == "ok"
    for f, d in zip(fl[1], dl[1]):
        assert torch.equal(f, d)
        assert (f.requires_grad, f.is_leaf, f.grad_fn) == (d.requires_grad, d.is_leaf, d.grad_fn)

    with pytest.raises(RuntimeError) as torch_refusal:
        ForkingPickler.dumps(GradSamples(leaf=False)[0])
    fl = attempt(FastLoader, GradSamples(leaf=False), num_workers=1, batch_size=None)
    assert fl[0] == "next" and type(fl[1]) is RuntimeError
    assert str(torch_refusal.value) in str(fl[1])


@dataloader_fails
@pytest.mark.parametrize("case", ["num_workers=2.0", "prefetch_factor=1.5", "num_workers=2.0-shuffle"])
def test_worker_counts_under_install(case):
    """A library's own DataLoader under ``fastload.install()`` fails as it
    did before the install."""
    import fastload

    kwargs = COUNTS[case]
    plain = attempt(DataLoader, Rows(), generator=torch.Generator().manual_seed(7), **kwargs)
    fastload.install()
    try:
        hooked = attempt(DataLoader, Rows(), generator=torch.Generator().manual_seed(7), **kwargs)
    finally:
        fastload.uninstall()
    assert_same_failure(plain, hooked)
