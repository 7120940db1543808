"""fastload.launching.parcels: what shares, what copies, and the fds that travel.

Round trips in one process (pack, then unpack with the parcel's own fds, as
a worker would with the fds it received): shared objects come back sharing
memory with the original, plain ones as copies.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context as mp_context
from multiprocessing import reduction

import pytest
import torch

from fastload.launching import parcels as crossing


def _round_trip(obj):
    parcel = crossing.pack(obj, "test object")
    try:
        fds = [os.dup(fd) for fd in parcel.fds]  # what SCM_RIGHTS would hand a worker
        return crossing.unpack(parcel.data, fds), len(parcel.fds)
    finally:
        parcel.close()


def test_shared_tensor_is_shared_plain_tensor_is_copied():
    shared = torch.zeros(4).share_memory_()
    plain = torch.zeros(4)
    (s2, p2), nfds = _round_trip((shared, plain))
    assert nfds == 1  # the shared storage's fd; the plain tensor travels as bytes
    shared.add_(1)
    plain.add_(1)
    assert s2.tolist() == [1.0] * 4
    assert p2.tolist() == [0.0] * 4
    assert not plain.is_shared()  # not moved into shared memory on the way


# multiprocessing's Value/Array/Lock/Queue cross end to end in tests/test_real_code.py
# (a rebuilt heap arena keeps its fd for the life of the process that rebuilt it).


def test_fork_context_objects_are_fork_only():
    with pytest.raises(crossing.ForkOnlyError, match="fork context"):
        crossing.pack(multiprocessing.get_context("fork").Lock(), "lock")


def test_unpicklable_names_what():
    import threading

    with pytest.raises(TypeError) as info:
        crossing.pack((threading.Lock(),), "dataset", names=("dataset",))
    assert "cannot send the dataset" in "".join(info.value.__notes__)


def test_unused_fds_are_closed_after_unpack():
    parcel = crossing.pack(torch.zeros(2).share_memory_(), "tensor")
    extra = os.dup(parcel.fds[0])
    crossing.unpack(parcel.data, [os.dup(parcel.fds[0]), extra])  # one more than needed
    with pytest.raises(OSError):
        os.fstat(extra)
    parcel.close()


def test_private_multiprocessing_names_used_still_work():
    """crossing presents itself as a process being started to multiprocessing's
    reducers (they refuse to pickle otherwise) through
    multiprocessing.context.set_spawning_popen, and reduction.DupFd asks that
    object for the fd. Neither is public API: this pins both."""
    calls = []

    class Popen:
        def duplicate_for_child(self, fd):
            calls.append(fd)
            return 42

        def DupFd(self, index):  # noqa: N802
            return ("handle", index)

    mp_context.set_spawning_popen(Popen())
    try:
        assert mp_context.get_spawning_popen() is not None
        assert reduction.DupFd(5) == ("handle", 42)
    finally:
        mp_context.set_spawning_popen(None)
    assert calls == [5]


class _HoldsHandles(torch.utils.data.Dataset):
    """What DataLoader's forked workers inherit and pickle refuses: an open
    file, a lock, a sqlite connection, a generator."""

    def __init__(self, path: str) -> None:
        import sqlite3
        import threading

        self.file = open(path)
        self.lock = threading.Lock()
        self.db = sqlite3.connect(":memory:")
        self.gen = (i for i in range(3))

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple:
        with self.lock:
            letter = os.pread(self.file.fileno(), 1, i).decode()  # the offset is shared
            return i, letter, self.db.execute("select ?", (i,)).fetchone()[0]


@pytest.mark.parametrize("persistent", [False, True])
def test_an_explicit_fork_hands_the_dataset_over_unpickled(tmp_path, persistent: bool) -> None:
    """With ``multiprocessing_context="fork"`` workers are forked from the
    training process with the dataset itself, as DataLoader's are, so what
    cannot be pickled works there too; each epoch sees the dataset as it is."""
    from torch.utils.data import DataLoader

    from fastload import FastLoader

    path = tmp_path / "letters"
    path.write_text("abcdefgh")
    ds = _HoldsHandles(os.fspath(path))
    kw = dict(batch_size=3, num_workers=2, multiprocessing_context="fork",
              persistent_workers=persistent)
    loader = FastLoader(ds, **kw)
    reference = DataLoader(ds, **kw)
    try:
        for letters in ("abcdefgh", "ABCDEFGH"):  # read through the inherited handle
            path.write_text(letters)
            got = [(b[0].tolist(), list(b[1]), b[2].tolist()) for b in loader]
            assert got == [(b[0].tolist(), list(b[1]), b[2].tolist()) for b in reference]
            assert got[2] == ([6, 7], list(letters[6:]), [6, 7])
    finally:
        del loader, reference
        ds.file.close()
        ds.db.close()


def test_a_dataset_that_cannot_be_pickled_is_told_about_fork(tmp_path) -> None:
    """Under the default start method the dataset is pickled, and a handle
    fails as with DataLoader's spawn; the error names the attribute and both
    remedies: open it in the worker, or fork."""
    from fastload import FastLoader

    path = tmp_path / "letters"
    path.write_text("abcdefgh")
    ds = _HoldsHandles(os.fspath(path))
    try:
        with pytest.raises(TypeError, match="cannot pickle") as info:
            iter(FastLoader(ds, batch_size=3, num_workers=2))
        notes = "\n".join(info.value.__notes__)
        assert any(f"dataset.{name}" in notes for name in ("file", "lock", "db", "gen")), notes
        assert "multiprocessing_context='fork'" in notes
    finally:
        ds.file.close()
        ds.db.close()
