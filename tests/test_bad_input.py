"""Bad input with real workers (num_workers=2), against DataLoader.

Each test feeds the loader one kind of bad input, compares
what FastLoader does with what ``torch.utils.data.DataLoader`` does wherever
DataLoader has a defined behaviour (exception type, worker number, the
original exception's last line), checks that fastload's error names the
batch's sample indices, and then removes the cause and runs a new epoch of
the same loader (or checks that the loader shut down cleanly).

What is covered elsewhere is not repeated here: an exception raised by
``dataset[i]`` or the collate_fn and ``worker_init_fn`` (test_errors), a lock
or a generator in a batch and a dataset holding a lock or a socket
(test_errors.test_unpicklable_*), an empty map-style dataset without shuffle,
``os._exit(3)`` and ``sys.exit(0)`` in a worker (test_errors), constructor
arguments (test_arguments), large batches through the overflow segment and
views in a custom collate compared by value (test_equality).

DataLoader runs with its platform default start method (fork: fast).
Datasets live in ``tests/support`` so that spawned or zygote-forked workers
import them by reference. Every FastLoader starts
worker processes (about a second each here), so each test uses one loader
for its error epoch and its recovery epoch: the dataset is pickled anew for
every iterator, so a cause removed in this process is gone in the workers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from typing import Any, List

import pytest
import torch
from torch.utils.data import DataLoader

from fastload import FastLoader
from fastload.debug import debug_view
from support import HANG_S, NW, TESTS_DIR
from support.datasets import (BigSample, Empty, EmptyIterable, Images, ListDataset, PastTheEnd,
                              Plain, keep_collate, meta_collate, strided_collate)
from support.faults import Chatty, Holds, HugeCollate, Misbehave, OddSample
from support.outcomes import exc_text, last_line, outcomes, shape_of, worker_no
from support.processes import wait_pids_gone


# ---------------------------------------------------------------------------
# helpers


def run(loader: Any, max_steps: int = 50) -> List[tuple]:
    """One epoch like a training loop that survives errors:
    ``("ok", batch)`` or ``("err", type, str(exc), text with notes)`` per
    ``next()`` (``support.outcomes.outcomes``)."""
    return outcomes(loader, max_steps, describe=exc_text)


def dl_run(loader: DataLoader, max_steps: int = 50) -> List[tuple]:
    """``run()`` for a DataLoader, which forks its workers from this process.

    Its forked workers inherit whatever fastload objects this process holds
    (batches left in reference cycles included) and may collect them: that
    must not touch this process's ring (see
    test_forked_child_collecting_garbage_leaves_the_ring_alone), so no
    gc.collect() is done first on purpose.
    """
    return run(loader, max_steps)


def assert_worker_error_like_dataloader(fl: tuple, dl: tuple, indices: str) -> None:
    """A re-raised worker exception: DataLoader's type, wording, worker and
    original exception; fastload adds the batch's sample indices."""
    assert fl[0] == dl[0] == "err", (fl, dl)
    _, fl_type, fl_msg, _ = fl
    _, dl_type, dl_msg, _ = dl
    assert fl_type is dl_type
    assert fl_msg.startswith(f"Caught {dl_type.__name__} in DataLoader worker process "), fl_msg
    assert worker_no(fl_msg) == worker_no(dl_msg)
    assert "Original Traceback (most recent call last):" in fl_msg
    assert last_line(fl_msg) == last_line(dl_msg)
    assert f"sample indices {indices}" in fl_msg.splitlines()[0], fl_msg.splitlines()[0]


def iter_error(loader: Any) -> tuple:
    """(exception type, text with notes) of ``iter(loader)``, or (None, ...)
    when it started. Keeps no reference to the loader or the exception, so a
    failing assertion afterwards does not keep workers alive into teardown."""
    try:
        it = iter(loader)
    except Exception as e:  # noqa: BLE001 - recorded for comparison
        out = (type(e), exc_text(e))
        del e
        return out
    del it
    return None, "no error: iter() started the workers"


def all_ok(results: List[tuple]) -> List[Any]:
    assert all(r[0] == "ok" for r in results), results
    return [r[1] for r in results]


# ---------------------------------------------------------------------------
# 1. samples of inconsistent shapes, default collate


def test_inconsistent_shapes_stack_error_like_dataloader():
    ds = Misbehave(8, {5: "ragged"}, width=3)
    dl = dl_run(DataLoader(ds, batch_size=2, num_workers=NW))
    loader = FastLoader(ds, batch_size=2, num_workers=NW)
    fl = run(loader)
    assert shape_of(dl) == [[[0] * 3, [1] * 3], [[2] * 3, [3] * 3], RuntimeError,
                            [[6] * 3, [7] * 3]]
    assert shape_of(fl) == shape_of(dl)
    assert_worker_error_like_dataloader(fl[2], dl[2], "[4, 5]")
    assert "stack expects each tensor to be equal size, but got [3] at entry 0 and [4] at entry 1" \
        in last_line(fl[2][2])
    # the cause gone: a new epoch of the same loader is whole
    ds.on = {}
    assert all_ok(run(loader)) == [[[i] * 3, [i + 1] * 3] for i in range(0, 8, 2)]


# ---------------------------------------------------------------------------
# 2. unpicklable objects in a sample (a lock and a generator: test_errors)


@pytest.mark.heavy
def test_unpicklable_samples_of_other_kinds():
    """A lambda (pickle raises AttributeError), an object whose __reduce__
    raises ValueError, and one that pickles but cannot be rebuilt in the main
    process. DataLoader hangs on the first two (its queue's feeder thread
    drops the batch); fastload names the batch and goes on."""
    ds = OddSample(10, {1: "lambda", 3: "nodump", 5: "noload"})
    loader = FastLoader(ds, batch_size=2, num_workers=NW, collate_fn=keep_collate)
    t0 = time.monotonic()
    fl = run(loader)
    assert time.monotonic() - t0 < HANG_S + 5  # includes worker start-up
    assert [r[0] for r in fl] == ["err", "err", "err", "ok", "ok"], fl
    for k, typ, what in [(0, AttributeError, "Can't pickle local object"),
                         (1, ValueError, "NoDump(3) refuses to be pickled")]:
        _, got_type, msg, _ = fl[k]
        assert got_type is typ
        assert msg.startswith(f"Caught {typ.__name__} in DataLoader worker process {k} ")
        assert f"sample indices [{2 * k}, {2 * k + 1}]" in msg.splitlines()[0]
        assert "to the main process" in msg.splitlines()[0]
        assert what in msg
    assert fl[2][1] is ValueError and "NoLoad(5) cannot be rebuilt" in fl[2][2]
    assert [r[1]["t"].tolist() for r in fl[3:]] == [[6, 7], [8, 9]]
    # the cause gone: a new epoch is whole
    ds.kinds = {}
    assert [b["t"].tolist() for b in all_ok(run(loader))] == [[i, i + 1] for i in range(0, 10, 2)]


def test_sample_that_cannot_be_rebuilt_in_main_like_dataloader_and_named():
    """The batch pickles in the worker but unpickling it in the main process
    raises. DataLoader raises that exception as it is (and then loses the
    batch); fastload raises the same, and should say which batch it was."""
    ds = OddSample(10, {5: "noload"})
    it = iter(DataLoader(ds, batch_size=2, num_workers=NW, collate_fn=keep_collate))
    with pytest.raises(Exception) as dl_info:
        for _ in range(5):
            next(it)
    dl_type, dl_msg = dl_info.type, str(dl_info.value)
    del it, dl_info
    fl = run(FastLoader(ds, batch_size=2, num_workers=NW, collate_fn=keep_collate))
    assert [r[0] for r in fl] == ["ok", "ok", "err", "ok", "ok"]
    _, fl_type, fl_msg, fl_text = fl[2]
    assert fl_type is dl_type is ValueError
    assert dl_msg in fl_msg
    # bad input gets an error naming the sample index: here nothing says
    # which batch could not be rebuilt (a note would keep DataLoader's message)
    assert "[4, 5]" in fl_text, fl_text


# ---------------------------------------------------------------------------
# 3. a dataset that cannot be pickled for the workers (lock, socket: test_errors)


def _holds(kind: str, tmp_path: Any) -> Holds:
    return Holds(8, "file" if kind == "write_file" else kind, path=str(tmp_path / "log.txt"))


# (A file opened only for reading is opened again in each worker instead:
# tests/test_references.py.)
UNPICKLABLE = ["lock", "generator", "write_file"]


@pytest.mark.parametrize("kind", UNPICKLABLE)
def test_unpicklable_dataset_same_error_as_spawn_dataloader(kind, tmp_path):
    """DataLoader has to pickle the dataset under spawn (with fork it need not):
    its error is the reference."""
    ds = _holds(kind, tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DataLoader's "Got pickle error ..." hint
            with pytest.raises(Exception) as dl_info:
                iter(DataLoader(ds, batch_size=2, num_workers=NW,
                                multiprocessing_context="spawn"))
        dl_type, dl_msg = dl_info.type, str(dl_info.value)
        del dl_info
        loader = FastLoader(ds, batch_size=2, num_workers=NW)
        t0 = time.monotonic()
        fl_type, fl_text = iter_error(loader)
        del loader
        assert time.monotonic() - t0 < HANG_S
        assert fl_type is dl_type, fl_text
        assert dl_msg in fl_text
    finally:
        if kind.endswith("file"):
            ds.log_handle.close()


@pytest.mark.parametrize("kind", UNPICKLABLE[:3])
def test_unpicklable_dataset_error_names_the_attribute(kind, tmp_path):
    """The error should say which attribute of the dataset cannot be sent and
    what to do about it."""
    ds = _holds(kind, tmp_path)
    try:
        fl_type, text = iter_error(FastLoader(ds, batch_size=2, num_workers=NW))
        assert fl_type is not None, text
        assert "dataset" in text
        assert "worker_init_fn" in text and "__getstate__" in text  # the remedy
        assert ds.attr in text, text  # the attribute: row_lock, row_source, log_handle
    finally:
        if kind == "write_file":
            ds.log_handle.close()


def test_unpicklable_dataset_then_fixed_loader_works(tmp_path):
    ds = Holds(6, "lock")
    loader = FastLoader(ds, batch_size=2, num_workers=NW)
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        iter(loader)
    ds.drop_cause()
    assert all_ok(run(loader)) == [[0, 1], [2, 3], [4, 5]]


# ---------------------------------------------------------------------------
# 4. sampler indices out of range


def test_sampler_past_the_end_indexerror_like_dataloader():
    ds = ListDataset(10)  # its IndexError says "list index out of range", no index
    sampler = PastTheEnd(10, extra=5)
    dl = dl_run(DataLoader(ds, batch_size=4, num_workers=NW, sampler=sampler))
    loader = FastLoader(ds, batch_size=4, num_workers=NW, sampler=sampler)
    fl = run(loader)
    assert shape_of(dl) == [[0, 1, 2, 3], [4, 5, 6, 7], IndexError, IndexError]
    assert shape_of(fl) == shape_of(dl)
    assert_worker_error_like_dataloader(fl[2], dl[2], "[8, 9, 10, 11]")
    assert_worker_error_like_dataloader(fl[3], dl[3], "[12, 13, 14]")
    assert last_line(fl[2][2]) == "IndexError: list index out of range"
    sampler.extra = 0
    assert all_ok(run(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---------------------------------------------------------------------------
# 5. a __len__ that lies


def test_lying_len_like_dataloader():
    """Says 14 for 10 rows: IndexError at the real end; says 6: six samples;
    then the truth: everything. One loader, three epochs."""
    ds = ListDataset(10, reported=14)
    dl_loader = DataLoader(ds, batch_size=4, num_workers=NW)
    fl_loader = FastLoader(ds, batch_size=4, num_workers=NW)
    dl, fl = dl_run(dl_loader), run(fl_loader)
    assert shape_of(dl) == [[0, 1, 2, 3], [4, 5, 6, 7], IndexError, IndexError]
    assert shape_of(fl) == shape_of(dl)
    assert_worker_error_like_dataloader(fl[2], dl[2], "[8, 9, 10, 11]")
    assert_worker_error_like_dataloader(fl[3], dl[3], "[12, 13]")
    ds.reported = 6
    assert len(fl_loader) == len(dl_loader) == 2
    assert all_ok(run(fl_loader)) == all_ok(dl_run(dl_loader)) == [[0, 1, 2, 3], [4, 5]]
    ds.reported = 10
    assert all_ok(run(fl_loader)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ---------------------------------------------------------------------------
# 6. empty datasets, batch_size=0 (an empty map-style dataset: test_errors)


@pytest.mark.parametrize("kwargs", [dict(batch_size=0), dict(batch_size=-3),
                                    dict(batch_size=0, drop_last=True)])
def test_bad_batch_size_same_error(kwargs):
    with pytest.raises(Exception) as dl_info:
        DataLoader(Plain(4), num_workers=NW, **kwargs)
    with pytest.raises(Exception) as fl_info:
        FastLoader(Plain(4), num_workers=NW, **kwargs)
    assert fl_info.type is dl_info.type is ValueError
    assert str(fl_info.value) == str(dl_info.value)
    assert f"batch_size={kwargs['batch_size']}" in str(fl_info.value)


def test_empty_dataset_with_shuffle_same_error():
    with pytest.raises(Exception) as dl_info:
        DataLoader(Empty(), batch_size=2, shuffle=True, num_workers=NW)
    with pytest.raises(Exception) as fl_info:
        FastLoader(Empty(), batch_size=2, shuffle=True, num_workers=NW)
    assert fl_info.type is dl_info.type is ValueError
    assert str(fl_info.value) == str(dl_info.value)
    assert "num_samples=0" in str(fl_info.value)


def test_empty_iterable_dataset_with_workers():
    dl = dl_run(DataLoader(EmptyIterable(), batch_size=2, num_workers=NW))
    loader = FastLoader(EmptyIterable(), batch_size=2, num_workers=NW)
    t0 = time.monotonic()
    assert run(loader) == dl == []
    assert run(loader) == []  # and again (a warm pool)
    assert time.monotonic() - t0 < HANG_S + 5


# ---------------------------------------------------------------------------
# 7. memory


def test_absurd_allocation_like_dataloader():
    """A sample (index 5) and a collate_fn (batch with 2) ask torch for 8 PiB."""
    ds = Misbehave(8, {5: "huge"}, width=4)
    collate = HugeCollate(bad=2)
    dl = dl_run(DataLoader(ds, batch_size=2, num_workers=NW, collate_fn=collate))
    loader = FastLoader(ds, batch_size=2, num_workers=NW, collate_fn=collate)
    fl = run(loader)
    rows = [[[i] * 4, [i + 1] * 4] for i in range(0, 8, 2)]
    assert shape_of(dl) == [rows[0], RuntimeError, RuntimeError, rows[3]]
    assert shape_of(fl) == shape_of(dl)
    assert_worker_error_like_dataloader(fl[1], dl[1], "[2, 3]")
    assert_worker_error_like_dataloader(fl[2], dl[2], "[4, 5]")
    assert "can't allocate memory" in fl[2][2]
    ds.on = {}
    collate.bad = -1
    assert all_ok(run(loader)) == rows


def test_big_feasible_sample_arrives_whole():
    """300 MB per batch (a single sample, default collate): larger than the
    default 64 MiB slot, through the overflow segment, every element right."""
    numel = 75_000_000  # int32: 300 MB
    loader = FastLoader(BigSample(2, numel), batch_size=1, num_workers=NW)
    t0 = time.monotonic()
    n = 0
    for i, batch in enumerate(loader):
        assert batch.shape == (1, numel) and batch.dtype == torch.int32
        expected = torch.arange(numel, dtype=torch.int32)
        expected += i
        assert torch.equal(batch[0], expected)
        del batch, expected
        n += 1
    assert n == 2
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------
# 8. a collate_fn returning a tensor on another device (meta stands in for a GPU)


def test_collate_returns_meta_device_tensor_like_dataloader():
    dl = all_ok(dl_run(DataLoader(Plain(6), batch_size=2, num_workers=NW,
                                  collate_fn=meta_collate)))
    fl = all_ok(run(FastLoader(Plain(6), batch_size=2, num_workers=NW,
                               collate_fn=meta_collate)))
    assert len(fl) == len(dl) == 3
    for f, d in zip(fl, dl):
        assert torch.equal(f["x"], d["x"])
        for t in (f["on_device"], d["on_device"]):
            assert t.device.type == "meta"
            assert t.shape == (2, 3) and t.dtype == torch.float32


# ---------------------------------------------------------------------------
# 9. non-contiguous and strided results


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.requires_grad)


def test_strided_views_from_collate_like_dataloader():
    """Transposed, stepped, expanded (stride 0), overlapping as_strided,
    channels_last: same values and same strides as DataLoader's. A small
    view of a big fresh tensor arrives compacted (contiguous) on purpose
    (transport.writer.SlotWriter._describe): same values, DataLoader's strides differ."""
    ds = Images(6)
    dl = all_ok(dl_run(DataLoader(ds, batch_size=2, num_workers=NW,
                                  collate_fn=strided_collate)))
    fl = all_ok(run(FastLoader(ds, batch_size=2, num_workers=NW,
                               collate_fn=strided_collate)))
    assert len(fl) == len(dl) == 3
    compacted = {"view_in_big"}
    for b, (f, d) in enumerate(zip(fl, dl)):
        assert list(f) == list(d)
        for k in d:
            assert torch.equal(f[k], d[k]), f"batch {b} {k}: values differ"
            if k in compacted:
                assert f[k].shape == d[k].shape and f[k].is_contiguous()
            else:
                assert _layout(f[k]) == _layout(d[k]), f"batch {b} {k}"
        assert f["channels_last"].is_contiguous(memory_format=torch.channels_last)
        assert f["expanded"].stride() == (0, 1)


def test_default_collate_of_channels_last_samples_bigger_than_a_slot():
    """DataLoader's workers stack into a fresh contiguous tensor, whatever the
    samples' memory format. fastload stacks into the slot (contiguous too),
    and when the batch does not fit the slot into a fresh contiguous tensor
    as well (not with out=None, which would keep the samples' channels_last
    strides and make a batch's layout depend on its size)."""
    ds = Images(32, channels_last=True, h=64, w=64)  # 32 x 48 KiB > 1 MiB slot
    dl = list(DataLoader(ds, batch_size=32, num_workers=NW))
    fl = list(FastLoader(ds, batch_size=32, num_workers=NW, slot_bytes=1 << 20))
    assert len(fl) == len(dl) == 1
    same_values = torch.equal(fl[0], dl[0])
    (fl_stride, fl_contig), (dl_stride, dl_contig) = [(b[0].stride(), b[0].is_contiguous())
                                                       for b in (fl, dl)]
    del fl, dl  # a failure must not keep the batches' memory open into teardown
    assert same_values
    assert dl_contig
    assert (fl_stride, fl_contig) == (dl_stride, dl_contig)


# ---------------------------------------------------------------------------
# 10. workers that write a lot to stdout / stderr


def test_chatty_workers(tmp_path):
    """2 MB to stdout and to stderr per sample (4 MB per batch and stream):
    no hang, every batch right, all of the output written.

    The workers' stdout and stderr are files opened with O_APPEND (as
    ``>> log`` would), so that every write lands at the end whichever
    process makes it; pytest's capture file is not, and two writers can
    overwrite each other in it."""
    paths = [tmp_path / "out.log", tmp_path / "err.log"]
    saved = [os.dup(1), os.dup(2)]
    try:
        for fd, path in zip((1, 2), paths):
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(log, fd)
            os.close(log)
        loader = FastLoader(Chatty(8, 2 << 20), batch_size=2, num_workers=NW)
        t0 = time.monotonic()
        got = [b[:, 0].tolist() for b in loader]
        took = time.monotonic() - t0
        del loader  # workers gone before the files are read
    finally:
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
    assert got == [[i, i + 1] for i in range(0, 8, 2)]
    assert took < HANG_S + 5
    out, err = (p.read_text() for p in paths)
    for i in range(8):
        assert f"chatty-print-{i}\n" in out
        assert f"chatty-stderr-{i}\n" in err
    assert len(out) > 8 * (2 << 20) * 0.99 and len(err) > 8 * (2 << 20) * 0.99


# ---------------------------------------------------------------------------
# 11. a worker that calls os._exit(0) (exit codes 3 and sys.exit(0): test_errors)


@pytest.mark.heavy
def test_worker_os_exit_0():
    ds = Misbehave(12, {4: "exit"}, code=0)
    loader = FastLoader(ds, batch_size=2, num_workers=NW)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    got = [next(it).tolist()]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        while True:  # worker 1's batch 1 comes first if it was made before the death was seen
            got.append(next(it).tolist())
    took = time.monotonic() - t0
    assert got in ([[0, 1]], [[0, 1], [2, 3]])
    msg = str(info.value)
    del info
    assert took < 2.0, f"{took:.1f}s to notice a worker that exited"
    assert re.search(rf"^DataLoader worker \(pid {pids[0]}\) exited unexpectedly with exit code 0\. ",
                     msg), msg
    assert "batch(es) 2" in msg and "[4, 5]" in msg
    # the iterator shut its pool down; next() fails again at once
    assert debug_view(it).shut_down
    assert wait_pids_gone(pids, timeout=5) == []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly with exit code 0"):
        next(it)
    assert time.monotonic() - t0 < 1.0
    del it
    # the cause gone, a new epoch of the same loader (new workers) is whole
    ds.on = {}
    assert all_ok(run(loader)) == [[i, i + 1] for i in range(0, 12, 2)]


# ---------------------------------------------------------------------------
# found on the way: a forked child collecting fastload garbage

_FORK_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    sys.path.insert(0, {tests!r})
    from fastload import FastLoader
    from support.datasets import Plain

    if __name__ == "__main__":
        gc.disable()  # make the timing of collection deterministic
        loader = FastLoader(Plain(12), batch_size=2, num_workers=2)
        it = iter(loader)
        batch = next(it)
        # A batch only reachable from a reference cycle, as after an except
        # clause (a worker error re-raised by torch's ExceptionWrapper.reraise
        # leaves one holding the loop's frame and its last batch).
        junk = [batch]
        junk.append(junk)
        del batch, junk
        pid = os.fork()  # e.g. a DataLoader worker (fork is its default)
        if pid == 0:
            gc.collect()  # the batch's lease
            del it, loader  # the iterator, its pool (ring, workers), the loader's zygote
            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        gc.collect()
        print("PARENT SURVIVED", flush=True)
        print("REST", [b.tolist() for b in it], flush=True)
        print("AGAIN", [b.tolist() for b in loader], flush=True)
    """
)


@pytest.mark.heavy
def test_forked_child_collecting_garbage_leaves_the_ring_alone(tmp_path):
    """A child forked from the training process (DataLoader's default workers,
    multiprocessing fork) inherits fastload's objects and may collect them.
    A lease, iterator, pool or zygote is only acted on by the process that
    made it: before that fix, the child's collection released the *parent's*
    slot in the shared ring, the parent's own release then found the slot
    FREE, threw std::logic_error from a destructor and the process aborted."""
    script = tmp_path / "fork_gc.py"
    script.write_text(_FORK_SCRIPT.format(tests=TESTS_DIR))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PARENT SURVIVED" in proc.stdout
    assert "REST [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]" in proc.stdout
    assert "AGAIN [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]" in proc.stdout
