"""FastLoader against torch.utils.data.DataLoader: same arguments, same seeds
-> the same batches, in the same order, with the same values, dtypes and
structure.

DataLoader runs with its platform default start method (fork on Linux: fast);
FastLoader spawns. Seeding does not depend on the start method: both draw the
workers' base seed from the same generator, so even randomness drawn inside
workers must match. Datasets and collate functions live in ``support.equality``
so spawned workers can import them.

Every FastLoader iterator starts worker processes (a second or two each), so
each test is built to need as few iterators as possible.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest
import torch
from torch.utils.data import (
    DataLoader,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from fastload import FastLoader
from fastload.debug import debug_view
from support import equality as eqd, torch_versions
from support.equality import assert_epochs_same, assert_same


too_many_workers_ok = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create .* worker processes in total:UserWarning"
)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
KwargsFn = Callable[[], Dict[str, Any]]


def run_loader(
    cls: type,
    dataset: Any,
    kwargs_fn: KwargsFn,
    *,
    epochs: int = 1,
    global_seed: int = 1234,
    extra: Optional[Dict[str, Any]] = None,
) -> Any:
    """Make one loader (fresh kwargs: generators and samplers are not shared)
    and collect ``epochs`` full epochs, each with ``list()`` so every batch
    stays alive until the comparison."""
    kw = dict(kwargs_fn())
    kw.update(extra or {})
    loader = cls(dataset, **kw)
    torch.manual_seed(global_seed)
    epochs_out = [list(loader) for _ in range(epochs)]
    return loader, epochs_out


def compare(
    dataset: Any,
    kwargs_fn: KwargsFn,
    *,
    epochs: int = 1,
    fl_extra: Optional[Dict[str, Any]] = None,
    dl_extra: Optional[Dict[str, Any]] = None,
) -> List[List[Any]]:
    """FastLoader and DataLoader with the same arguments give the same epochs."""
    dl, expected = run_loader(DataLoader, dataset, kwargs_fn, epochs=epochs, extra=dl_extra)
    fl, got = run_loader(FastLoader, dataset, kwargs_fn, epochs=epochs, extra=fl_extra)
    assert isinstance(fl, FastLoader)
    if hasattr(dataset, "__len__"):
        assert len(fl) == len(dl)
    assert_epochs_same(got, expected)
    if dl.generator is not None:  # both drew the same numbers from their generators
        assert torch.equal(fl.generator.get_state(), dl.generator.get_state())
    return got


def gen(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def failure(fn: Callable[[], Any]) -> Optional[str]:
    """Run ``fn``; describe what it raised, if anything.

    The exception (and its traceback, which holds the loaders and through
    them live worker processes) is dropped here, so a failing check in an
    xfail test cannot leak workers into the leak-checking fixture.
    """
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the caller
        return f"{type(e).__name__}: {e}"
    finally:
        gc.collect()
    return None


def assert_no_failure(err: Optional[str], known_symptom: str) -> None:
    """For the xfail tests (``raises=AssertionError``): passing, or failing
    with the known bug's symptom, are the expected outcomes; failing in any
    other way is reported as a plain failure (pytest.fail is not an
    AssertionError)."""
    if err is not None and known_symptom not in err:
        pytest.fail(f"failed, but not with the known symptom {known_symptom!r}: {err}")
    assert err is None, err


# ---------------------------------------------------------------------------
# map-style datasets: samplers, batching, workers, prefetching
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_workers, batch_size, drop_last, prefetch_factor",
    [
        (1, 4, False, 1),
        (2, 5, True, 2),
        (2, 3, False, 4),
        pytest.param(3, 4, True, 3, marks=too_many_workers_ok),
    ],
)
def test_shuffle_generator_worker_randomness(num_workers, batch_size, drop_last, prefetch_factor):
    """Nested samples + torch/random/numpy draws in workers + worker info and
    worker_init_fn side effects; shuffle with a seeded generator; 23 samples so
    the last batch is partial (or dropped)."""
    got = compare(
        eqd.NestedDataset(23, randomness=True),
        lambda: dict(
            batch_size=batch_size,
            shuffle=True,
            generator=gen(),
            num_workers=num_workers,
            drop_last=drop_last,
            prefetch_factor=prefetch_factor,
            worker_init_fn=eqd.worker_init,
        ),
    )
    batches = got[0]
    assert len(batches) == (23 // batch_size if drop_last else -(-23 // batch_size))
    worker = batches[0]["worker"]
    assert set(worker["wid"].tolist()) <= set(range(num_workers))
    assert (worker["nw"] == num_workers).all()
    assert torch.equal(worker["initial_seed"], worker["seed"])
    assert torch.equal(worker["init"], worker["wid"] * 10 + 7)
    seen = sorted(i for b in batches for i in b["idx"].tolist())
    assert len(seen) == len(set(seen))


def test_shuffle_global_seed_without_generator():
    """No generator: the sampler's permutation and the workers' base seed both
    come from the global torch RNG, seeded identically before each loader."""
    got = compare(
        eqd.RandomDataset(20),
        lambda: dict(batch_size=3, shuffle=True, num_workers=2),
    )
    assert [b["idx"].tolist() for b in got[0]] != [list(range(i, min(i + 3, 20))) for i in range(0, 20, 3)]
    assert all(b["is_replica"].all() for b in got[0])


def test_weighted_random_sampler():
    def kwargs() -> Dict[str, Any]:
        weights = torch.linspace(0.1, 2.0, 20)
        sampler = WeightedRandomSampler(weights, num_samples=25, replacement=True, generator=gen(5))
        return dict(batch_size=4, sampler=sampler, num_workers=2, generator=gen(11))

    compare(eqd.RandomDataset(20), kwargs)


def test_custom_batch_sampler_list():
    def kwargs() -> Dict[str, Any]:
        bs = [[3, 1, 4], [1, 5], [9, 2, 6, 5, 3], [5], [8, 9, 7, 9], [0], [19, 18]]
        return dict(batch_sampler=bs, num_workers=2, prefetch_factor=1)

    got = compare(eqd.RandomDataset(20), kwargs)
    assert [b["idx"].tolist() for b in got[0]][:3] == [[3, 1, 4], [1, 5], [9, 2, 6, 5, 3]]


def test_batch_size_none_subset_random_sampler():
    """No auto-collation: default_convert turns numpy arrays into tensors but
    leaves the rest as is; indices from a SubsetRandomSampler with its own
    generator (the loader's generator seeds the workers)."""
    got = compare(
        eqd.NestedDataset(20, randomness=True),
        lambda: dict(
            batch_size=None,
            sampler=SubsetRandomSampler([1, 3, 4, 8, 9, 11, 12, 15, 17, 18, 19], generator=gen(3)),
            generator=gen(11),
            num_workers=2,
        ),
    )
    sample = got[0][0]
    assert isinstance(sample["idx"], int) and isinstance(sample["np"], torch.Tensor)
    assert sorted(s["idx"] for s in got[0]) == [1, 3, 4, 8, 9, 11, 12, 15, 17, 18, 19]


def test_dtypes_layouts_and_custom_collate():
    """A custom collate returning a custom object that holds the default
    collate of bool/int8/float16/bfloat16/complex/... tensors, zero-size and
    0-dim tensors and numpy arrays, plus non-contiguous views of collated
    tensors, expanded/transposed tensors, a Parameter, numpy arrays (C,
    Fortran, strided, empty, str), bytes, None, ..."""

    def kwargs() -> Dict[str, Any]:
        return dict(batch_size=4, num_workers=2, collate_fn=eqd.weird_collate)

    ds = eqd.DtypeDataset(9)
    dl, expected = run_loader(DataLoader, ds, kwargs)
    fl, got = run_loader(FastLoader, ds, kwargs)
    # num_workers=0 is the reference for what DataLoader's workers get wrong:
    # they drop the conjugate bit of a lazily conjugated tensor (a torch bug),
    # so that one field is compared with the in-process result only.
    _, in_process = run_loader(DataLoader, ds, lambda: dict(kwargs(), num_workers=0))
    got_conj = [b.__dict__.pop("conj") for b in got[0]]
    for b in expected[0]:
        del b.conj
    ref_conj = [b.__dict__.pop("conj") for b in in_process[0]]
    for i, (g, r) in enumerate(zip(got_conj, ref_conj)):
        assert_same(g.resolve_conj(), r.resolve_conj(), f"batch {i}.conj")
    assert_epochs_same(got, expected)
    assert_epochs_same(got, in_process)
    assert len(got[0]) == 3


def test_variable_size_samples_list_collate():
    """Variable-size samples, a collate returning a list of tensors. (fork:
    the start method does not matter here, and forking is much faster.)"""
    compare(
        eqd.VarSizeDataset(17),
        lambda: dict(batch_size=4, shuffle=True, generator=gen(), num_workers=2,
                     collate_fn=eqd.list_collate,
                     multiprocessing_context=multiprocessing.get_context("fork")),
    )


def test_fork_context_random_batch_sampler():
    """An explicit fork context (FastLoader's ring handle is inherited), and a
    custom batch sampler drawing batch sizes and indices from a generator."""
    ctx = multiprocessing.get_context("fork")
    got = compare(
        eqd.NestedDataset(20, randomness=True),
        lambda: dict(batch_sampler=eqd.RandomBatchSampler(20, num_batches=9, generator=gen(21)),
                     generator=gen(), num_workers=2, multiprocessing_context=ctx,
                     worker_init_fn=eqd.worker_init),
    )
    assert len({len(b["idx"]) for b in got[0]}) > 1


# ---------------------------------------------------------------------------
# in_order=False
# ---------------------------------------------------------------------------
@torch_versions.needs_in_order
def test_in_order_false_same_multiset():
    """Out-of-order delivery: the same batches, in any order."""

    def kwargs() -> Dict[str, Any]:
        return dict(batch_size=3, shuffle=True, generator=gen(), num_workers=2,
                    prefetch_factor=3, in_order=False)

    ds = eqd.NestedDataset(25)
    _, (expected,) = run_loader(DataLoader, ds, kwargs)
    fl, (got,) = run_loader(FastLoader, ds, kwargs)
    assert len(fl) == len(got) == len(expected) == 9

    def key(b: Any) -> int:
        return b["idx"][0].item()

    got.sort(key=key)
    expected.sort(key=key)
    for i, (g, x) in enumerate(zip(got, expected)):
        assert_same(g, x, f"batch {i} (sorted)")


# ---------------------------------------------------------------------------
# persistent workers
# ---------------------------------------------------------------------------
def test_persistent_workers_three_epochs():
    """Workers stay up: per-worker RNG streams continue across epochs, the
    sampler reshuffles, worker_init_fn runs once."""
    got = compare(
        eqd.RandomDataset(14),
        lambda: dict(batch_size=3, shuffle=True, generator=gen(), num_workers=2,
                     persistent_workers=True, worker_init_fn=eqd.worker_init),
        epochs=3,
    )
    orders = [[i for b in epoch for i in b["idx"].tolist()] for epoch in got]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(14))
    assert not torch.equal(got[0][0]["torch"], got[1][0]["torch"])


@pytest.mark.heavy
def test_persistent_workers_epochs_left_early():
    """``break`` out of epochs of a persistent loader, then run full epochs:
    the next epoch must wait out and free what the previous one left in
    flight (before commit 9e001ed, _drain() did not free those slots:
    "AssertionError: fastload: no free slot for a new task")."""

    def kwargs() -> Dict[str, Any]:
        return dict(batch_size=2, shuffle=True, generator=gen(), num_workers=2,
                    persistent_workers=True)

    def take(cls: type) -> List[Any]:
        loader = cls(eqd.RandomDataset(30), **kwargs())
        out = []
        for _ in range(3):
            for b in loader:
                out.append(b)
                break
        out.append(list(loader))
        out.append(list(loader))
        return out

    def check() -> None:
        assert_same(take(FastLoader), take(DataLoader))

    err = failure(check)
    assert err is None, err


def test_persistent_workers_iterable_epochs():
    """Tasks sent to exhausted workers are still in flight when an epoch of an
    IterableDataset ends; the next epoch must wait them out and free them."""

    def check() -> None:
        compare(
            eqd.ShardedIterable([6, 6]),
            lambda: dict(batch_size=2, num_workers=2, persistent_workers=True),
            epochs=4,
        )

    err = failure(check)
    assert err is None, err


# ---------------------------------------------------------------------------
# IterableDataset
# ---------------------------------------------------------------------------
@pytest.mark.heavy
def test_iterable_even_shards_exact_order():
    """Equal shards: round-robin over workers gives one possible order."""
    got = compare(
        eqd.ShardedIterable([7, 7]),
        lambda: dict(batch_size=3, num_workers=2),
    )
    assert [len(b["i"]) for b in got[0]] == [3, 3, 3, 3, 1, 1]


@pytest.mark.heavy
def test_iterable_uneven_shards_same_multiset():
    """Unequal shards: the same batches; each worker's own batches in order."""

    def kwargs() -> Dict[str, Any]:
        return dict(batch_size=2, num_workers=2)

    ds = eqd.ShardedIterable([9, 4])
    _, (expected,) = run_loader(DataLoader, ds, kwargs)
    _, (got,) = run_loader(FastLoader, ds, kwargs)
    assert len(got) == len(expected) == 5 + 2
    for wid in (0, 1):
        mine_g = [b for b in got if b["wid"][0].item() == wid]
        mine_x = [b for b in expected if b["wid"][0].item() == wid]
        for i, (g, x) in enumerate(zip(mine_g, mine_x)):
            assert_same(g, x, f"worker {wid} batch {i}")
        assert len(mine_g) == len(mine_x)
    assert Counter(tuple(b["i"].tolist()) for b in got) == Counter(
        tuple(b["i"].tolist()) for b in expected
    )


def test_iterable_unsharded_duplicates():
    """No sharding: every worker yields the whole stream, as with DataLoader."""
    got = compare(
        eqd.UnshardedIterable(7),
        lambda: dict(batch_size=3, num_workers=2),
    )
    assert [b["i"].tolist() for b in got[0]] == [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2 + [[6]] * 2
    assert [b["wid"][0].item() for b in got[0]] == [0, 1] * 3


def test_iterable_sharded_by_worker_init_fn():
    """torch's documented pattern: worker_init_fn reshapes the worker's replica
    through get_worker_info().dataset."""
    got = compare(
        eqd.RangeIterable(3, 17),
        lambda: dict(batch_size=3, num_workers=2, worker_init_fn=eqd.shard_range_init),
    )
    assert [b.tolist() for b in got[0]] == [
        [3, 4, 5], [10, 11, 12], [6, 7, 8], [13, 14, 15], [9], [16]
    ]


# ---------------------------------------------------------------------------
# large batches, the overflow path, batches kept alive
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "slot_bytes, collate",
    [(None, None), (1 << 20, None), (1 << 20, "mixed")],
    ids=["default-slot", "overflow", "overflow-mixed"],
)
@pytest.mark.heavy
def test_large_samples(slot_bytes, collate):
    """~20 MB samples, 2 per batch: 40 MB batches fit fastload's default slot;
    with 1 MiB slots they go through the overflow segment; the mixed collate
    adds numpy arrays and a pickle meta larger than the slot. 3 batches kept
    alive with held_batches=1 -> the later ones are copied out of the ring."""
    collate_fn = eqd.big_mixed_collate if collate else None
    extra: Dict[str, Any] = {"held_batches": 1}
    if slot_bytes:
        extra["slot_bytes"] = slot_bytes
    got = compare(
        eqd.BigDataset(5),
        lambda: dict(batch_size=2, num_workers=2, collate_fn=collate_fn),
        fl_extra=extra,
    )
    assert len(got[0]) == 3
    if collate is None:
        b = got[0][0]["big"]
        assert b.shape == (2, 5_000_000) and b[1, 1].item() == 1.0 and b[1, 997].item() == -1.0


@pytest.mark.heavy
def test_empty_numpy_array_with_overflow():
    def check() -> None:
        compare(
            eqd.IndexDataset(3),
            lambda: dict(batch_size=None, num_workers=1, collate_fn=eqd.empty_and_big_numpy_collate),
            fl_extra={"slot_bytes": 1 << 20},
        )

    err = failure(check)
    assert_no_failure(err, "TypeError: 'NoneType' object is not subscriptable")


def test_batches_kept_alive_are_not_overwritten():
    """Keep every 3rd batch (and modify it in place), keep only a view of a
    tensor of others, drop the rest: everything kept still holds its values
    once the epoch is over."""

    def kwargs() -> Dict[str, Any]:
        return dict(batch_size=2, shuffle=True, generator=gen(), num_workers=2,
                    worker_init_fn=eqd.worker_init)

    ds = eqd.NestedDataset(40, randomness=True)
    _, (expected,) = run_loader(DataLoader, ds, kwargs)
    loader = FastLoader(ds, **kwargs())
    torch.manual_seed(1234)
    kept: Dict[int, Any] = {}
    views: Dict[int, torch.Tensor] = {}
    for i, b in enumerate(loader):
        if i % 3 == 0:
            b["x"].add_(1000)
            kept[i] = b
        elif i % 3 == 1:
            views[i] = b["rand"]["torch"][1:]
    assert len(expected) == 20 and sorted(kept) == list(range(0, 20, 3))
    for i, b in kept.items():
        expected[i]["x"].add_(1000)
        assert_same(b, expected[i], f"kept batch {i}")
    for i, v in views.items():
        assert_same(v, expected[i]["rand"]["torch"][1:], f"view of batch {i}")


def test_same_loader_iterated_twice():
    """A non-persistent loader iterated twice: new workers, new base seed and
    permutation from the same generator, as with DataLoader."""
    got = compare(
        eqd.NestedDataset(13, randomness=True),
        lambda: dict(batch_size=4, shuffle=True, generator=gen(), num_workers=2),
        epochs=2,
    )
    assert got[0][0]["rand"]["py"].tolist() != got[1][0]["rand"]["py"].tolist()


# ---------------------------------------------------------------------------
# several iterators of one loader (fastload keeps a non-persistent loader's
# workers warm between iterators and re-sends the dataset and seeds)
# ---------------------------------------------------------------------------
def take_epochs_left_early(cls: type, ds: Any, extra: Dict[str, Any]) -> List[Any]:
    """``break`` after one batch, twice, then a full epoch, then a break after
    the last batch, then a full epoch."""
    loader = cls(ds, batch_size=2, shuffle=True, generator=gen(), num_workers=2, **extra)
    out: List[Any] = []
    for _ in range(2):
        for b in loader:
            out.append(b)
            break
    out.append(list(loader))
    for i, b in enumerate(loader):
        if i == len(loader) - 1:
            out.append(b)
            break
    out.append(list(loader))
    return out


@pytest.mark.heavy
def test_epochs_left_early_then_full():
    """Every new iterator behaves like a fresh DataLoader one, whatever the
    previous iterator left in flight."""
    ds = eqd.RandomDataset(30)

    def check() -> None:
        assert_same(take_epochs_left_early(FastLoader, ds, {}),
                    take_epochs_left_early(DataLoader, ds, {}))

    err = failure(check)
    assert err is None, err


def overflow_fds() -> Dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if "fastload-overflow" in target:
            out[int(name)] = target
    return out


@pytest.mark.heavy
def test_overflow_batches_left_early(tmp_path):
    """1 MiB slots: every batch goes through an overflow segment. Batch 1 is
    ready before batch 0 (sample 0 waits for it), so when the first iterator is
    dropped after batch 0, batch 1 is done but unclaimed. Then a full epoch.
    Batches must match DataLoader's, and every overflow segment must be
    closed once the loader is gone."""
    ds = eqd.SlowFirstBigDataset(8, numel=300_000, marker=str(tmp_path / "batch1-made"))
    before = set(overflow_fds())

    def run(cls: type, extra: Dict[str, Any]) -> List[Any]:
        loader = cls(ds, batch_size=2, num_workers=2, **extra)
        out = []
        for b in loader:
            out.append(b)
            break
        out.append(list(loader))
        return out

    def check() -> None:
        assert_same(run(FastLoader, {"slot_bytes": 1 << 20}), run(DataLoader, {}))

    err = failure(check)
    assert err is None, err
    leaked = {fd: t for fd, t in overflow_fds().items() if fd not in before}
    for fd in leaked:  # close them: the leak fixture need not report them again
        os.close(fd)
    assert not leaked, f"overflow segments left open: {leaked}"


@pytest.mark.slow  # waits out DataLoader's 5 s for a stuck worker
def test_a_stuck_sample_left_behind_does_not_hold_up_the_next_epoch(tmp_path):
    """The loop breaks out of an epoch while a worker is stuck in a sample
    (20 s, the first time only). DataLoader's next epoch waits up to 5 s for
    the dropped iterator's workers; fastload's kills them at once (its next
    session replaces them anyway) and frees their slots. The next epoch is
    whole and the same."""
    from support.faults import Misbehave

    def run(cls: type) -> tuple:
        ds = Misbehave(16, {6: "sleep"}, seconds=20, once=os.fspath(tmp_path / cls.__name__))
        loader = cls(ds, batch_size=2, num_workers=2, prefetch_factor=4)
        for k, _b in enumerate(loader):
            if k == 1:
                while not (tmp_path / cls.__name__).exists():  # a worker is in the sample
                    time.sleep(0.01)
                t0 = time.monotonic()
                break  # DataLoader shuts its workers down here, fastload at the next iter()
        epoch = [b.clone() for b in loader]
        return epoch, time.monotonic() - t0

    got, took = run(FastLoader)
    want, dl_took = run(DataLoader)
    assert_same(got, want)
    assert dl_took > 4.0  # DataLoader waits for its stuck worker, then terminates it
    assert took < dl_took / 2, (took, dl_took)


@pytest.mark.heavy
def test_two_iterators_alive_at_once():
    """Two iterators of one loader, consumed interleaved: independent, each
    seeded from the generator when it is made, as with DataLoader."""

    def run(cls: type) -> Any:
        loader = cls(eqd.RandomDataset(12), batch_size=2, shuffle=True, generator=gen(),
                     num_workers=2)
        it1 = iter(loader)
        first = [next(it1)]
        it2 = iter(loader)
        second = [next(it2)]
        first.append(next(it1))
        second += list(it2)
        first += list(it1)
        return first, second

    def check() -> None:
        assert_same(run(FastLoader), run(DataLoader))

    err = failure(check)
    assert err is None, err


def test_dataset_changed_between_epochs():
    """A non-persistent loader's workers see the dataset as it is when each
    iterator starts (DataLoader starts new workers; fastload keeps them warm
    and re-sends the dataset)."""
    def run(cls: type, extra: Dict[str, Any]) -> Any:
        ds = eqd.NestedDataset(9, randomness=True)
        loader = cls(ds, batch_size=4, shuffle=True, generator=gen(), num_workers=2,
                     worker_init_fn=eqd.worker_init, **extra)
        out = [list(loader)]
        ds.n = 6  # shorter: the sampler sees it too
        out.append(list(loader))
        return out

    got = run(FastLoader, {})
    expected = run(DataLoader, {})
    assert_epochs_same(got, expected)
    assert sum(len(b["idx"]) for b in got[1]) == 6


@pytest.mark.heavy
def test_tensor_kept_by_dataset_in_worker():
    """A dataset that builds items with default_collate and caches them: the
    second visit of an index must return the same values as the first."""

    def check() -> None:
        compare(
            eqd.CachingCollateDataset(12),
            lambda: dict(batch_size=None, sampler=list(range(12)) * 2, num_workers=1),
        )

    err = failure(check)
    assert_no_failure(err, 'values differ')


# ---------------------------------------------------------------------------
# len()
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(batch_size=4),
        dict(batch_size=4, drop_last=True),
        dict(batch_size=5, drop_last=True, num_workers=2),
        dict(batch_size=None),
        dict(batch_size=3, shuffle=True, num_workers=1),
        dict(batch_sampler=[[1, 2], [3], [4, 5, 6]]),
        dict(sampler=SubsetRandomSampler(list(range(7))), batch_size=2),
    ],
)
def test_len_matches(kwargs):
    ds = eqd.IndexDataset(23)
    assert len(FastLoader(ds, **kwargs)) == len(DataLoader(ds, **kwargs))


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_matches_iterable(drop_last):
    ds = eqd.SizedIterable(n=10, reported=10)
    for bs in (None, 1, 3):
        kw = dict(batch_size=bs) if bs is None else dict(batch_size=bs, drop_last=drop_last)
        assert len(FastLoader(ds, num_workers=2, **kw)) == len(DataLoader(ds, num_workers=2, **kw))


def test_aliasing_within_a_batch():
    """``{"x": t, "x_again": t, "x_tail": t[:, 1:]}``: DataLoader's batch has
    ``x_again is x`` and in-place writes to ``x`` show through the view."""

    def aliasing(b: Dict[str, torch.Tensor]) -> Dict[str, bool]:
        seen = {f"{k}_is_same_object": b[f"{k}_again"] is b[k] for k in ("x", "y")}
        for k in ("x", "y"):
            b[k][0, 1] = -7
            seen[f"{k}_again_sees_write"] = b[f"{k}_again"][0, 1].item() == -7
            seen[f"{k}_tail_sees_write"] = b[f"{k}_tail"][0, 0].item() == -7
        return seen

    def check() -> None:
        kw = dict(batch_size=4, num_workers=1, collate_fn=eqd.aliasing_collate)
        expected = aliasing(next(iter(DataLoader(eqd.IndexDataset(4), **kw))))
        assert all(expected.values()), expected
        got = aliasing(next(iter(FastLoader(eqd.IndexDataset(4), **kw))))
        assert got == expected, f"aliasing differs: {got}"

    err = failure(check)
    assert_no_failure(err, "aliasing differs")


def test_assert_same_detects_differences():
    """The comparison helper itself: each pair below must be told apart."""
    t = torch.arange(4)
    pairs = [
        (t, t.to(torch.int32)),
        (t, t.reshape(2, 2)),
        (t, t + 1),
        (t.float(), t.float().requires_grad_()),
        (np.arange(3), np.arange(3.0)),
        (np.arange(3), np.arange(1, 4)),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        (eqd.Point(1, 2), (1, 2)),
        ([1, 2], (1, 2)),
        ([1, 2], [1, 2, 3]),
        ("a", b"a"),
        (1, 1.0),
        (1, True),
        (None, 0),
        (eqd.Box(a=t), eqd.Box(a=t + 1)),
        (torch.eye(2).to_sparse(), (2 * torch.eye(2)).to_sparse()),
    ]
    for a, b in pairs:
        with pytest.raises(AssertionError):
            assert_same(a, b)
    assert_same({"a": [eqd.Point(t, "x")], "b": np.ones(2)}, {"a": [eqd.Point(t.clone(), "x")], "b": np.ones(2)})


class _Big(torch.utils.data.Dataset):
    """1 MiB float32 samples: a batch of 4 is 4 MiB."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 18,), float(i))


@pytest.mark.parametrize("prefetch_factor", [1, 2, 3])
@pytest.mark.heavy
def test_batches_keep_to_fewest_slots(prefetch_factor: int) -> None:
    """A slot's pages stay committed once a batch was written there, so the
    ring's memory is the number of distinct slots batches used. A loop that
    keeps only the batch in hand needs workers * prefetch_factor + 1 of them
    (+ 2 with prefetch_factor=1, whose refill goes out at once); the ring has
    more (held_batches spare) and they stay untouched. The memfd's allocated
    blocks are the measure."""
    batch = 4 << 20
    loader = FastLoader(_Big(), batch_size=4, num_workers=2, prefetch_factor=prefetch_factor,
                        persistent_workers=True)
    try:
        for _ in range(2):
            n = 0
            for b in loader:
                assert b[0, 0].item() == 4 * n
                n += 1
            assert n == 16
        del b
        ring = debug_view(loader).iterator.ring
        used = os.fstat(ring.fd).st_blocks * 512
        need = 2 * prefetch_factor + (1 if prefetch_factor > 1 else 2)
        assert ring.num_slots > need
        assert (need - 1) * batch < used <= need * batch + (1 << 20), (used / batch, need)
        del ring
    finally:
        del loader
        gc.collect()


def test_loop_stopping_after_len_batches_keeps_the_pool_warm():
    # Lightning's loop stops after len(loader) batches and keeps the old
    # iterator while it makes the next: the pool goes back at the last batch.
    loader = FastLoader(torch.arange(8), batch_size=2, num_workers=2)
    want = [b.tolist() for b in DataLoader(torch.arange(8), batch_size=2)]
    ring = None
    for _ in range(3):
        it = iter(loader)
        assert [next(it).tolist() for _ in range(len(loader))] == want
        idle = debug_view(loader).idle_pool
        assert idle is not None
        ring = ring or idle.ring
        assert idle.ring == ring  # the same warm pool (its workers fresh each epoch)
    assert list(it) == []
    del ring
