"""Mid-epoch resume: a loader saved with state_dict() after some batches and
loaded into a new loader delivers, batch for batch and value for value, what
the uninterrupted loader delivered, including randomness drawn inside
workers, and the epoch after it too."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from torch.utils.data import (Dataset, DistributedSampler, IterableDataset, Sampler,
                              get_worker_info)

from fastload import FastLoader
from support import torch_versions

# 3 workers on a 2-core machine: DataLoader's own warning, expected here.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _draws() -> List[int]:
    """What an augmentation pipeline draws: one number from each global generator."""
    return [int(torch.randint(1000, ())), random.randint(0, 999), int(np.random.randint(1000))]


class Augmented(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, *_draws()])


class Stream(IterableDataset):
    """Sharded over workers, uneven shards (replicas end at different batches)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield torch.tensor([i, *_draws()])


class StatefulStream(IterableDataset):
    """Implements state_dict/load_state_dict (torchdata's Stateful protocol):
    resumes from its own position, never fast-forwarded."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos: Optional[int] = None
        self.loads = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.pos = sd["pos"]
        self.loads += 1

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.pos if self.pos is not None else wid
        self.pos = None
        for i in range(start, self.n, nw):
            self.pos = i + nw
            yield torch.tensor([i, *_draws()])


def _make(ds: Any, nw: int, **kw: Any) -> FastLoader:
    kw.setdefault("batch_size", 3)
    if nw == 0:
        kw.pop("persistent_workers", None)
        kw.pop("prefetch_factor", None)
    if isinstance(ds, Dataset) and not isinstance(ds, IterableDataset) and "sampler" not in kw \
            and "batch_sampler" not in kw:
        kw.setdefault("shuffle", True)
    return FastLoader(ds, num_workers=nw, **kw)


def _epoch(it: Any, n: Optional[int] = None) -> List[List[int]]:
    out = []
    for b in it:
        out.append(b.tolist())
        if n is not None and len(out) == n:
            break
    return out


def _roundtrip(sd: Dict[str, Any]) -> Dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    with warnings.catch_warnings():
        # torch 2.1's weights_only loading warns of its own use of TypedStorage.
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        return torch.load(buf, weights_only=True)


def _check_resume(make, stop_epoch: int, stop: int, *, exhaust: bool = False) -> None:
    """Uninterrupted: epochs 0..stop_epoch+1. Interrupted: ``stop`` batches of
    epoch ``stop_epoch`` (then StopIteration too if ``exhaust``), saved,
    loaded into a new loader, the rest of that epoch and the next one."""
    _seed_all(0)
    loader = make()
    full = [_epoch(loader) for _ in range(stop_epoch + 2)]
    del loader

    _seed_all(0)
    loader = make()
    for _ in range(stop_epoch):
        _epoch(loader)
    it = iter(loader)
    got = _epoch(it, stop) if stop else []
    if exhaust:
        assert next(it, None) is None
    assert got == full[stop_epoch][:stop]
    sd = _roundtrip(loader.state_dict())
    callers = _global_generators()  # what a training checkpoint saves too
    del it, loader

    resumed = make()
    resumed.load_state_dict(sd)
    torch.manual_seed(12345)  # whatever the new process has: the values must not depend on it
    if exhaust:  # saved after the epoch's end: the next iter() is a new epoch, drawn as usual
        _set_global_generators(callers)
        assert _epoch(resumed) == full[stop_epoch + 1]
        return
    it = iter(resumed)
    _set_global_generators(callers)  # restored after iter(), as the HF Trainer does
    rest = _epoch(it)
    assert rest == full[stop_epoch][stop:]
    assert _epoch(resumed) == full[stop_epoch + 1]


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _global_generators() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_global_generators(states: tuple) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


# nw=1, and the iterable case without persistent workers, are also in
# test_resume_matrix: the slow group.
@pytest.mark.parametrize("nw", [0, pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.heavy
def test_map_style_mid_epoch(nw: int, persistent: bool) -> None:
    _check_resume(lambda: _make(Augmented(40), nw, persistent_workers=persistent), 0, 5)


@pytest.mark.parametrize("nw", [0, 3])
@pytest.mark.parametrize("persistent", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.heavy
def test_iterable_mid_epoch(nw: int, persistent: bool) -> None:
    _check_resume(lambda: _make(Stream(40), nw, persistent_workers=persistent), 0, 6)


@pytest.mark.parametrize("where", [pytest.param("first", marks=pytest.mark.slow),
                                   pytest.param("last", marks=pytest.mark.slow), "after-stop"])
@pytest.mark.heavy
def test_resume_points(where: str) -> None:
    make = lambda: _make(Augmented(20), 2, prefetch_factor=3)  # noqa: E731
    n = 7  # batches per epoch
    stop = {"first": 1, "last": n, "after-stop": n}[where]
    _check_resume(make, 0, stop, exhaust=where == "after-stop")


@pytest.mark.slow
def test_second_epoch_of_persistent_workers() -> None:
    """Workers' generators carry over epochs: the state is that of the second epoch."""
    _check_resume(lambda: _make(Augmented(24), 2, persistent_workers=True), 1, 3)


@pytest.mark.slow
def test_a_worker_whose_last_batch_was_in_the_epoch_before() -> None:
    """Saved after one batch of the second epoch: two of the three persistent
    workers last delivered a batch in the first epoch, whose last batches
    must count as delivered."""
    _check_resume(lambda: _make(Augmented(25), 3, persistent_workers=True, prefetch_factor=1),
                  1, 1)


@pytest.mark.slow
def test_a_replica_seen_ending_with_a_batch_undelivered() -> None:
    """Saved when the loader already knew a replica had ended but had not yet
    delivered that replica's last batch: the resumed replica makes it again."""
    _check_resume(lambda: _make(Stream(25), 3, prefetch_factor=3), 0, 7)


@pytest.mark.slow
def test_stateful_iterable_dataset_is_loaded_not_fast_forwarded() -> None:
    _check_resume(lambda: _make(StatefulStream(30), 2), 0, 4)
    loader = _make(StatefulStream(30), 2)
    it = iter(loader)
    _epoch(it, 4)
    captures = [w["capture"] for w in loader.state_dict()["workers"]]
    assert [c[4] for c in captures] == [{"pos": 12}, {"pos": 13}]  # the replicas' own states


@pytest.mark.parametrize("nw", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.heavy
def test_resumed_epoch_does_not_depend_on_the_global_generator(nw: int) -> None:
    """A resumed epoch's values come from the saved state, whatever the
    resuming process's global generator holds; and a resumed iter() draws
    from that generator what the iter() of any new loader draws, so a
    script that seeds once at start (Lightning) goes on with the same
    generator state as the run that was never stopped."""
    make = lambda: _make(Augmented(30), nw)  # noqa: E731
    _seed_all(0)
    full = _epoch(make())
    _seed_all(0)
    loader = make()
    it = iter(loader)
    _epoch(it, 3)
    sd = _roundtrip(loader.state_dict())
    callers = _global_generators()
    del it, loader
    for seed in (999, 5):
        resumed = make()
        resumed.load_state_dict(sd)
        _seed_all(seed)
        it = iter(resumed)
        drawn_by_resume = _global_generators()
        _seed_all(seed)
        fresh = iter(make())
        assert torch.equal(_global_generators()[0], drawn_by_resume[0])
        del fresh
        if nw == 0:  # the dataset draws from this process's generators: the script restores them
            _set_global_generators(callers)
        assert _epoch(it) == full[3:]


@pytest.mark.heavy
@torch_versions.needs_in_order
def test_in_order_false_delivers_the_rest_as_a_multiset() -> None:
    torch.manual_seed(0)
    make = lambda: _make(Augmented(60), 3, in_order=False, prefetch_factor=2)  # noqa: E731
    loader = make()
    full = sorted(row[0] for b in _epoch(loader) for row in b)
    it = iter(loader)
    head = _epoch(it, 5)
    sd = _roundtrip(loader.state_dict())
    del it
    resumed = make()
    resumed.load_state_dict(sd)
    rest = _epoch(resumed)
    assert sorted(row[0] for b in head + rest for row in b) == full


@pytest.mark.slow
def test_sampler_with_generator_and_distributed_sampler() -> None:
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    _check_resume(lambda: _make(Augmented(30), 2, generator=g()), 0, 4)

    class Epochs(DistributedSampler):
        def __init__(self, ds):
            super().__init__(ds, num_replicas=2, rank=1, shuffle=True, seed=5)

    def make():
        ds = Augmented(30)
        return _make(ds, 2, sampler=Epochs(ds))
    _check_resume(make, 0, 2)


class CountingBatchSampler(Sampler):
    """A batch sampler with its own state (an epoch counter it draws from)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n // 4

    def __iter__(self):
        g = torch.Generator().manual_seed(100 + self.epoch)
        self.epoch += 1
        order = torch.randperm(self.n, generator=g).tolist()
        return iter([order[k:k + 4] for k in range(0, self.n - 3, 4)])

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.epoch = sd["epoch"]


@pytest.mark.slow
def test_batch_sampler_with_state_dict_is_used() -> None:
    _check_resume(lambda: FastLoader(Augmented(32), num_workers=2,
                                     batch_sampler=CountingBatchSampler(32)), 1, 3)


@pytest.mark.heavy
def test_state_is_small_and_plain() -> None:
    loader = _make(Augmented(10_000), 3, prefetch_factor=4, batch_size=8)
    it = iter(loader)
    _epoch(it, 10)
    sd = loader.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert buf.tell() < 64 << 10  # kilobytes, whatever the dataset's size
    # No bytes: torch.load(weights_only=True) reads them only from torch 2.5 on.
    assert not _bytes_in(sd)
    _roundtrip(sd)


def _bytes_in(obj: Any, where: str = "sd") -> List[str]:
    if isinstance(obj, (bytes, bytearray)):
        return [where]
    if isinstance(obj, dict):
        return [w for k, v in obj.items() for w in _bytes_in(v, f"{where}[{k!r}]")]
    if isinstance(obj, (list, tuple)):
        return [w for i, v in enumerate(obj) for w in _bytes_in(v, f"{where}[{i}]")]
    return []


@pytest.mark.heavy
def test_incompatible_states_are_refused() -> None:
    loader = _make(Augmented(30), 2)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    with pytest.raises(ValueError, match="num_workers=2.*num_workers=3"):
        _make(Augmented(30), 3).load_state_dict(sd)
    with pytest.raises(ValueError, match="batch_size=3.*batch_size=4"):
        _make(Augmented(30), 2, batch_size=4).load_state_dict(sd)
    with pytest.raises(ValueError, match="dataset_len=30.*dataset_len=31"):
        _make(Augmented(31), 2).load_state_dict(sd)
    with pytest.raises(ValueError, match="format"):
        _make(Augmented(30), 2).load_state_dict({**sd, "fastload_resume": 999})
    with pytest.raises(ValueError, match="not a fastload loader state"):
        _make(Augmented(30), 2).load_state_dict({"_num_yielded": 3})


def test_a_stateful_dataloader_shuffled_state_needs_a_generator() -> None:
    """The state torchdata's StatefulDataLoader writes (the real one is taken
    over in tests/integration/test_torchdata.py): a shuffled order can be
    taken over only by a loader drawing its permutation from a generator."""
    sdl_state = {"_snapshot": {"_snapshot_step": 2, "_main_snapshot": {
        "_num_workers": 2, "_base_seed": 5,
        "_sampler_iter_state": {"samples_yielded": 6, "sampler_iter_state": {
            "yielded": 6, "generator": torch.Generator().get_state()}}}},
        "_steps_since_snapshot": 0, "_iterator_finished": False}
    with pytest.raises(ValueError, match="given a generator"):
        _make(Augmented(30), 2).load_state_dict(sdl_state)
    with pytest.raises(ValueError, match="num_workers=2.*num_workers=3"):
        _make(Augmented(30), 3, generator=torch.Generator()).load_state_dict(sdl_state)
    _make(Augmented(30), 2, generator=torch.Generator()).load_state_dict(sdl_state)


class KillOnce(Augmented):
    """Augmented, whose worker dies once (SIGKILL) when it reaches ``bad``."""

    def __init__(self, n: int, bad: int, marker: str) -> None:
        super().__init__(n)
        self.bad, self.marker = bad, marker

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), 9)
        return super().__getitem__(i)


@pytest.mark.slow
def test_a_restarted_worker_makes_the_same_batches(tmp_path) -> None:
    """A worker killed mid-epoch is replaced with the generators of the dead
    one after its last finished batch: the epoch equals the undisturbed one."""
    torch.manual_seed(0)
    calm = _epoch(_make(Augmented(40), 2, batch_size=4))
    torch.manual_seed(0)
    marker = os.fspath(tmp_path / "killed")
    got = _epoch(_make(KillOnce(40, bad=-1, marker=marker), 2, batch_size=4))
    assert got == calm
    torch.manual_seed(0)
    order = [row[0] for b in calm for row in b]
    disturbed = _epoch(_make(KillOnce(40, bad=order[22], marker=marker), 2, batch_size=4,
                             max_worker_restarts=1))
    assert os.path.exists(marker)
    assert disturbed == calm


@pytest.mark.slow
def test_resume_after_a_restart(tmp_path) -> None:
    marker = os.fspath(tmp_path / "killed")
    torch.manual_seed(0)
    calm = _epoch(_make(Augmented(40), 2, batch_size=4))
    order = [row[0] for b in calm for row in b]
    make = lambda: _make(KillOnce(40, bad=order[6], marker=marker), 2, batch_size=4,  # noqa: E731
                         max_worker_restarts=1)
    torch.manual_seed(0)
    loader = make()
    it = iter(loader)
    head = _epoch(it, 5)
    sd = _roundtrip(loader.state_dict())
    del it
    assert os.path.exists(marker)
    resumed = make()
    resumed.load_state_dict(sd)
    assert head + _epoch(resumed) == calm


@pytest.mark.slow
def test_state_loaded_in_a_new_process(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_resume import Augmented, _epoch, _make
        torch.manual_seed(0)
        loader = _make(Augmented(30), 2)
        if sys.argv[1] == "save":
            it = iter(loader)
            _epoch(it, 4)
            torch.save(loader.state_dict(), sys.argv[2])
        else:
            loader.load_state_dict(torch.load(sys.argv[2], weights_only=True))
        print(_epoch(loader))
    """)
    path = os.fspath(tmp_path / "state.pt")
    run = lambda *a: subprocess.run([sys.executable, "-c", script, *a], check=True,  # noqa: E731
                                    capture_output=True, text=True).stdout
    run("save", path)
    rest = run("load", path)
    torch.manual_seed(0)
    expected = _epoch(_make(Augmented(30), 2))[4:]
    assert rest.strip() == str(expected)


@pytest.mark.heavy
def test_state_dict_before_iter_and_a_fresh_epoch() -> None:
    """A state saved before any iter() (or between epochs) starts a fresh epoch."""
    torch.manual_seed(0)
    expected = _epoch(_make(Augmented(12), 2))
    sd = _make(Augmented(12), 2).state_dict()
    torch.manual_seed(0)
    loader = _make(Augmented(12), 2)
    loader.load_state_dict(sd)
    assert _epoch(loader) == expected


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("nw", [0, 1, 3])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_resume_matrix(kind: str, nw: int, persistent: bool, prefetch: int) -> None:
    """Every combination, at random resume points (seeded: reproducible)."""
    rng = random.Random(f"{kind}{nw}{persistent}{prefetch}")
    ds = (lambda: Augmented(25)) if kind == "map" else (lambda: Stream(25))
    for _ in range(3):
        stop_epoch = rng.randint(0, 1)
        stop = rng.randint(0, 9)
        _check_resume(lambda: _make(ds(), nw, persistent_workers=persistent,
                                    prefetch_factor=prefetch), stop_epoch, stop)


@pytest.mark.parametrize("nw", [0, 2])
@pytest.mark.heavy
def test_resume_before_the_first_batch(nw: int) -> None:
    """A state saved right after iter(), before any batch: the whole epoch,
    in the saved order, whatever the resuming process's generator holds."""
    make = lambda: _make(Augmented(20), nw)  # noqa: E731
    _seed_all(0)
    loader = make()
    it = iter(loader)
    sd = _roundtrip(loader.state_dict())
    callers = _global_generators()
    full = _epoch(it)
    resumed = make()
    resumed.load_state_dict(sd)
    _seed_all(77)
    it = iter(resumed)
    _set_global_generators(callers)
    assert _epoch(it) == full


def test_the_private_names_resume_relies_on() -> None:
    """torch's IterableDataset fetcher pulls from its ``dataset_iter``
    attribute (a resumed replica without state_dict() is counted and
    fast-forwarded through it); numpy's global generator's Mersenne Twister
    words are readable raw (the fast capture; with another layout the
    capture falls back to get_state(), and this test says so)."""
    from torch.utils.data import _DatasetKind

    from fastload.resume import book as resume

    fetcher = _DatasetKind.create_fetcher(_DatasetKind.Iterable, Stream(6), True,
                                          lambda b: [int(x[0]) for x in b], False)
    fetcher.dataset_iter = resume.CountingIter(fetcher.dataset_iter)
    assert fetcher.fetch([None, None]) == [0, 1]
    assert fetcher.dataset_iter.count == 2
    cap = resume.Capturer()
    assert cap._raw_address(np) is not None
    np.random.seed(3)
    first = cap.capture(0)[2]
    np.random.randn()  # leaves a cached Gaussian: only get_state() shows it
    second = cap.capture(0)[2]
    assert first != second and second[3] == 1


@pytest.mark.parametrize("nw", [0, 2])
def test_an_iter_that_fails_leaves_the_loaded_state(nw: int, monkeypatch) -> None:
    """An iter() that raises after taking the loaded state (here Ctrl-C while
    it starts) leaves it to the next iter(), which resumes there."""
    make = lambda: _make(Augmented(20), nw)  # noqa: E731
    _seed_all(0)
    loader = make()
    it = iter(loader)
    _epoch(it, 2)
    sd = _roundtrip(loader.state_dict())
    callers = _global_generators()
    rest = _epoch(it)
    del it, loader

    resumed = make()
    resumed.load_state_dict(sd)
    if nw:
        import fastload.iterator.multi_process as where
        target, name = where.FastLoaderIter, "_open_pool"
    else:
        import torch.utils.data.dataloader as where
        target, name = where._SingleProcessDataLoaderIter, "__init__"

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(target, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        iter(resumed)
    monkeypatch.undo()
    it = iter(resumed)
    _set_global_generators(callers)
    assert _epoch(it) == rest
