"""Errors raised in, or by the death of, real worker processes.

Every test here starts real spawn workers (1-2 s each on a small machine),
so related checks share one iterator through module-scoped fixtures where
that does not blur what is being tested. Wall-clock bounds are generous and
exist only to turn a hang into a failure.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from torch.utils.data import DataLoader, Sampler

from fastload import FastLoader
from fastload.debug import debug_view
from support import HANG_S, KILLED_RE, NW
from support.datasets import Empty, Plain
from support.faults import Holds, LockInBatch, Misbehave, RaisingCollate, failing_worker_init
from support.outcomes import exc_text, outcomes, shape_of, worker_no
from support.processes import children, wait_no_children, wait_pids_gone


def _assert_shut_down(it, pids) -> None:
    """The iterator has stopped its pool: no worker runs, next() does not hang."""
    assert debug_view(it).shut_down
    assert wait_pids_gone(pids, timeout=5) == []
    t0 = time.monotonic()
    # What a dead iterator raises is not DataLoader's business (it keeps going
    # with the survivors); it must only neither hang nor hand out data.
    with pytest.raises((StopIteration, RuntimeError, AssertionError)):
        next(it)
    assert time.monotonic() - t0 < HANG_S


# ---------------------------------------------------------------------------
# exceptions raised by the dataset

MIXED_ERRORS = {3: "raise-value", 6: "raise-key", 11: "raise-weird"}


@pytest.fixture(scope="module")
def mixed_results():
    """outcomes() of DataLoader and FastLoader over a dataset raising three kinds of error.

    The FastLoader keeps its workers for a second epoch (same results expected).
    """
    ds = Misbehave(16, MIXED_ERRORS)
    dl = outcomes(DataLoader(ds, batch_size=2, num_workers=NW))
    loader = FastLoader(ds, batch_size=2, num_workers=NW, persistent_workers=True)
    fl = outcomes(loader)
    fl2 = outcomes(loader)
    loader._iterator._shutdown_workers()  # DataLoader's persistent iterator, and its own method
    del loader
    assert wait_no_children() == []
    return dl, fl, fl2


def _errors(results):
    return {i: r for i, r in enumerate(results) if r[0] == "err"}


def test_dataset_errors_resume_like_dataloader(mixed_results):
    dl, fl, _ = mixed_results
    # 8 batches; batches 1, 3 and 5 raise; every other batch still arrives, in order.
    assert shape_of(dl) == [
        [0, 1], ValueError, [4, 5], KeyError, [8, 9], RuntimeError, [12, 13], [14, 15]
    ]
    assert shape_of(fl) == shape_of(dl)


def test_dataset_errors_second_epoch_of_persistent_workers(mixed_results):
    _, fl, fl2 = mixed_results
    assert shape_of(fl2) == shape_of(fl)
    for (_, t1, m1, _), (_, t2, m2, _) in zip(_errors(fl).values(), _errors(fl2).values()):
        assert t1 is t2
        assert worker_no(m1) == worker_no(m2)


def test_dataset_error_message(mixed_results):
    dl, fl, _ = mixed_results
    _, typ, msg, _ = fl[1]
    assert typ is ValueError
    assert msg.startswith("Caught ValueError in DataLoader worker process ")
    assert worker_no(msg) == worker_no(dl[1][2])
    assert "bad sample 3" in msg
    # the worker's traceback, down to the line that raised
    assert "Original Traceback (most recent call last):" in msg
    assert "support/faults.py" in msg and "in __getitem__" in msg
    assert "raise make_error(kind, i)" in msg
    # the samples that made the batch
    assert "[2, 3]" in msg


def test_keyerror_message_like_dataloader(mixed_results):
    # DataLoader wraps KeyError's message in KeyErrorMessage so that str()
    # shows the traceback instead of a repr() of it.
    dl, fl, _ = mixed_results
    _, typ, msg, arg_types = fl[3]
    _, dl_typ, dl_msg, dl_arg_types = dl[3]
    assert typ is dl_typ is KeyError
    assert arg_types == dl_arg_types == ("KeyErrorMessage",)
    assert msg.startswith("Caught KeyError in DataLoader worker process ")
    assert "\n" in msg and "\\n" not in msg  # readable, not repr()'d
    assert "missing key for sample 6" in msg
    assert "[6, 7]" in msg
    assert worker_no(msg) == worker_no(dl_msg)


def test_unconstructible_exception_becomes_runtime_error(mixed_results):
    dl, fl, _ = mixed_results
    _, typ, msg, _ = fl[5]
    assert typ is dl[5][1] is RuntimeError
    assert msg.startswith("Caught Weird in DataLoader worker process ")
    assert "weird failure a='weird-a-11' b=11" in msg
    assert "[10, 11]" in msg


def test_collate_error_resumes_like_dataloader():
    ds = Plain(10)
    collate = RaisingCollate(5)
    dl = outcomes(DataLoader(ds, batch_size=2, num_workers=NW, collate_fn=collate))
    fl = outcomes(FastLoader(ds, batch_size=2, num_workers=NW, collate_fn=collate))
    assert shape_of(dl) == [[0, 1], [2, 3], ValueError, [6, 7], [8, 9]]
    assert shape_of(fl) == shape_of(dl)
    msg = fl[2][2]
    assert msg.startswith("Caught ValueError in DataLoader worker process ")
    assert worker_no(msg) == worker_no(dl[2][2])
    assert "collate refuses batch with 5" in msg
    assert "in __call__" in msg and "support/faults.py" in msg
    assert "[4, 5]" in msg


class _BreakingSampler(Sampler):
    """0, 1, ... n-1, but raises on reaching ``bad`` (in the main process)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self):
        for i in range(self.n):
            if i == self.bad:
                raise ValueError(f"sampler broke at {i}")
            yield i

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_sampler_error_arrives_with_the_same_batch(prefetch_factor):
    """DataLoader draws the next index while handing out a batch, so a
    sampler that raises loses that batch; fastload sends the task later
    (prefetch_factor > 1) but draws the index at the same point."""

    def run(cls):
        got = []
        with pytest.raises(ValueError, match="sampler broke at 7"):
            for b in cls(Plain(10), sampler=_BreakingSampler(10, 7), batch_size=1,
                         num_workers=NW, prefetch_factor=prefetch_factor):
                got.append(b.tolist())
        return got

    dl = run(DataLoader)
    assert dl == [[i] for i in range(7 - NW * prefetch_factor)]
    assert run(FastLoader) == dl


def test_worker_init_fn_error_on_first_batch():
    ds = Plain(8)
    dl = outcomes(DataLoader(ds, batch_size=2, num_workers=NW,
                                worker_init_fn=failing_worker_init))
    fl = outcomes(FastLoader(ds, batch_size=2, num_workers=NW,
                                worker_init_fn=failing_worker_init))
    # DataLoader: every batch fails, the first one per worker with the
    # init_fn's error (later ones with a torch quirk), then StopIteration.
    assert len(fl) == len(dl) == 4
    assert all(r[0] == "err" for r in dl + fl)
    for k in range(NW):  # the first batch of each worker
        assert fl[k][1] is dl[k][1] is RuntimeError
        assert fl[k][2].startswith(f"Caught RuntimeError in DataLoader worker process {k}")
        assert f"worker_init_fn failed in worker {k}" in fl[k][2]
        assert "failing_worker_init" in fl[k][2]
    for r in fl[NW:]:
        assert r[1] is RuntimeError and "worker_init_fn failed" in r[2]


def test_error_names_batch_of_the_epoch_in_later_epochs(mixed_results):
    # fastload adds "(batch N, sample indices [...])" to a worker's error; N
    # should be the batch's position in the epoch, as in its worker-death
    # message ("It was making batch(es) N of this epoch").
    _, fl, fl2 = mixed_results

    def batch_named(msg):
        m = re.search(r"\(batch (\d+)\b[^)]*sample indices \[2, 3\]\)", msg.splitlines()[0])
        return None if m is None else int(m.group(1))

    if batch_named(fl[1][2]) != 1:  # pytest.fail: not the expected failure
        pytest.fail(fl[1][2])
    head = fl2[1][2].splitlines()[0]
    assert batch_named(head) == 1, head


# ---------------------------------------------------------------------------
# workers that die


def _run_until_error(it, limit: int = 64):
    """next() until an exception; returns (batches before it, the exception, seconds)."""
    got = []
    t0 = time.monotonic()
    for _ in range(limit):
        try:
            b = next(it)
        except Exception as e:  # noqa: BLE001
            return got, e, time.monotonic() - t0
        got.append(b.tolist())
    raise AssertionError(f"no error after {limit} batches: {got}")


def _is_prefix(got, full):
    return got == full[: len(got)]


def test_worker_sigkills_itself():
    loader = FastLoader(Misbehave(16, {4: "kill"}), batch_size=2, num_workers=NW)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    got, err, took = _run_until_error(it)
    # index 4 is in batch 2, which worker 0 makes; nothing after it arrives.
    assert _is_prefix(got, [[0, 1], [2, 3]]), got
    assert isinstance(err, RuntimeError)
    m = re.search(KILLED_RE, str(err))
    assert m, str(err)
    assert int(m.group(1)) == pids[0]
    assert "[4, 5]" in str(err)
    assert took < HANG_S + 5  # includes worker start-up
    _assert_shut_down(it, pids)
    del err, it


def test_worker_sigkilled_by_main_process():
    loader = FastLoader(Plain(64, delay=0.05), batch_size=2, num_workers=NW)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    assert next(it).tolist() == [0, 1]
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    got, err, _ = _run_until_error(it)
    took = time.monotonic() - t0
    full = [[i, i + 1] for i in range(2, 64, 2)]
    assert _is_prefix(got, full), got
    assert isinstance(err, RuntimeError)
    m = re.search(KILLED_RE, str(err))
    assert m, str(err)
    assert int(m.group(1)) == pids[0]
    assert took < HANG_S, f"took {took:.1f}s to notice a SIGKILLed worker"
    _assert_shut_down(it, pids)
    del err, it


EXITS = {
    "os._exit(3)": (Misbehave(16, {4: "exit"}, code=3), 3),
    # SystemExit is not an Exception: the worker's loop does not catch it.
    "sys.exit(0)": (Misbehave(16, {4: "sys-exit"}, code=0), 0),
}


@pytest.fixture(scope="module", params=list(EXITS))
def worker_exit(request):
    """A worker leaves on its own on index 4: (pids, batches before, error text, seconds)."""
    dataset, code = EXITS[request.param]
    loader = FastLoader(dataset, batch_size=2, num_workers=NW)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    got, err, took = _run_until_error(it)
    assert isinstance(err, RuntimeError), repr(err)
    text = str(err)
    del err
    _assert_shut_down(it, pids)
    del it, loader
    assert wait_no_children() == []
    return code, pids, got, text, took


def test_worker_exits(worker_exit):
    code, pids, got, text, took = worker_exit
    assert _is_prefix(got, [[0, 1], [2, 3]]), got
    assert re.search(
        rf"DataLoader worker \(pid {pids[0]}\) exited unexpectedly with exit code {code}\. ", text
    ), text
    assert "[4, 5]" in text
    assert took < HANG_S + 5  # includes worker start-up


def test_worker_exit_message_is_readable(worker_exit):
    _code, _pids, _got, text, _took = worker_exit
    assert "trace.It was" not in text, text
    assert "error trace. It was making batch(es) 2" in text, text


# ---------------------------------------------------------------------------
# timeout


def _wait_workers_started(it, timeout: float = 30.0) -> None:
    """Until every worker has reached its loop (spawn start-up is not what we time)."""
    deadline = time.monotonic() + timeout
    view = debug_view(it)
    while not all(view.ring.worker_pid(w) > 0 for w in range(view.num_workers)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.02)


@pytest.mark.heavy
def test_timeout():
    loader = FastLoader(Misbehave(8, {4: "sleep"}, seconds=5), batch_size=2, num_workers=NW,
                        timeout=1)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    _wait_workers_started(it)
    got = [next(it).tolist(), next(it).tolist()]
    assert got == [[0, 1], [2, 3]]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 1 seconds$"):
        next(it)
    took = time.monotonic() - t0
    _assert_shut_down(it, pids)
    # DataLoader raises as soon as the time is up; so does fastload, which
    # stops the stuck workers without first giving them time to see a stop.
    dl = iter(DataLoader(Misbehave(8, {4: "sleep"}, seconds=2), batch_size=2, num_workers=NW,
                         timeout=1))
    assert [next(dl).tolist(), next(dl).tolist()] == got
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 1 seconds$"):
        next(dl)
    dl_took = time.monotonic() - t0
    del dl
    assert 0.9 <= took < dl_took + 1.0, (took, dl_took)


# ---------------------------------------------------------------------------
# what cannot be pickled


def test_unpicklable_batch():
    # A batch holding a lock (made by the collate_fn), then one holding a
    # generator (a sample). DataLoader hangs on these (its queue's feeder
    # thread drops the batch); fastload names the batch and goes on.
    loader = FastLoader(Misbehave(10, {5: "generator"}), batch_size=2, num_workers=NW,
                        collate_fn=LockInBatch(3))
    results = outcomes(loader)
    assert [r[0] for r in results] == ["ok", "err", "err", "ok", "ok"]
    for k, what, worker in [(1, "_thread.lock", 1), (2, "generator", 0)]:
        _, typ, msg, _ = results[k]
        assert typ is TypeError
        assert msg.startswith(f"Caught TypeError in DataLoader worker process {worker} ")
        assert f"cannot pickle '{what}' object" in msg
        assert f"[{2 * k}, {2 * k + 1}]" in msg
        assert "to the main process" in msg
    data = [[int(x) for x in results[k][1]["data"]] for k in (0, 3, 4)]
    assert data == [[0, 1], [6, 7], [8, 9]]
    assert all(set(results[k][1]) == {"data"} for k in (0, 3, 4))


def test_unpicklable_dataset_fails_at_iter():
    ds = Holds(8, "lock")
    loader = FastLoader(ds, batch_size=2, num_workers=NW)
    t0 = time.monotonic()
    with pytest.raises(TypeError) as info:
        iter(loader)
    assert time.monotonic() - t0 < HANG_S
    text = exc_text(info.value)
    assert "cannot pickle" in text
    assert "dataset" in text
    assert "lock" in text
    # no worker was started (only the fork server the loader started ahead,
    # which ends with the last loader, and a zygote forked from it at most)
    server = debug_view(loader).fork_server_pid
    assert server is not None
    assert all(c.pid == server or c.ppid() == server for c in children())


def test_socket_in_dataset_is_shared_as_dataloader_shares_it():
    # multiprocessing's reducers pass a socket's fd to the worker (what
    # DataLoader's spawned workers get too; forked ones inherit it).
    ds = Holds(8, "socket")
    try:
        got = [b.tolist() for b in FastLoader(ds, batch_size=2, num_workers=NW)]
        assert got == [b.tolist() for b in DataLoader(ds, batch_size=2, num_workers=NW)]
    finally:
        ds.drop_cause()


# ---------------------------------------------------------------------------
# empty dataset


def test_empty_dataset():
    dl = DataLoader(Empty(), batch_size=2, num_workers=NW)
    fl = FastLoader(Empty(), batch_size=2, num_workers=NW)
    assert len(fl) == len(dl) == 0
    for loader in (dl, fl):
        it = iter(loader)
        t0 = time.monotonic()
        with pytest.raises(StopIteration):
            next(it)
        assert time.monotonic() - t0 < HANG_S
        del it
    assert list(dl) == []


def test_add_note_without_python_support():
    """On Python 3.10 (no BaseException.add_note) notes still land in
    ``__notes__``, as PEP 678 and its backports read them."""
    from fastload.common.errors import add_note

    class NoAddNote(Exception):
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    e = NoAddNote("x")
    add_note(e, "first")
    add_note(e, "second")
    assert e.__notes__ == ["first", "second"]
    plain = ValueError("y")
    add_note(plain, "note")
    assert plain.__notes__ == ["note"]
