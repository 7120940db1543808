"""The default start method: workers forked from a per-pool zygote
(docs/design.md, "Starting workers")."""

from __future__ import annotations

import gc
import logging
import os
import signal
import time

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

import fastload
from fastload import FastLoader
from fastload.debug import debug_view
from fastload.launching.fork_server import fork_servers_held
from fastload.iterator.loader_runtime import loader_modules
from support import NW
from support.datasets import ACCEL_VARS, EnvProbe, Plain
from support.faults import Misbehave, UnpicklesWith
from support.processes import children, pid_alive, wait_pids_gone


def _rows(batches):
    return [{k: (v[j].item() if isinstance(v, torch.Tensor) else v[j]) for k, v in b.items()}
            for b in batches for j in range(len(b["index"]))]


@pytest.mark.heavy
def test_default_workers_are_forked_from_the_pool_zygote(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    loader = FastLoader(EnvProbe(8), batch_size=2, num_workers=NW)
    it = iter(loader)
    pool = debug_view(it).pool
    zygote_pid = pool.zygote_pid
    assert zygote_pid is not None and zygote_pid != os.getpid()
    zygote = psutil.Process(zygote_pid)
    # Forked from the training process's fork server, a child of this process.
    server = debug_view(loader).fork_server_pid
    assert zygote.ppid() == server and psutil.Process(server).ppid() == os.getpid()
    assert "fastload zygote" in " ".join(zygote.cmdline())
    # Started with accelerators hidden; this process's environment untouched.
    assert zygote.environ()["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    for pid in pool.pids:
        assert psutil.Process(pid).ppid() == zygote_pid
    rows = _rows(list(it))
    want = _rows(DataLoader(EnvProbe(8), batch_size=2, num_workers=NW))
    keys = ("index", "worker_id", "num_workers", "has_info", "threads")
    assert [tuple(r[k] for k in keys) for r in rows] == [tuple(r[k] for k in keys) for r in want]
    assert all(r[v] == "" for r in rows for v in ACCEL_VARS)
    # The warm pool keeps its zygote; both end with the loader. The fork
    # server runs on, for the process's next loader.
    pids = pool.pids
    del it, pool
    assert pid_alive(zygote_pid)
    del loader
    gc.collect()
    assert wait_pids_gone([zygote_pid, *pids], timeout=10) == []
    assert pid_alive(server)


@pytest.mark.heavy
def test_explicit_spawn_is_real_spawn():
    loader = FastLoader(EnvProbe(4), batch_size=2, num_workers=NW,
                        multiprocessing_context="spawn")
    it = iter(loader)
    pool = debug_view(it).pool
    assert pool.zygote_pid is None
    for pid in pool.pids:
        assert psutil.Process(pid).ppid() == os.getpid()
    assert [r["index"] for r in _rows(list(it))] == list(range(4))


class Comm(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        with open("/proc/self/comm") as f:
            return f.read().strip()


@pytest.mark.parametrize("ctx", [None, "spawn", "fork"])
def test_workers_have_dataloader_s_process_name(ctx):
    """``top`` and ``ps`` show DataLoader's workers as ``pt_data_worker``."""
    want = [b for b in torch.utils.data.DataLoader(Comm(), batch_size=2, num_workers=NW)]
    assert want == [["pt_data_worker"] * 2] * 2
    assert list(FastLoader(Comm(), batch_size=2, num_workers=NW,
                           multiprocessing_context=ctx)) == want


@pytest.mark.parametrize("ctx", [None, "spawn"])
def test_workers_share_our_session_in_a_process_group_of_their_own(ctx):
    """As DataLoader's workers, they stay in the training process's session
    (one scheduler autogroup with it); unlike them, they are outside its
    process group, so a terminal's Ctrl-C reaches the training process alone."""
    it = iter(FastLoader(Plain(4), batch_size=2, num_workers=NW, multiprocessing_context=ctx))
    pool = debug_view(it).pool
    procs = [*pool.pids, *([pool.zygote_pid] if pool.zygote_pid else [])]
    for pid in procs:
        assert os.getsid(pid) == os.getsid(0)
        assert os.getpgid(pid) != os.getpgid(0)
    assert len(list(it)) == 2


def test_allow_gpu_in_workers_zygote_keeps_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    loader = FastLoader(EnvProbe(4), batch_size=2, num_workers=NW, allow_gpu_in_workers=True)
    it = iter(loader)
    assert psutil.Process(debug_view(it).pool.zygote_pid).environ()["CUDA_VISIBLE_DEVICES"] == "0"
    assert {r["CUDA_VISIBLE_DEVICES"] for r in _rows(list(it))} == {"0"}


@pytest.mark.heavy
def test_zygote_killed_is_an_error_not_a_hang():
    # The zygote is only needed to start workers: losing it mid-epoch does
    # not stop the epoch; a restart that needs it gets a clear error.
    loader = FastLoader(Plain(40, delay=0.02), batch_size=2, num_workers=NW,
                        max_worker_restarts=1)
    it = iter(loader)
    first = next(it)
    os.kill(debug_view(it).pool.zygote_pid, signal.SIGKILL)
    rest = list(it)
    assert [b.tolist() for b in [first] + rest] == [b.tolist() for b in
                                                    DataLoader(Plain(40), batch_size=2)]


@pytest.mark.slow
def test_worker_dies_after_its_zygote():
    # With the zygote gone, a worker's exit status is lost but its death is
    # still seen (through its pidfd); a restart starts a new zygote.
    ds = Plain(60, delay=0.02)
    want = [b.tolist() for b in DataLoader(ds, batch_size=2)]
    loader = FastLoader(ds, batch_size=2, num_workers=NW, max_worker_restarts=1)
    it = iter(loader)
    got = [next(it).tolist()]
    old_zygote = debug_view(it).pool.zygote_pid
    os.kill(old_zygote, signal.SIGKILL)
    got.append(next(it).tolist())
    victim = debug_view(it).worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    got += [b.tolist() for b in it]
    assert got == want
    idle = debug_view(loader).idle_pool
    assert idle.zygote_pid not in (None, old_zygote)
    assert victim not in idle.pids

    loader = FastLoader(ds, batch_size=2, num_workers=NW)  # no restarts: the error
    it = iter(loader)
    next(it)
    view = debug_view(it)
    os.kill(view.pool.zygote_pid, signal.SIGKILL)
    victim = view.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {victim}\) exited "
                                           r"unexpectedly with exit code 255"):
        for _ in it:
            pass


def test_the_fork_server_outlives_the_loaders_until_shutdown():
    """A loader made after the last one is gone forks from the same fork
    server (no second torch import); fastload.shutdown() ends it, and the
    next loader starts a new one."""
    first = FastLoader(Plain(8), batch_size=2, num_workers=NW)
    pid = debug_view(first).fork_server_pid
    assert pid is not None and pid_alive(pid)
    assert [b.tolist() for b in first] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    del first
    gc.collect()
    time.sleep(0.2)
    assert pid_alive(pid) and pid in fork_servers_held()[0]
    second = FastLoader(Plain(4), batch_size=2, num_workers=NW)
    assert debug_view(second).fork_server_pid == pid
    assert [b.tolist() for b in second] == [[0, 1], [2, 3]]
    fastload.shutdown()
    assert wait_pids_gone([pid], timeout=10) == [] and fork_servers_held() == ([], [])
    assert [b.tolist() for b in second] == [[0, 1], [2, 3]]  # its warm pool needs no server
    third = FastLoader(Plain(4), batch_size=2, num_workers=NW)
    new = debug_view(third).fork_server_pid
    assert new is not None and new != pid
    assert [b.tolist() for b in third] == [[0, 1], [2, 3]]


def test_every_loader_forks_its_zygote_from_one_fork_server():
    """The fork server imports torch once; each pool's zygote is forked from
    it (its parent), for a first, second and third loader alike, and the
    server runs on when the last loader is gone."""
    first = FastLoader(Plain(8), batch_size=2, num_workers=NW)
    server = debug_view(first).fork_server_pid
    it = iter(first)
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    loaders = [FastLoader(Plain(6), batch_size=3, num_workers=NW) for _ in range(2)]
    zygotes = []
    for loader in loaders:
        assert debug_view(loader).fork_server_pid == server
        it = iter(loader)
        zygote = debug_view(it).pool.zygote_pid
        assert psutil.Process(zygote).ppid() == server
        zygotes.append(zygote)
        assert [b.tolist() for b in it] == [[0, 1, 2], [3, 4, 5]]
    assert len(set(zygotes)) == 2 and server not in zygotes
    # No fork server for explicit start methods or num_workers=0.
    spawn = FastLoader(Plain(8), num_workers=NW, multiprocessing_context="spawn")
    assert debug_view(spawn).fork_server_pid is None
    assert debug_view(FastLoader(Plain(8))).fork_server_pid is None
    del first, loaders, it, loader
    gc.collect()
    assert pid_alive(server)


@pytest.mark.parametrize("ctx", [None, "spawn", "forkserver", "fork"])
@pytest.mark.heavy
def test_every_start_method_stops_promptly_and_quietly(ctx, caplog):
    # Workers see the ring's shutdown and exit on their own (code 0) well
    # within the grace period: none is terminated, nothing is logged.
    loader = FastLoader(Plain(40), batch_size=2, num_workers=NW,
                        multiprocessing_context=ctx, reuse_workers=False)
    it = iter(loader)
    next(it), next(it)  # one batch from each worker: both are up (one still starting is killed)
    procs = debug_view(it).pool.processes
    with caplog.at_level(logging.WARNING, logger="fastload"):
        it._shutdown_workers()
    assert [r.getMessage() for r in caplog.records] == []
    assert [p.exitcode for p in procs] == [0] * NW


# ---------------------------------------------------------------------------
# sessions preloaded by the zygote: workers inherit the dataset


def _inherited_flags(batches):
    """Sample indices in order, and the set of 'unpickled it myself' flags."""
    return [int(i) for b in batches for i in b[:, 0]], {int(u) for b in batches for u in b[:, 1]}


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_inherit_the_session_the_zygote_preloaded(persistent):
    loader = FastLoader(UnpicklesWith(12), batch_size=2, num_workers=NW,
                        persistent_workers=persistent)
    pids = []
    for _epoch in range(2):
        it = iter(loader)
        pool = debug_view(it).pool
        assert pool.preloaded and pool.inherited == (True,) * NW
        pids.append(set(pool.pids))
        assert _inherited_flags(list(it)) == (list(range(12)), {0})  # none unpickled it
        del it
    if persistent:  # one session: the same processes
        assert pids[0] == pids[1]
    else:  # a session per epoch: fresh workers each, forked from the warm pool's zygote
        assert pids[0].isdisjoint(pids[1])
        assert wait_pids_gone(pids[0], timeout=5) == []


@pytest.mark.parametrize("how", ["exhausted", "dropped"])
@pytest.mark.parametrize("cls", [DataLoader, FastLoader])
def test_workers_end_with_their_epoch_as_dataloader_s_do(cls, how):
    # persistent_workers=False: once the epoch is over (the loop ran it out,
    # or broke out and dropped the iterator) its workers are gone; an idle
    # loader (say, the validation one during training) holds none. fastload
    # keeps the zygote the next epoch's workers fork from.
    loader = cls(Plain(40), batch_size=2, num_workers=NW)
    for _epoch in range(2):
        before = {c.pid for c in children()}
        it = iter(loader)
        assert next(it).tolist() == [0, 1]
        workers = {c.pid for c in children()} - before
        if cls is FastLoader:  # the pool's zygote, forked from the fork server at iter()
            workers -= set(debug_view(it).pool.zygote_pids)
        assert len(workers) == NW
        if how == "exhausted":
            assert [b.tolist() for b in it][-1] == [38, 39]
        else:
            del it
        assert wait_pids_gone(workers, timeout=5) == []
    if cls is FastLoader:
        assert all(pid_alive(z) for z in debug_view(loader).idle_pool.zygote_pids)


class PutsToAQueue(torch.utils.data.Dataset):
    """Sample i puts ``per_sample`` copies of i to a multiprocessing Queue
    (made in the spawn context, so it reaches workers forked from a zygote).
    A Queue's put only hands the item to a feeder thread, which writes it to
    the pipe a moment later."""

    def __init__(self, n: int, per_sample: int) -> None:
        import multiprocessing

        self.n, self.per_sample = n, per_sample
        self.queue = multiprocessing.get_context("spawn").Queue()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        for _ in range(self.per_sample):
            self.queue.put(i)
        return i


@pytest.mark.parametrize("cls", [DataLoader, FastLoader])
def test_what_workers_put_to_a_multiprocessing_queue_arrives(cls):
    # A worker ending with its epoch first lets its queues' feeder threads
    # write what they hold, as a multiprocessing.Process (DataLoader's
    # worker) does before it exits. (4,000 ints fit the pipe's buffer, so no
    # write waits for the reader.)
    ds = PutsToAQueue(8, 500)
    loader = cls(ds, batch_size=2, num_workers=NW)
    for _epoch in range(3):
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        got = sorted(ds.queue.get(timeout=10) for _ in range(8 * 500))
        assert got == sorted(list(range(8)) * 500)


def test_the_private_multiprocessing_exit_function_workers_run():
    # fastload.worker.loop runs it as a worker ends (see the test above); it is
    # not public API, so this pins what fastload relies on.
    import inspect
    import multiprocessing.util

    assert callable(multiprocessing.util._exit_function)
    assert "_run_finalizers" in inspect.getsource(multiprocessing.util._exit_function)


def test_a_replacement_worker_inherits_the_session_too(tmp_path):
    ds = Misbehave(20, {7: "kill"}, once=os.fspath(tmp_path / "failed"))
    loader = FastLoader(ds, batch_size=2, num_workers=NW, max_worker_restarts=1)
    it = iter(loader)
    got = [next(it).clone() for _ in range(6)]  # index 7 is in batch 3
    assert (tmp_path / "failed").exists()
    pool = debug_view(it).pool
    assert pool.preloaded and pool.inherited == (True,) * NW
    got += [b.clone() for b in it]
    want = list(DataLoader(Plain(20), batch_size=2))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("how", ["thread", "file"])
def test_a_dataset_that_opens_files_or_starts_threads_is_unpickled_by_each_worker(how, caplog):
    # Shared by fork, a file's offset or a thread's locks would be a trap:
    # each worker gets a copy of its own, as before, and the zygote that
    # runs a thread is not forked from again.
    loader = FastLoader(UnpicklesWith(8, how), batch_size=2, num_workers=NW)
    with caplog.at_level(logging.DEBUG, logger="fastload"):
        for _epoch in range(2):
            it = iter(loader)
            pool = debug_view(it).pool
            assert not pool.preloaded and pool.inherited == (False,) * NW
            assert _inherited_flags(list(it)) == (list(range(8)), {1})
            del it
    why = "started threads" if how == "thread" else "opened"
    assert [r for r in caplog.records if why in r.getMessage()]
    zygotes = debug_view(loader).idle_pool.zygote_pids
    assert len(zygotes) == (2 if how == "thread" else 1)
    assert pid_alive(zygotes[0]) == (how != "thread")


def test_a_dataset_that_cannot_be_unpickled_fails_as_before():
    loader = FastLoader(UnpicklesWith(8, "raise", everywhere=True), batch_size=2,
                        num_workers=NW)
    with pytest.raises(ValueError, match="refuses to be unpickled") as info:
        list(loader)
    assert "while unpickling the dataset" in str(info.value)


def test_a_zygote_stuck_unpickling_is_replaced(caplog):
    # It gets hang_timeout; then workers forked from a new zygote unpickle
    # the dataset themselves (stuck there too, the watchdog would name them).
    loader = FastLoader(UnpicklesWith(8, "sleep", seconds=60), batch_size=2,
                        num_workers=NW, hang_timeout=1.0)
    it = iter(loader)
    zygotes = debug_view(it).pool.zygote_pids
    assert len(zygotes) == 2 and not pid_alive(zygotes[0])
    assert _inherited_flags(list(it)) == (list(range(8)), {1})
    assert [r for r in caplog.records if "did not unpickle the session within" in r.getMessage()]


def test_the_loader_s_modules_are_imported_ahead_by_its_first_zygote(tmp_path, monkeypatch):
    """At construction the loader forks its first pool's zygote from the fork
    server and has it import the module defining the dataset (slow to
    import here), while the script goes on: the pool takes that zygote, and
    neither the session it preloads nor the workers import the module again.
    Once that session is preloaded, the fork server imports the module too."""
    monkeypatch.setenv("FASTLOAD_TEST_IMPORT_MARKS", str(tmp_path))
    import support.heavy_module as heavy  # this process's own import, marked too

    fastload.shutdown()  # a new server: the one running may have the module from an earlier test

    loader = FastLoader(heavy.SlowToImport(8), batch_size=2, num_workers=NW)
    spare = loader._fastload_state.pools.spare_zygote
    assert spare is not None
    deadline = time.monotonic() + 60
    while spare.pid not in heavy.marks(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)  # imported before iter() is called
    assert heavy.marks(str(tmp_path)) == {os.getpid(), spare.pid}
    it = iter(loader)
    view = debug_view(it).pool
    assert view.zygote_pid == spare.pid and view.preloaded
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # The workers inherited it. The session preloaded without harm, so the
    # fork server imports it too, for the zygotes of later pools.
    server = debug_view(loader).fork_server_pid
    deadline = time.monotonic() + 60
    while server not in heavy.marks(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert heavy.marks(str(tmp_path)) == {os.getpid(), spare.pid, server}
    assert loader_modules(heavy.SlowToImport(1), None, print) == ["support.heavy_module"]


def test_a_zygote_tainted_by_importing_the_loader_s_modules_is_replaced(caplog):
    """A module that starts a thread at import makes the zygote that
    imported it unsafe to fork from: the first pool replaces it, and its
    workers unpickle the dataset themselves, as when unpickling the dataset
    starts a thread."""
    from support.thread_at_import import StartsAThread

    loader = FastLoader(StartsAThread(8), batch_size=2, num_workers=NW)
    spare = loader._fastload_state.pools.spare_zygote
    with caplog.at_level(logging.WARNING, logger="fastload"):
        it = iter(loader)
        view = debug_view(it).pool
        assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spare.launched_pid in view.zygote_pids and view.zygote_pid != spare.launched_pid
    assert not view.preloaded
    assert any("importing the loader's modules started threads" in r.getMessage()
               for r in caplog.records)
