"""The default start method: workers forked from a per-pool zygote (DESIGN decision 2)."""

from __future__ import annotations

import gc
import logging
import os
import signal

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

import faulty_datasets as fd
from fastload import FastLoader

NW = 2


def _rows(batches):
    return [{k: (v[j].item() if isinstance(v, torch.Tensor) else v[j]) for k, v in b.items()}
            for b in batches for j in range(len(b["index"]))]


def test_default_workers_are_forked_from_the_pool_zygote(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    loader = FastLoader(fd.EnvProbe(8), batch_size=2, num_workers=NW)
    it = iter(loader)
    pool = it._pool
    zygote_pid = pool._zygote.pid
    assert zygote_pid is not None and zygote_pid != os.getpid()
    zygote = psutil.Process(zygote_pid)
    assert zygote.ppid() == os.getpid()
    assert "fastload zygote" in " ".join(zygote.cmdline())
    # Started with accelerators hidden; this process's environment untouched.
    assert zygote.environ()["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    for pid in pool.pids:
        assert psutil.Process(pid).ppid() == zygote_pid
    rows = _rows(list(it))
    want = _rows(DataLoader(fd.EnvProbe(8), batch_size=2, num_workers=NW))
    keys = ("index", "worker_id", "num_workers", "has_info", "threads")
    assert [tuple(r[k] for k in keys) for r in rows] == [tuple(r[k] for k in keys) for r in want]
    assert all(r[v] == "" for r in rows for v in fd.ACCEL_VARS)
    # The warm pool keeps its zygote; both end with the loader.
    pids = pool.pids
    del it, pool
    assert fd.pid_alive(zygote_pid)
    del loader
    gc.collect()
    assert fd.wait_pids_gone([zygote_pid, *pids], timeout=10) == []


def test_explicit_spawn_is_real_spawn():
    loader = FastLoader(fd.EnvProbe(4), batch_size=2, num_workers=NW,
                        multiprocessing_context="spawn")
    it = iter(loader)
    assert it._pool._zygote is None
    for pid in it._pool.pids:
        assert psutil.Process(pid).ppid() == os.getpid()
    assert [r["index"] for r in _rows(list(it))] == list(range(4))


def test_allow_gpu_in_workers_zygote_keeps_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    loader = FastLoader(fd.EnvProbe(4), batch_size=2, num_workers=NW, allow_gpu_in_workers=True)
    it = iter(loader)
    assert psutil.Process(it._pool._zygote.pid).environ()["CUDA_VISIBLE_DEVICES"] == "0"
    assert {r["CUDA_VISIBLE_DEVICES"] for r in _rows(list(it))} == {"0"}


def test_zygote_killed_is_an_error_not_a_hang():
    # The zygote is only needed to start workers: losing it mid-epoch does
    # not stop the epoch; a restart that needs it gets a clear error.
    loader = FastLoader(fd.Plain(40, delay=0.02), batch_size=2, num_workers=NW,
                        max_worker_restarts=1)
    it = iter(loader)
    first = next(it)
    os.kill(it._pool._zygote.pid, signal.SIGKILL)
    rest = list(it)
    assert [b.tolist() for b in [first] + rest] == [b.tolist() for b in
                                                    DataLoader(fd.Plain(40), batch_size=2)]


def test_worker_dies_after_its_zygote():
    # With the zygote gone, a worker's exit status is lost but its death is
    # still seen (through its pidfd); a restart starts a new zygote.
    ds = fd.Plain(60, delay=0.02)
    want = [b.tolist() for b in DataLoader(ds, batch_size=2)]
    loader = FastLoader(ds, batch_size=2, num_workers=NW, max_worker_restarts=1)
    it = iter(loader)
    got = [next(it).tolist()]
    old_zygote = it._pool._zygote.pid
    os.kill(old_zygote, signal.SIGKILL)
    got.append(next(it).tolist())
    victim = it._pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    got += [b.tolist() for b in it]
    assert got == want
    new_zygote = loader._idle_pool._zygote.pid
    assert new_zygote not in (None, old_zygote)
    assert victim not in loader._idle_pool.pids

    loader = FastLoader(ds, batch_size=2, num_workers=NW)  # no restarts: the error
    it = iter(loader)
    next(it)
    os.kill(it._pool._zygote.pid, signal.SIGKILL)
    victim = it._pool.pids[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {victim}\) exited "
                                           r"unexpectedly with exit code 255"):
        for _ in it:
            pass


def test_zygote_starts_with_the_loader_and_ends_with_it_unused():
    loader = FastLoader(fd.Plain(8), batch_size=2, num_workers=NW)
    (zygote,) = loader._spare_zygote
    assert zygote.pid is not None and fd.pid_alive(zygote.pid)
    pid = zygote.pid
    del loader, zygote
    assert fd.wait_pids_gone([pid], timeout=10) == []  # never iterated: stopped with the loader


def test_prestarted_zygote_is_the_first_pool_s():
    loader = FastLoader(fd.Plain(8), batch_size=2, num_workers=NW)
    pid = loader._spare_zygote[0].pid
    it = iter(loader)
    assert it._pool._zygote.pid == pid and loader._spare_zygote == []
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # No zygote for explicit start methods or num_workers=0.
    assert FastLoader(fd.Plain(8), num_workers=NW, multiprocessing_context="spawn")._spare_zygote == []
    assert FastLoader(fd.Plain(8))._spare_zygote == []


@pytest.mark.parametrize("ctx", [None, "spawn", "forkserver", "fork"])
def test_every_start_method_stops_promptly_and_quietly(ctx, caplog):
    # Workers see the ring's shutdown and exit on their own (code 0) well
    # within the grace period: none is terminated, nothing is logged.
    loader = FastLoader(fd.Plain(40), batch_size=2, num_workers=NW,
                        multiprocessing_context=ctx, reuse_workers=False)
    it = iter(loader)
    next(it), next(it)  # one batch from each worker: both are up (one still starting is killed)
    procs = list(it._pool.procs)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        it._shutdown_workers()
    assert [r.getMessage() for r in caplog.records] == []
    assert [p.exitcode for p in procs] == [0] * NW
