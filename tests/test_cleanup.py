"""No worker process, fd or /dev/shm entry outlives the loader, however it ends.

The autouse ``no_leaks`` fixture (conftest.py) checks every test; these
tests also check the worker pids explicitly, including the cases it cannot
see: workers of a subprocess that is interrupted or SIGKILLed. Also: the
other start methods, and the environment workers run in.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from fastload import FastLoader
from fastload.debug import debug_view
from support import HANG_S, KILLED_RE, NW, TESTS_DIR
from support.datasets import ACCEL_VARS, UNSET, EnvProbe, Plain
from support.processes import children, pid_alive, shm_entries, wait_pids_gone

EXPECTED = [[i, i + 1] for i in range(0, 10, 2)]


# fastload keeps a non-persistent loader's pool warm between epochs
# (``reuse_workers``: its ring and zygote, which the next epoch's workers are
# forked from; they end with the loader). The tests of an iterator's end run
# both ways; "fresh" is DataLoader's behaviour.
POOL_MODES = [
    pytest.param(False, id="fresh-workers"),
    pytest.param(True, id="reused-workers"),
]


def _plain_loader(reuse: bool = False, **kw) -> FastLoader:
    kw.setdefault("batch_size", 2)
    kw.setdefault("num_workers", NW)
    kw.setdefault("reuse_workers", reuse)
    return FastLoader(Plain(10), **kw)


def _assert_no_workers(pids, timeout: float = 5.0) -> None:
    left = wait_pids_gone(pids, timeout)
    assert left == [], f"workers still running: {left}"
    assert [c.pid for c in children() if c.pid in pids] == []


def _after_iterator_end(loader, pids, reuse: bool) -> None:
    """Once an iterator is gone its workers are too, as DataLoader's are; a
    reused pool keeps its ring and zygote warm for the loader's next epoch."""
    _assert_no_workers(pids)
    if not reuse:
        return
    ring = debug_view(loader).idle_pool.ring
    it = iter(loader)
    view = debug_view(it)
    assert view.ring == ring  # the same warm pool, with fresh workers forked from its zygote
    assert set(view.worker_pids).isdisjoint(pids)
    assert [b.tolist() for b in it] == EXPECTED  # making a whole, correct epoch
    del it, ring


def _del_loader_without_gc(loader_holder: list, pids) -> None:
    """Drop the last reference to the loader: as with DataLoader, that must stop its workers."""
    gc.disable()
    try:
        loader_holder.clear()
        _assert_no_workers(pids)
    finally:
        gc.enable()


# ---------------------------------------------------------------------------
# the ways an epoch ends in the training process


@pytest.mark.parametrize("reuse", POOL_MODES)
def test_normal_epoch_end(reuse):
    loader = _plain_loader(reuse)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    assert len(pids) == NW and all(pid_alive(p) for p in pids)
    assert [b.tolist() for b in it] == EXPECTED
    assert debug_view(it).shut_down
    assert debug_view(loader).iterator is None  # not persistent: the loader keeps no iterator
    if not reuse:
        # StopIteration stopped the pool and reaped the workers: no waiting needed.
        assert not any(pid_alive(p) for p in pids)
    del it
    _after_iterator_end(loader, pids, reuse)
    holder = [loader]
    del loader
    _del_loader_without_gc(holder, pids)


@pytest.mark.parametrize("reuse", POOL_MODES)
@pytest.mark.heavy
def test_break_then_del_without_gc(reuse):
    loader = _plain_loader(reuse)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    for b in it:
        assert b.tolist() == [0, 1]
        break
    assert all(pid_alive(p) for p in pids)
    gc.disable()  # dropping the last reference must be enough, as with DataLoader
    try:
        del it, b
        _after_iterator_end(loader, pids, reuse)
    finally:
        gc.enable()
    holder = [loader]
    del loader
    _del_loader_without_gc(holder, pids)


def _train(loader, pids_out):
    for k, batch in enumerate(loader):
        if k == 0:
            # the workers: the leaves of the process tree (the fork server and
            # the pool's zygote, their ancestors, are checked by no_leaks)
            kids = children()
            parents = {p.ppid() for p in kids}
            pids_out.extend(p.pid for p in kids if p.pid not in parents)
        if k == 2:
            raise ZeroDivisionError("loss exploded")


@pytest.mark.parametrize("reuse", POOL_MODES)
def test_exception_in_training_loop(reuse):
    loader = _plain_loader(reuse)
    pids: list = []
    gc.disable()
    try:
        with pytest.raises(ZeroDivisionError, match="loss exploded"):
            _train(loader, pids)
        assert len(pids) == NW
        # The traceback keeps _train's frame, not the iterator.
        _after_iterator_end(loader, pids, reuse)
    finally:
        gc.enable()
    holder = [loader]
    del loader
    _del_loader_without_gc(holder, pids)


def test_persistent_workers_loader_deleted():
    loader = _plain_loader(persistent_workers=True)
    assert [b.tolist() for b in loader] == EXPECTED
    it = loader._iterator  # DataLoader's own: the iterator it keeps for persistent workers
    pids = debug_view(it).worker_pids
    assert all(pid_alive(p) for p in pids), "persistent workers died between epochs"
    assert [b.tolist() for b in loader] == EXPECTED
    assert loader._iterator is it and debug_view(it).worker_pids == pids  # the same workers
    del it, loader
    gc.collect()
    _assert_no_workers(pids)


def test_persistent_workers_stop_on_del_without_gc():
    for cls in (DataLoader, FastLoader):
        loader = cls(Plain(10), batch_size=2, num_workers=NW, persistent_workers=True)
        if [b.tolist() for b in loader] != EXPECTED:
            pytest.fail(f"{cls.__name__}: wrong batches")
        it = loader._iterator
        if cls is DataLoader:
            pids = [w.pid for w in it._workers]
        else:
            pids = list(debug_view(it).worker_pids)
        del it
        gc.collect()
        gc.disable()
        try:
            del loader
            left = wait_pids_gone(pids, timeout=1.5)
        finally:
            gc.enable()
            gc.collect()  # let the xfail case clean up
        if cls is DataLoader:
            if left:  # pytest.fail, not assert: must not count as the expected failure
                pytest.fail(f"DataLoader workers alive after `del loader`: {left}")
        else:
            assert left == [], f"FastLoader workers alive after `del loader`: {left}"


@pytest.mark.parametrize("reuse", POOL_MODES)
def test_held_batches_outlive_the_iterator(reuse):
    width = 4096
    loader = FastLoader(Plain(16, width=width), batch_size=2, num_workers=NW, reuse_workers=reuse)
    it = iter(loader)
    view = debug_view(it)
    pids = view.worker_pids
    lo, length = view.ring.payload_span()
    hi = lo + length
    del view
    # more than held_batches: the first ones view the ring, later ones are copies
    held = [next(it) for _ in range(loader.held_batches + 1)]
    assert lo <= held[0].data_ptr() < hi, "expected a zero-copy batch viewing the ring"
    want = [torch.arange(2 * k, 2 * k + 2).unsqueeze(1).expand(2, width) for k in range(8)]
    del it
    gc.collect()
    _assert_no_workers(pids)
    if reuse:
        # A whole new epoch in the same ring, while the loop still holds the old batches.
        again = [b.clone() for b in loader]
        assert len(again) == 8 and all(torch.equal(a, w) for a, w in zip(again, want))
    del loader
    gc.collect()
    _assert_no_workers(pids)
    # The workers and the ring's fd are gone (the mapping lives on in the batches) ...
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass
    assert [l for l in links if "fastload" in l] == []
    # ... and the batches must still be intact.
    for k, b in enumerate(held):
        assert b.shape == (2, width)
        assert torch.equal(b, want[k]), f"batch {k} changed after the iterator died"
    total = sum(int(b.sum()) for b in held)
    assert total == width * sum(range(2 * len(held)))
    held[0].add_(1)  # still writable memory, no crash
    assert torch.equal(held[0][0], torch.full((width,), 1))


# ---------------------------------------------------------------------------
# the training process itself is interrupted or killed

_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {tests_dir!r})
    from fastload import FastLoader
    from fastload.debug import debug_view
    from support.datasets import Plain
    from support.faults import Misbehave

    loader = FastLoader({dataset}, batch_size=1, num_workers=2,
                        multiprocessing_context=os.environ.get("FL_TEST_CONTEXT") or None)
    it = iter(loader)
    view = debug_view(it)
    print("PIDS", *view.worker_pids, flush=True)
    print("BACKEND", view.ring.backend, flush=True)
    for i, batch in enumerate(it):
        if i == 0:
            # every worker has reached its loop (spawn start-up is over)
            while not all(view.ring.worker_pid(w) > 0 for w in range(2)):
                time.sleep(0.01)
            print("RUNNING", flush=True)
    """
)


BUSY = "Plain(10_000, delay=0.05)"  # workers always have work in hand
# index 3 (worker 1's second task) takes a minute: the loop waits for it, and
# worker 1 is inside __getitem__ (only its parent watcher can notice anything)
STUCK = "Misbehave(10_000, {3: 'sleep'}, seconds=60)"


class _Script:
    """The training script in a subprocess (its own session), read without blocking.

    stdout is pumped by a thread so that a silent hang fails the test instead
    of blocking it; stderr goes to a file that the workers may inherit.
    """

    def __init__(self, dataset: str = BUSY, env=None) -> None:
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT.format(tests_dir=TESTS_DIR, dataset=dataset)],
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: a Ctrl-C reaches only it
        )
        self.pid = self.proc.pid
        self.worker_pids: list = []
        self._lines: "queue.Queue" = queue.Queue()
        self._pump = threading.Thread(target=self._read_stdout, daemon=True)
        self._pump.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read_until(self, tag: str, timeout: float = 60.0) -> list:
        """The words after ``tag`` on the first stdout line starting with it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {tag!r} from the script in {timeout}s: "
                                     f"{self.stderr()}") from None
            if line is None:
                raise AssertionError(f"script ended before {tag!r}: {self.stderr()}")
            if line.startswith(tag):
                return line.split()[1:]

    def start_loader(self) -> None:
        self.worker_pids = [int(p) for p in self.read_until("PIDS")]
        assert len(self.worker_pids) == NW

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()

    def close(self) -> None:
        """Last-resort clean-up of what this test started, by pid."""
        for pid in [self.pid, *self.worker_pids]:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        self._pump.join(HANG_S)
        self.proc.stdout.close()
        self._err.close()


@pytest.fixture
def script():
    made = []

    def start(dataset: str = BUSY, env=None) -> _Script:
        made.append(_Script(dataset, env))
        return made[-1]

    yield start
    for s in made:
        s.close()


def _shm_of(pids) -> set:
    """/dev/shm entries whose name carries one of ``pids`` (fastload-<pid>-*, torch_<pid>_*)."""
    out = set()
    for name in shm_entries():
        for pid in pids:
            if name.startswith((f"fastload-{pid}-", f"torch_{pid}_")):
                out.add(name)
    return out


def _ctrl_c(s: _Script) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    os.killpg(s.pid, signal.SIGINT)


def _check_interrupted(s: _Script) -> str:
    """The script died of the KeyboardInterrupt, and took its workers along."""
    s.proc.wait(timeout=30)
    err = s.stderr()
    assert s.proc.returncode != 0
    assert "Traceback (most recent call last)" in err
    assert "KeyboardInterrupt" in err, err
    assert wait_pids_gone(s.worker_pids, timeout=5) == []
    return err


@pytest.mark.heavy
def test_keyboard_interrupt_in_subprocess(script):
    s = script()
    s.start_loader()
    s.read_until("RUNNING")
    assert all(pid_alive(p) for p in s.worker_pids)
    _ctrl_c(s)
    err = _check_interrupted(s)
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    # only the main process reports it: the workers ignore SIGINT
    assert err.count("KeyboardInterrupt") == 1, err
    assert "did not stop" not in err, err


@pytest.mark.heavy
def test_keyboard_interrupt_while_workers_start(script):
    s = script()
    s.start_loader()
    time.sleep(0.3)  # the workers are importing torch now
    _ctrl_c(s)
    try:
        err = _check_interrupted(s)
    except AssertionError as e:  # pytest.fail: not the expected failure
        pytest.fail(f"interrupt not handled: {e}")
    assert err.count("KeyboardInterrupt") == 1, err
    assert "spawn_main" not in err, err


@pytest.mark.parametrize(
    "segment, dataset, context",
    [("memfd", BUSY, ""), ("posix_shm", STUCK, ""), ("memfd", STUCK, "forkserver")],
    ids=["memfd-busy-workers", "posix_shm-worker-stuck-in-getitem",
         "forkserver-worker-stuck-in-getitem"],
)
@pytest.mark.heavy
def test_main_process_sigkilled(script, segment, dataset, context):
    env = dict(os.environ)
    if segment == "posix_shm":  # the fallback that has a name in /dev/shm
        env["FASTLOAD_SEGMENT"] = "shm"
    # Under forkserver a worker's parent is the server, which outlives the
    # main process: workers must watch the main process itself.
    env["FL_TEST_CONTEXT"] = context
    s = script(dataset, env)
    s.start_loader()
    assert s.read_until("BACKEND") == [segment]
    s.read_until("RUNNING")
    pids = s.worker_pids
    assert all(pid_alive(p) for p in pids)
    os.kill(s.pid, signal.SIGKILL)
    t0 = time.monotonic()
    s.proc.wait(timeout=HANG_S)
    # Orphaned workers notice the death of their parent on their own.
    left = wait_pids_gone(pids, timeout=HANG_S)
    took = time.monotonic() - t0
    assert left == [], f"workers survived their main process: {left}"
    assert took < HANG_S
    assert _shm_of([s.pid, *pids]) == set()
    s._pump.join(HANG_S)  # stdout closes once no worker holds it
    assert not s._pump.is_alive()
    assert "Traceback" not in s.stderr(), s.stderr()  # the workers went quietly


# ---------------------------------------------------------------------------
# a persistent pool that loses a worker while idle


def test_persistent_worker_killed_between_epochs():
    loader = _plain_loader(persistent_workers=True)
    assert [b.tolist() for b in loader] == EXPECTED
    it = loader._iterator  # DataLoader's own: the iterator it keeps for persistent workers
    pids = debug_view(it).worker_pids
    os.kill(pids[1], signal.SIGKILL)
    assert wait_pids_gone([pids[1]], timeout=5) == []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=KILLED_RE) as info:
        for _ in loader:
            pass
    assert time.monotonic() - t0 < HANG_S
    assert str(pids[1]) in str(info.value)
    assert debug_view(it).shut_down
    del info
    _assert_no_workers(pids)
    del it, loader
    gc.collect()


@pytest.mark.heavy
def test_reused_worker_killed_between_epochs():
    # Not persistent, but the loader keeps its workers warm: losing one while
    # idle may be reported (like persistent workers) or repaired with a new
    # pool; it must never hang or hand out a wrong epoch.
    loader = _plain_loader(reuse=True)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    assert [b.tolist() for b in it] == EXPECTED
    del it
    os.kill(pids[1], signal.SIGKILL)
    assert wait_pids_gone([pids[1]], timeout=5) == []
    t0 = time.monotonic()
    new_pids: tuple = ()
    try:
        it = iter(loader)
        new_pids = debug_view(it).worker_pids
        got = [b.tolist() for b in it]
    except RuntimeError as e:
        assert re.search(KILLED_RE, str(e)), str(e)
    else:
        assert got == EXPECTED
        assert pids[1] not in new_pids
        del it
    assert time.monotonic() - t0 < HANG_S + 5  # may include a new pool's start-up
    holder = [loader]
    del loader
    _del_loader_without_gc(holder, set(pids) | set(new_pids))


# ---------------------------------------------------------------------------
# other start methods


@pytest.fixture(scope="module")
def forkserver_running():
    # The forkserver and its fds belong to the session, not to one test.
    multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _probe_rows(batches):
    rows = []
    for b in batches:
        for j in range(len(b["index"])):
            rows.append({k: (v[j].item() if isinstance(v, torch.Tensor) else v[j])
                         for k, v in b.items()})
    return rows


def test_fork_start_method(monkeypatch):
    _check_start_method("fork", monkeypatch)


def test_forkserver_start_method(forkserver_running, monkeypatch):
    _check_start_method("forkserver", monkeypatch)


@pytest.mark.slow
def test_forkserver_epoch_longer_than_the_parent_check(forkserver_running):
    # A worker's parent is the forkserver, not this process: a worker that
    # took that for the death of its main process quit after about a second.
    ds = Plain(40, delay=0.1)
    loader = FastLoader(ds, batch_size=2, num_workers=NW, multiprocessing_context="forkserver")
    got = [b.tolist() for b in loader]
    assert got == [b.tolist() for b in DataLoader(ds, batch_size=2)]


def _check_start_method(method, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    ds = EnvProbe(8)
    want = _probe_rows(DataLoader(ds, batch_size=2, num_workers=NW))
    loader = FastLoader(ds, batch_size=2, num_workers=NW, multiprocessing_context=method)
    it = iter(loader)
    pids = debug_view(it).worker_pids
    rows = _probe_rows(list(it))
    del it, loader
    keys = ("index", "worker_id", "num_workers", "has_info", "threads")
    assert [tuple(r[k] for k in keys) for r in rows] == [tuple(r[k] for k in keys) for r in want]
    assert {r["pid"] for r in rows} == set(pids)
    assert all(r[v] == "" for r in rows for v in ACCEL_VARS)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    _assert_no_workers(pids)


# ---------------------------------------------------------------------------
# the environment of a worker


@pytest.mark.parametrize("allow_gpu", [False, True], ids=["default", "allow_gpu_in_workers"])
def test_worker_environment(allow_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    parent_env = dict(os.environ)
    loader = FastLoader(EnvProbe(8), batch_size=2, num_workers=NW,
                        allow_gpu_in_workers=allow_gpu)
    it = iter(loader)
    assert dict(os.environ) == parent_env
    view = debug_view(it)
    pids, base_seed = view.worker_pids, view.base_seed
    del view
    rows = _probe_rows(list(it))
    del it, loader
    assert dict(os.environ) == parent_env

    assert [r["index"] for r in rows] == list(range(8))
    for r in rows:
        if allow_gpu:
            assert (r["CUDA_VISIBLE_DEVICES"], r["HIP_VISIBLE_DEVICES"],
                    r["ROCR_VISIBLE_DEVICES"]) == ("0", "1", UNSET)
        else:
            assert all(r[v] == "" for v in ACCEL_VARS), r
        assert r["threads"] == 1
        assert r["has_info"] and r["info_dataset_is_probe"]
        assert r["num_workers"] == NW
        wid = (r["index"] // 2) % NW  # batches go round-robin, like DataLoader
        assert r["worker_id"] == wid
        assert r["seed"] == base_seed + wid
        assert r["pid"] == pids[wid]
    _assert_no_workers(pids)


@pytest.mark.heavy
@pytest.mark.parametrize("context", ["", "spawn"], ids=["zygote", "spawn"])
def test_python_dev_mode_sees_no_resource_warning(context):
    """Under Python's development mode (which shows every ResourceWarning,
    in the workers too: they inherit PYTHONDEVMODE) two epochs and the
    loader's end leave nothing unclosed, as with DataLoader."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TESTS_DIR!r})
        from fastload import FastLoader
        from support.datasets import Plain
        loader = FastLoader(Plain(16), batch_size=4, num_workers=2,
                            multiprocessing_context={context!r} or None)
        for epoch in range(2):
            assert len(list(loader)) == 4
        del loader
        print("done", flush=True)
    """)
    env = dict(os.environ, PYTHONDEVMODE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert "ResourceWarning" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
