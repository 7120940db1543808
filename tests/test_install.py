"""fastload.install(): DataLoaders that libraries build run on fastload.

Every comparison is against torch's own DataLoader with the same seed: with
install() in effect the same loader object gives the same batches, and its
iterator is fastload's.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import (_MultiProcessingDataLoaderIter,
                                         _SingleProcessDataLoaderIter)

import fastload
from fastload import FastLoader
from fastload.iterator.multi_process import FastLoaderIter
from fastload.debug import debug_view
from fastload.loader import STATE_ATTR
from support import equality as eq, torch_versions
from support.equality import assert_same

NW = 2
PYTHON_DIR = Path(fastload.__file__).resolve().parent.parent  # what holds fastload/
ORIGINAL_GET_ITERATOR = DataLoader.__dict__["_get_iterator"]


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Every test starts and ends with DataLoader's own _get_iterator."""
    fastload.uninstall()
    yield
    fastload.uninstall()
    assert DataLoader.__dict__["_get_iterator"] is ORIGINAL_GET_ITERATOR
    assert not fastload.installed()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make(cls: Any = DataLoader, seed: int = 0, **kw: Any) -> Any:
    """The loader every comparison uses: randomness drawn in the workers,
    worker_init_fn, shuffled by a seeded generator."""
    kw.setdefault("num_workers", NW)
    if "batch_sampler" not in kw:
        kw.setdefault("batch_size", 3)
        kw.setdefault("shuffle", True)
    kw.setdefault("generator", gen(seed))
    return cls(eq.RandomDataset(17), worker_init_fn=eq.worker_init, **kw)


def assert_batches(a: List[Any], b: List[Any]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same(x, y, f"batch {i}")


class TaggingLoader(DataLoader):
    """Defined before any install(): overrides __iter__ and __len__."""

    def __len__(self) -> int:
        return 1000

    def __iter__(self) -> Iterator[Any]:
        self.inner = super().__iter__()
        for batch in self.inner:
            batch["tag"] = "mine"
            yield batch


# ---- a plain DataLoader ------------------------------------------------------
@pytest.mark.heavy
def test_plain_dataloader_runs_on_fastload_with_the_same_batches(caplog):
    want = list(make())
    fastload.install()
    assert fastload.installed()
    loader = make()
    with caplog.at_level(logging.INFO, logger="fastload"):
        it = iter(loader)
        assert type(it).__name__ == "FastLoaderIter" and isinstance(it, FastLoaderIter)
        assert_batches(list(it), want)
        list(make())  # a second loader and a second epoch: no second line
        list(loader)
    lines = [r for r in caplog.records if r.name == "fastload" and r.levelno == logging.INFO
             and "installed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "DataLoader (num_workers=2) is the first loader to run on fastload" in lines[0].getMessage()


def test_warm_pool_kept_between_epochs():
    theirs = make()
    ref = [list(theirs), list(theirs)]
    fastload.install()
    loader = make()
    it = iter(loader)
    pids = debug_view(it).worker_pids
    first = list(it)
    del it
    pool = debug_view(loader).idle_pool
    assert pool is not None and pool.pids == pids  # kept warm, not shut down
    it = iter(loader)
    assert debug_view(it).pool.ring == pool.ring  # the same pool
    second = list(it)
    assert_batches(first, ref[0])
    assert_batches(second, ref[1])


def test_loader_created_before_install():
    want = list(make())
    loader = make()
    fastload.install()
    it = iter(loader)
    assert isinstance(it, FastLoaderIter)
    assert_batches(list(it), want)


def test_num_workers_0_is_left_to_dataloader():
    fastload.install()
    loader = DataLoader(TensorDataset(torch.arange(7)), batch_size=3)
    it = iter(loader)
    assert type(it) is _SingleProcessDataLoaderIter
    assert [b[0].tolist() for b in it] == [[0, 1, 2], [3, 4, 5], [6]]
    assert STATE_ATTR not in loader.__dict__


@pytest.mark.heavy
def test_uninstall_restores_dataloader_s_iterator():
    loader = make()
    fastload.install()
    assert isinstance(iter(loader), FastLoaderIter)
    fastload.uninstall()
    assert DataLoader.__dict__["_get_iterator"] is ORIGINAL_GET_ITERATOR
    it = iter(loader)  # the same loader, DataLoader's iterator again
    assert type(it) is _MultiProcessingDataLoaderIter
    assert len(list(it)) == 6
    del it
    fastload.uninstall()  # not installed: nothing to do


def test_uninstall_under_someone_else_s_wrapper_leaves_it(caplog):
    fastload.install()
    ours = DataLoader.__dict__["_get_iterator"]
    calls: List[int] = []

    def theirs(self: DataLoader) -> Any:
        calls.append(self.num_workers)
        return ours(self)

    DataLoader._get_iterator = theirs  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger="fastload"):
            fastload.uninstall()
        assert "was replaced after fastload.install()" in caplog.text
        assert DataLoader.__dict__["_get_iterator"] is theirs and not fastload.installed()
        it = iter(make())  # through their wrapper to DataLoader's own
        assert type(it) is _MultiProcessingDataLoaderIter and calls == [NW]
        del it
        fastload.install()  # ours, still inside theirs, is on again
        it = iter(make())
        assert isinstance(it, FastLoaderIter) and calls == [NW, NW]
        del it
    finally:
        DataLoader._get_iterator = ours  # type: ignore[method-assign]  # they unwrap
    fastload.install()
    fastload.uninstall()


def test_install_twice_is_one_install_with_the_latest_options():
    fastload.install(hang_timeout=7.5)
    hook = DataLoader.__dict__["_get_iterator"]
    fastload.install(hang_timeout=9, held_batches=2, max_worker_restarts=1)
    assert DataLoader.__dict__["_get_iterator"] is hook
    it = iter(make())
    view = debug_view(it)
    assert (view.hang_timeout, view.held_batches, view.restarts_left) == (9, 2, 1)
    del it
    fastload.uninstall()  # one uninstall undoes both
    assert DataLoader.__dict__["_get_iterator"] is ORIGINAL_GET_ITERATOR


@pytest.mark.heavy
def test_install_options_reach_the_iterator():
    loader = make()
    fastload.install(hang_timeout=7.5, held_batches=2, slot_bytes=1 << 20, reuse_workers=False)
    it = iter(loader)
    view = debug_view(it)
    assert (view.hang_timeout, view.held_batches, view.ring.slot_bytes) == (7.5, 2, 1 << 20)
    assert_batches(list(it), list(make()))
    del it
    assert debug_view(loader).idle_pool is None  # reuse_workers=False
    # A later install() applies from the loader's next iterator.
    fastload.install(hang_timeout=None)
    it = iter(loader)
    view = debug_view(it)
    assert view.hang_timeout is None and view.held_batches == 4


@pytest.mark.parametrize("kwargs", [dict(held_batches=0), dict(hang_timeout=-1),
                                    dict(slot_bytes=0), dict(max_worker_restarts=True),
                                    dict(device="nonsense")])
def test_bad_option_is_fastloader_s_value_error(kwargs):
    with pytest.raises(ValueError) as theirs:
        FastLoader(eq.RandomDataset(4), **kwargs)
    with pytest.raises(ValueError) as ours:
        fastload.install(**kwargs)
    assert str(ours.value) == str(theirs.value)
    assert not fastload.installed()


def test_unknown_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="prefetch_batches"):
        fastload.install(prefetch_batches=3)  # type: ignore[call-arg]
    assert not fastload.installed()


@pytest.mark.heavy
def test_fastloader_keeps_its_own_options():
    fastload.install(hang_timeout=7.5)
    loader = make(cls=FastLoader, hang_timeout=5)
    it = iter(loader)
    assert debug_view(it).hang_timeout == 5
    assert_batches(list(it), list(make(cls=FastLoader)))


# ---- subclasses and loaders that libraries build -----------------------------
def test_subclass_defined_before_install_keeps_its_methods():
    want = [dict(b, tag="mine") for b in make()]
    fastload.install()
    loader = make(cls=TaggingLoader)
    assert len(loader) == 1000
    got = list(loader)
    assert isinstance(loader.inner, FastLoaderIter)
    assert_batches(got, want)


class _RepeatSampler:
    """Ultralytics' sampler: repeats forever."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from iter(self.sampler)


@pytest.mark.heavy
def test_subclass_defined_after_install_that_calls_get_iterator_itself():
    fastload.install()

    class InfiniteDataLoader(DataLoader):
        """Ultralytics' InfiniteDataLoader, as it is written there."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            object.__setattr__(self, "batch_sampler", _RepeatSampler(self.batch_sampler))
            self.iterator = super().__iter__()

        def __len__(self) -> int:
            return len(self.batch_sampler.sampler)

        def __iter__(self) -> Iterator[Any]:
            for _ in range(len(self)):
                yield next(self.iterator)

        def reset(self) -> None:
            self.iterator = self._get_iterator()

    def epochs(loader: Any) -> List[Any]:
        out = list(loader) + list(loader)  # the same endless iterator
        loader.reset()
        return out + list(loader)

    loader = make(cls=InfiniteDataLoader)
    assert isinstance(loader.iterator, FastLoaderIter)
    got = epochs(loader)
    assert isinstance(loader.iterator, FastLoaderIter)
    del loader
    fastload.uninstall()
    ref = make(cls=InfiniteDataLoader)
    assert type(ref.iterator) is _MultiProcessingDataLoaderIter
    assert_batches(got, epochs(ref))


def test_custom_batch_sampler():
    def loader() -> DataLoader:
        return make(batch_sampler=eq.RandomBatchSampler(17, 6, gen(5)))

    want = list(loader())
    fastload.install()
    it = iter(loader())
    assert isinstance(it, FastLoaderIter)
    assert_batches(list(it), want)


def test_persistent_workers_over_two_epochs():
    def epochs(loader: DataLoader) -> Tuple[List[Any], type]:
        first = iter(loader)
        out = list(first)
        second = iter(loader)
        assert second is first  # DataLoader's persistent iterator, reset
        return out + list(second), type(first)

    want, theirs = epochs(make(persistent_workers=True))
    assert theirs is _MultiProcessingDataLoaderIter
    fastload.install()
    got, ours = epochs(make(persistent_workers=True))
    assert ours is FastLoaderIter
    assert_batches(got, want)


def test_copied_and_pickled_loaders_take_options_not_workers():
    fastload.install(hang_timeout=7.5)
    # torch 2.1's Generator cannot be copied or pickled (DataLoader's neither).
    loader = make() if torch_versions.GENERATOR_PICKLES else make(generator=None)
    list(loader)
    assert getattr(loader, STATE_ATTR).pools.idle_pool is not None
    for other in (copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        state = getattr(other, STATE_ATTR)
        assert state.pools.idle_pool is None and state.options.hang_timeout == 7.5


@pytest.mark.slow
def test_accelerate_prepare_runs_on_fastload(monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    def loader() -> DataLoader:
        return DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, num_workers=NW)

    want = list(loader())
    made: List[str] = []
    real_init = FastLoaderIter.__init__

    def spy(self: Any, loader: Any, *args: Any, **kw: Any) -> None:
        made.append(type(loader).__name__)
        real_init(self, loader, *args, **kw)

    monkeypatch.setattr(FastLoaderIter, "__init__", spy)
    fastload.install()
    try:
        prepared = accelerate.Accelerator(cpu=True).prepare(loader())
        got = list(prepared)
    finally:
        AcceleratorState._reset_state(True)
    assert made == ["DataLoader"]  # accelerate's rebuilt loader, inside DataLoaderShard
    assert_batches(got, want)
    del prepared


# ---- python -m fastload run, FASTLOAD_INSTALL=1 ------------------------------
PROBE = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return i * i

    if __name__ == "__main__":
        it = iter(DataLoader(Squares(), batch_size=2, num_workers=2))
        print("iterator", type(it).__name__)
        print("batches", [b.tolist() for b in it])
        print("argv", sys.argv)
        sys.exit(int(sys.argv[-1]) if sys.argv[-1].isdigit() else 0)
    """
)


def _env(*prepend: Path, **extra: str) -> Dict[str, str]:
    """This environment with this checkout's fastload first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_INSTALL"}
    path = [*map(str, prepend), str(PYTHON_DIR), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env.update(extra)
    return env


def _run(args: List[str], cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _lines(out: str) -> Dict[str, str]:
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


@pytest.mark.slow
def test_python_m_fastload_run_script(tmp_path):
    (tmp_path / "train.py").write_text(PROBE)
    p = _run(["-m", "fastload", "run", "--hang-timeout", "60", "train.py", "a", "-m", "3"],
             tmp_path, _env())
    assert p.returncode == 3, p.stderr  # the script's exit status
    out = _lines(p.stdout)
    assert out["iterator"] == "FastLoaderIter"
    assert out["batches"] == "[[0, 1], [4, 9], [16, 25]]"
    assert out["argv"] == "['train.py', 'a', '-m', '3']"  # as `python train.py a -m 3`


@pytest.mark.slow
def test_python_m_fastload_run_module(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    p = _run(["-m", "fastload", "run", "-m", "probe_mod", "-v", "x"], tmp_path, _env())
    assert p.returncode == 0, p.stderr
    out = _lines(p.stdout)
    assert out["iterator"] == "FastLoaderIter"
    assert out["argv"] == repr([str(tmp_path / "probe_mod.py"), "-v", "x"])


@pytest.mark.slow
def test_python_m_fastload_run_usage_errors(tmp_path):
    for args, msg in ((["run"], "give a script path or -m module"),
                      (["run", "--held-batches", "0", "x.py"], "held_batches option should be"),
                      (["nope"], "invalid choice")):
        p = _run(["-m", "fastload", *args], tmp_path, _env())
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)


@pytest.fixture
def site_dir(tmp_path: Path) -> Path:
    """A directory whose sitecustomize processes the source tree's .pth the
    way site does for site-packages at start-up (the wheel's place for it)."""
    d = tmp_path / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(PYTHON_DIR)!r})\n")
    return d


@pytest.mark.slow
@pytest.mark.parametrize("first", ["torch", "fastload"])
def test_env_var_installs_in_a_new_interpreter(tmp_path, site_dir, first):
    (tmp_path / "train.py").write_text(f"import {first}\n" + PROBE)
    env = _env(site_dir, FASTLOAD_INSTALL="1")
    p = _run(["train.py"], tmp_path, env)
    assert p.returncode == 0, p.stderr
    assert _lines(p.stdout)["iterator"] == "FastLoaderIter"


@pytest.mark.slow
def test_env_var_unset_imports_nothing(tmp_path, site_dir):
    (tmp_path / "train.py").write_text(PROBE)
    check = ("import sys; print('loaded', sorted(m for m in sys.modules "
             "if 'torch' in m or 'fastload' in m))")
    for value in (None, "0"):
        env = _env(site_dir)
        if value is not None:
            env["FASTLOAD_INSTALL"] = value
        p = _run(["-c", check], tmp_path, env)
        want = "[]" if value is None else "['_fastload_autoinstall']"
        assert _lines(p.stdout)["loaded"] == want, p.stderr
        p = _run(["train.py"], tmp_path, env)
        assert _lines(p.stdout)["iterator"] == "_MultiProcessingDataLoaderIter", p.stderr
    # Set: only the small module at start-up; torch and fastload when torch is imported.
    p = _run(["-c", check], tmp_path, _env(site_dir, FASTLOAD_INSTALL="1"))
    assert _lines(p.stdout)["loaded"] == "['_fastload_autoinstall']", p.stderr


@pytest.mark.skipif(not os.environ.get("FASTLOAD_TEST_WHEEL"),
                    reason="set FASTLOAD_TEST_WHEEL to a built wheel to test it in a venv")
@pytest.mark.slow
def test_wheel_ships_the_pth_and_installs_with_the_env_var(tmp_path):
    wheel = os.environ["FASTLOAD_TEST_WHEEL"]
    names = zipfile.ZipFile(wheel).namelist()
    assert "fastload_autoinstall.pth" in names and "_fastload_autoinstall.py" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", wheel], check=True)
    (tmp_path / "train.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTLOAD_INSTALL")}
    for value, want in (("1", "FastLoaderIter"), (None, "_MultiProcessingDataLoaderIter")):
        run_env = dict(env, FASTLOAD_INSTALL=value) if value else env
        p = subprocess.run([py, "train.py"], cwd=tmp_path, env=run_env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert _lines(p.stdout)["iterator"] == want
    shutil.rmtree(venv)


def _zygote_pids() -> set:
    import psutil

    out = set()
    for c in psutil.Process().children():
        try:
            if "fastload zygote" in " ".join(c.cmdline()):
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_install_starts_the_zygote_that_the_first_loader_takes() -> None:
    """install() starts the zygote at once (it imports torch while the script
    builds its model); the first loader forks its workers from that one."""
    fastload.shutdown()  # none running (this process's import, or an earlier test, started one)
    fastload.install()
    started = _zygote_pids()
    assert len(started) == 1
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
    it = iter(loader)
    assert isinstance(it, FastLoaderIter)
    assert _zygote_pids() == started  # no second zygote
    assert [b.tolist() for b in it] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    del it, loader


def test_uninstall_lets_go_of_the_fork_server_which_runs_until_shutdown() -> None:
    """install() started the fork server (or found it running); uninstall()
    lets go of its lease, and the server runs on, as it would after the last
    loader, until the process ends or fastload.shutdown()."""
    from fastload.launching.fork_server import fork_server_pid
    from support.processes import pid_alive, wait_pids_gone

    fastload.shutdown()  # none running (this process's import, or an earlier test, started one)
    fastload.install()
    (pid,) = _zygote_pids()
    fastload.uninstall()
    assert pid_alive(pid) and fork_server_pid(True) == pid
    fastload.shutdown()
    assert wait_pids_gone([pid]) == []
