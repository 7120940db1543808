"""Datasets that hold their data: what fork shares crosses by reference.

A dataset holding a big tensor, a numpy array, a memory-mapped file or an
open file gets the same batches as DataLoader(fork), with the same
semantics (a worker's writes stay its own; what the next epoch's workers
see is what the dataset holds at that ``iter()``), and its data never
crosses as bytes: the session's pickle stays small
(:mod:`fastload.launching.references`).
"""

from __future__ import annotations

import gc
import io
import os
import pickle
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastload
from fastload import FastLoader, SharedSequence
from fastload.launching import memfds, references
from fastload.launching import parcels as crossing
from fastload.launching.buffer_copies import SharedBuffers

from support import NW

MB = 1 << 20
# Moving a storage in place needs UntypedStorage._swap_data_ptr_ (torch 2.13
# and 2.15 have it; 2.11 and 2.1 do not): without it a tensor crosses as a
# buffer copied once per loader, which the other tests check.
moves_tensors = pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
    reason=f"torch {torch.__version__} cannot move a storage in place (no "
           "UntypedStorage._swap_data_ptr_): tensors cross as copies")


def _epochs(loader: Any, n: int = 2) -> List[List[Any]]:
    return [list(loader) for _ in range(n)]


def _fork(ds: Dataset, **kw: Any) -> DataLoader:
    return DataLoader(ds, num_workers=NW, multiprocessing_context="fork", **kw)


def _parcel_bytes(ds: Any, buffers: Any = None) -> int:
    parcel = crossing.pack(ds, "dataset", buffers=buffers)
    try:
        return len(parcel.data)
    finally:
        parcel.close()


def _same(a: List[List[Any]], b: List[List[Any]]) -> None:
    assert len(a) == len(b)
    for ea, eb in zip(a, b):
        assert len(ea) == len(eb)
        for x, y in zip(ea, eb):
            if isinstance(x, (list, tuple)):
                for u, v in zip(x, y):
                    assert torch.equal(torch.as_tensor(u), torch.as_tensor(v))
            else:
                assert torch.equal(x, y)


# ---------------------------------------------------------------------------
# tensors


class TensorRows(Dataset):
    """Rows of a big tensor; ``scribble`` writes into the dataset's own
    tensor in the worker (as a buggy augmentation might)."""

    def __init__(self, rows: int = 4096, scribble: bool = False) -> None:
        self.data = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256)  # 4 MiB
        self.scribble = scribble

    def __len__(self) -> int:
        return self.data.shape[0] // 64

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.data[i * 64].clone()
        if self.scribble:
            self.data[i * 64] = -1.0
        return row


@moves_tensors
def test_a_big_tensor_is_moved_once_in_place_and_sent_by_reference() -> None:
    ds = TensorRows()
    t = ds.data
    view = t[10:20]
    before = t.clone()
    assert not t.is_shared()
    expected = _epochs(_fork(ds, batch_size=8))
    loader = FastLoader(ds, batch_size=8, num_workers=NW)
    _same(_epochs(loader, 3), expected + expected[:1])
    # The user's tensor: the same object, the same values, now shared; a
    # view taken before still views it.
    assert ds.data is t and t.is_shared() and torch.equal(t, before)
    t[15, 0] = 123.0
    assert view[5, 0].item() == 123.0
    t[15, 0] = before[15, 0]
    # Its 4 MiB never cross as bytes.
    assert _parcel_bytes(ds) < 64 << 10
    del loader
    gc.collect()


def test_a_worker_s_writes_to_the_dataset_stay_its_own_as_under_fork() -> None:
    ds = TensorRows(scribble=True)
    before = ds.data.clone()
    expected = _epochs(_fork(ds, batch_size=8))
    assert torch.equal(ds.data, before)  # fork: the training process's tensor is untouched
    loader = FastLoader(ds, batch_size=8, num_workers=NW)
    _same(_epochs(loader), expected)
    assert torch.equal(ds.data, before)
    del loader
    gc.collect()


def test_what_the_next_epoch_sees_is_what_the_dataset_holds_at_iter() -> None:
    ds = TensorRows()
    arr = ArrayRows()
    for d in (ds, arr):
        loader = FastLoader(d, batch_size=64, num_workers=NW)
        first = next(iter(loader))
        d.data[0] = 7  # between epochs, in the training process
        second = next(iter(loader))
        assert float(second[0, 0]) == 7 and float(first[0, 0]) == 0
        del loader
        gc.collect()


def test_a_tensor_that_views_numpy_memory_keeps_viewing_it() -> None:
    """``torch.from_numpy`` memory is numpy's: it cannot be moved without
    un-aliasing the two, so it crosses as a buffer copied once per loader."""
    arr = np.arange(1 << 20, dtype=np.float32)
    ds = TensorRows()
    ds.data = torch.from_numpy(arr).reshape(4096, 256)
    loader = FastLoader(ds, batch_size=8, num_workers=NW)
    expected = _epochs(_fork(ds, batch_size=8))
    _same(_epochs(loader), expected)
    arr[0] = -5.0
    assert ds.data[0, 0].item() == -5.0 and not ds.data.is_shared()  # still numpy's memory
    state = loader._fastload_state  # noqa: SLF001 - the loader's buffer copies
    assert state.pools.buffers.nbytes >= 4 * MB
    del loader, state
    gc.collect()


def test_a_tensor_loaded_with_mmap_is_mapped_again_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"a": torch.arange(1 << 20, dtype=torch.float32),
                "b": torch.arange(1 << 19, dtype=torch.int64)}, path)
    loaded = torch.load(str(path), mmap=True)
    parts = (loaded["b"][100:], loaded["a"][4:].view(-1, 7)[::2, 1:])
    buffers = SharedBuffers()
    parcel = crossing.pack(parts, "t", buffers=buffers)
    assert len(parcel.data) < 4096 and buffers.nbytes == 0  # the file, not its bytes
    got = crossing.unpack(parcel.data, [os.dup(fd) for fd in parcel.fds])
    parcel.close()
    buffers.close()
    for x, y in zip(parts, got):
        assert torch.equal(x, y) and x.dtype == y.dtype


@moves_tensors
def test_past_the_fd_budget_tensors_go_as_buffer_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset of many big tensors: at most _FDS_PER_PACK move into memfds
    of their own (an fd each); the rest share the loader's buffer copies, so
    the session's fds stay few however many tensors there are."""
    monkeypatch.setattr(references, "MOVE_BYTES", 64 << 10)
    monkeypatch.setattr(references, "_FDS_PER_PACK", 3)
    tensors = [torch.full((32 << 10,), float(i)) for i in range(6)]  # 128 KiB each
    buffers = SharedBuffers()
    try:
        for _epoch in range(2):
            parcel = crossing.pack(tensors, "t", buffers=buffers)
            assert len(parcel.fds) == 4  # three moved tensors and one arena
            got = crossing.unpack(parcel.data, [os.dup(fd) for fd in parcel.fds])
            parcel.close()
            assert all(torch.equal(a, b) for a, b in zip(tensors, got))
        assert [t.is_shared() for t in tensors] == [True] * 3 + [False] * 3
    finally:
        buffers.close()


def test_parameters_and_requires_grad_survive_the_crossing() -> None:
    p = torch.nn.Parameter(torch.ones(1 << 20))
    g = torch.zeros(1 << 20, requires_grad=True)
    buffers = SharedBuffers()
    parcel = crossing.pack((p, g), "t", buffers=buffers)
    q, h = crossing.unpack(parcel.data, [os.dup(fd) for fd in parcel.fds])
    parcel.close()
    buffers.close()
    assert type(q) is torch.nn.Parameter and q.requires_grad and torch.equal(q, p)
    assert h.requires_grad and h.is_leaf and torch.equal(h, g)


@moves_tensors
def test_torch_s_private_storage_calls_fastload_uses_still_behave() -> None:
    """Pinned: ``_new_shared_fd_cpu`` (a storage over an fd that keeps it),
    ``_share_fd_cpu_`` (that fd back) and ``_swap_data_ptr_`` (two storages'
    memory swapped in place, so every view follows)."""
    t = torch.arange(1 << 20, dtype=torch.int32)
    view = t[5:]
    fd = memfds.move_to_shared(t.untyped_storage())
    assert t.is_shared() and view.is_shared()
    assert t.untyped_storage()._share_fd_cpu_()[0] == fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fastload-data")
    assert torch.equal(view, torch.arange(5, 1 << 20, dtype=torch.int32))
    view[0] = -1
    assert t[5].item() == -1


# ---------------------------------------------------------------------------
# numpy arrays, memory-mapped files


class ArrayRows(Dataset):
    def __init__(self, data: Any = None) -> None:
        self.data = np.arange(1 << 20, dtype=np.float32).reshape(4096, 256) if data is None else data

    def __len__(self) -> int:
        return self.data.shape[0] // 64

    def __getitem__(self, i: int) -> torch.Tensor:
        # (as int64: torch before 2.3 cannot make a tensor of uint16)
        return torch.from_numpy(np.asarray(self.data[i * 64]).astype(np.int64))


def test_a_big_array_is_copied_once_per_loader_and_reused_while_unchanged() -> None:
    ds = ArrayRows()
    buffers = SharedBuffers()
    try:
        assert _parcel_bytes(ds, buffers) < 64 << 10
        held = buffers.nbytes
        assert held >= 4 * MB
        first = crossing.pack(ds, "dataset", buffers=buffers)
        second = crossing.pack(ds, "dataset", buffers=buffers)
        same = [os.fstat(fd).st_ino for fd in first.fds] == [os.fstat(fd).st_ino for fd in second.fds]
        assert same and buffers.nbytes == held  # the same copy, sent again
        ds.data[3, 3] = -1
        third = crossing.pack(ds, "dataset", buffers=buffers)
        got = crossing.unpack(third.data, [os.dup(fd) for fd in third.fds])
        assert got.data[3, 3] == -1 and buffers.nbytes == held  # a new copy, the old one dropped
        got.data[0, 0] = 99  # copy-on-write: the receiver's own
        assert ds.data[0, 0] == 0
        for p in (first, second, third):
            p.close()
    finally:
        buffers.close()


def test_views_of_one_array_cross_with_their_strides() -> None:
    a = np.arange(1 << 20, dtype=np.int64).reshape(1024, 1024)
    parts = (a[::2, 1::3], a.T, a[100:300], a[::-1])
    buffers = SharedBuffers()
    try:
        parcel = crossing.pack(parts, "views", buffers=buffers)
        got = crossing.unpack(parcel.data, [os.dup(fd) for fd in parcel.fds])
        parcel.close()
        for x, y in zip(parts, got):
            assert x.shape == y.shape and x.dtype == y.dtype and (x == y).all()
    finally:
        buffers.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.bin"
    np.arange(1 << 21, dtype=np.uint16).tofile(path)  # 4 MiB of tokens
    return path


@pytest.mark.parametrize("ctx", [None, "spawn"])
def test_under_spawn_too_the_data_crosses_by_reference(ctx: Any) -> None:
    """Spawned workers are sent the session each; the same references."""
    tensor_ds, array_ds = TensorRows(), ArrayRows()
    for ds in (tensor_ds, array_ds):
        expected = _epochs(_fork(ds, batch_size=8))
        loader = FastLoader(ds, batch_size=8, num_workers=NW, multiprocessing_context=ctx)
        _same(_epochs(loader), expected)
        del loader
        gc.collect()
    if hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        assert tensor_ds.data.is_shared()


@pytest.mark.parametrize("mode", ["r", "c", "r+"])
def test_a_memmap_is_mapped_again_from_its_file(token_file: Path, mode: str) -> None:
    m = np.memmap(token_file, dtype=np.uint16, mode=mode)
    ds = ArrayRows(m[1024:].reshape(-1, 1024))  # a slice: the offset is its own
    assert _parcel_bytes(ds, SharedBuffers()) < 4096
    loader = FastLoader(ds, batch_size=8, num_workers=NW)
    _same(_epochs(loader), _epochs(_fork(ds, batch_size=8)))
    del loader
    parcel = crossing.pack(ds, "dataset")
    got = crossing.unpack(parcel.data, parcel.fds)
    parcel.fds = []
    assert isinstance(got.data, np.ndarray) and (got.data == ds.data).all()
    if mode == "r":
        with pytest.raises(ValueError, match="read-only"):
            got.data[0, 0] = 1
    else:
        got.data[0, 0] = 4242
        got.data.base.flush() if hasattr(got.data.base, "flush") else None
        on_disk = np.fromfile(token_file, dtype=np.uint16)[1024]
        assert on_disk == (4242 if mode == "r+" else 1024)  # 'c': the writer's own
    del got, m, ds
    gc.collect()


def test_a_private_mapping_the_training_process_wrote_to_crosses_as_its_bytes(token_file: Path) -> None:
    m = np.memmap(token_file, dtype=np.uint16, mode="c")
    m[0] = 999  # now differs from the file: workers must see this, as under fork
    buffers = SharedBuffers()
    try:
        parcel = crossing.pack(m, "m", buffers=buffers)
        got = crossing.unpack(parcel.data, [os.dup(fd) for fd in parcel.fds])
        parcel.close()
        assert got[0] == 999 and (got[1:] == m[1:]).all()
    finally:
        buffers.close()
    del m
    gc.collect()


# ---------------------------------------------------------------------------
# fastload.share


def test_share_an_array_gives_one_copy_crossing_by_reference() -> None:
    a = np.arange(1 << 20, dtype=np.float32).reshape(4096, 256)
    s = fastload.share(a)
    assert s is not a and (s == a).all() and s.dtype == a.dtype and s.shape == a.shape
    buffers = SharedBuffers()
    ds = ArrayRows(s)
    assert _parcel_bytes(ds, buffers) < 4096 and buffers.nbytes == 0  # no copy made
    loader = FastLoader(ds, batch_size=8, num_workers=NW)
    _same(_epochs(loader), _epochs(_fork(ds, batch_size=8)))
    del loader, s, ds
    gc.collect()


@moves_tensors
def test_share_a_tensor_moves_it_in_place() -> None:
    t = torch.ones(1 << 16)
    assert fastload.share(t) is t and t.is_shared()
    with pytest.raises(ValueError, match="share the array instead"):
        fastload.share(torch.from_numpy(np.ones(4)))


@pytest.mark.parametrize("items", [
    [f"/data/img_{i:07d}.jpg" for i in range(1000)] + ["ünïcødé", ""],
    [b"\x00\xff", b"", b"abc"] * 10,
    list(range(-500, 500)) + [2 ** 62],
    [],
])
def test_a_shared_sequence_reads_as_the_list(items: List[Any]) -> None:
    s = fastload.share(items)
    assert isinstance(s, SharedSequence)
    assert len(s) == len(items) and list(s) == items and s == items
    for i in (0, 1, -1, len(items) // 2):
        if items:
            assert s[i] == items[i]
    assert s[2:40:3] == items[2:40:3] and s[::-1] == items[::-1]
    with pytest.raises(IndexError, match="list index out of range"):
        s[len(items)]
    with pytest.raises(TypeError, match="list indices must be integers or slices"):
        s["a"]  # type: ignore[index]
    back = pickle.loads(pickle.dumps(s))  # by value outside a process start
    assert back == items
    parcel = crossing.pack(s, "paths")
    got = crossing.unpack(parcel.data, parcel.fds)
    parcel.fds = []
    assert got == items
    if len(items) > 100:
        assert len(parcel.data) < 1024  # by reference


def test_share_refuses_what_it_cannot_share() -> None:
    with pytest.raises(TypeError, match="only str, only bytes or only int"):
        fastload.share(["a", 1])
    with pytest.raises(OverflowError, match="64 bits"):
        fastload.share([2 ** 70])
    with pytest.raises(TypeError, match="expected a numpy array"):
        fastload.share({"a": 1})


class SharedPaths(Dataset):
    def __init__(self, n: int) -> None:
        self.paths = fastload.share([f"/data/{i}.jpg" for i in range(n)])
        self.labels = fastload.share([i % 7 for i in range(n)])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        return self.paths[i], self.labels[i]


def test_a_dataset_of_shared_lists_gives_dataloader_s_batches() -> None:
    ds = SharedPaths(500)
    expected = _epochs(_fork(ds, batch_size=16))
    loader = FastLoader(ds, batch_size=16, num_workers=NW)
    got = _epochs(loader)
    assert [[(list(p), l.tolist()) for p, l in e] for e in got] == \
           [[(list(p), l.tolist()) for p, l in e] for e in expected]
    del loader
    gc.collect()


# ---------------------------------------------------------------------------
# open files


class FileRows(Dataset):
    """Reads record ``i`` from a file opened in ``__init__``."""

    def __init__(self, path: Path, mode: str = "rb", skip: int = 0) -> None:
        self.f = open(path, mode) if mode != "raw" else io.FileIO(path, "r")
        self.f.read(skip)  # a position the workers start from, as under fork
        self.start = self.f.tell()

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        here = self.f.tell()  # each worker has its own offset
        self.f.seek(self.start + 8 * i)
        rec = self.f.read(8)
        self.f.seek(here)
        return (here == self.start), rec if isinstance(rec, str) else rec.decode()


@pytest.mark.parametrize("mode", ["rb", "r", "raw"])
def test_a_file_opened_for_reading_is_opened_again_in_each_worker(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "records.txt"
    path.write_text("".join(f"rec{i:04d}" for i in range(40)))
    ds = FileRows(path, mode, skip=8)
    try:
        expected = [[(b.tolist(), r) for b, r in e] for e in _epochs(DataLoader(ds, batch_size=4))]
        loader = FastLoader(ds, batch_size=4, num_workers=NW)
        got = [[(b.tolist(), r) for b, r in e] for e in _epochs(loader)]
        assert got == expected
        assert ds.f.tell() == 8  # the training process's file is untouched
        del loader
        gc.collect()
    finally:
        ds.f.close()


def test_a_file_opened_for_writing_is_still_refused(tmp_path: Path) -> None:
    with open(tmp_path / "log.txt", "w") as f:
        with pytest.raises(TypeError, match="cannot pickle"):
            crossing.pack(f, "dataset")


class H5Rows(Dataset):
    def __init__(self, path: Path) -> None:
        import h5py
        self.f = h5py.File(path, "r")
        self.x = self.f["x"]

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> Any:
        return torch.as_tensor(self.x[i]), int(self.f["y"][i])


def test_an_h5py_file_opened_read_only_is_opened_again_in_each_worker(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py", reason="h5py is in the test extra")
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(500, dtype=np.float32).reshape(50, 10)
        f["y"] = np.arange(50) * 3
    ds = H5Rows(path)
    try:
        expected = _epochs(_fork(ds, batch_size=5))
        loader = FastLoader(ds, batch_size=5, num_workers=NW)
        _same(_epochs(loader), expected)
        del loader
        gc.collect()
    finally:
        ds.f.close()


# ---------------------------------------------------------------------------
# an unchanged dataset is not unpickled again


class CountsUnpickling(Dataset):
    """Appends a line to ``log`` each time a process unpickles it."""

    def __init__(self, log: Path) -> None:
        self.log = str(log)
        self.version = 0

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i + self.version


def test_an_unchanged_dataset_is_unpickled_once_a_changed_one_again(tmp_path: Path) -> None:
    log = tmp_path / "unpickled"
    ds = CountsUnpickling(log)
    loader = FastLoader(ds, batch_size=4, num_workers=NW)
    for _ in range(3):
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(log.read_text().split()) == 1
    ds.version = 10
    assert [b.tolist() for b in loader] == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert len(log.read_text().split()) == 2
    del loader
    gc.collect()
