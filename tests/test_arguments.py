"""FastLoader's argument handling against torch.utils.data.DataLoader.

Bad arguments raise the same exception type with the same message; warnings
are the same; attributes, len() and the signature are the same; fastload's
own options (slot_bytes, held_batches) are validated with ValueErrors naming
them.
"""

from __future__ import annotations

import inspect
import multiprocessing
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)
from torch.utils.data.dataloader import _InfiniteConstantSampler

from fastload import FastLoader
from support import equality as eqd
from support import torch_versions


MAP = eqd.IndexDataset(10)
ITER = eqd.SizedIterable(n=5, reported=5)
SAMPLER = SubsetRandomSampler([0, 1, 2])
BATCH_SAMPLER = BatchSampler(SequentialSampler(range(10)), 3, False)
CONTEXT_OBJECT = object()


def raised(fn: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def both_raise(*args: Any, **kwargs: Any) -> Tuple[BaseException, BaseException]:
    """Construct DataLoader and FastLoader alike; both must raise: (dl_exc, fl_exc)."""
    dl = raised(lambda: DataLoader(*args, **kwargs))
    fl = raised(lambda: FastLoader(*args, **kwargs))
    return dl, fl


# (dataset, kwargs) that DataLoader's constructor rejects.
BAD_ARGS: Dict[str, Tuple[Any, Dict[str, Any]]] = {
    "num_workers<0": (MAP, dict(num_workers=-1)),
    "num_workers<0 before timeout<0": (MAP, dict(num_workers=-2, timeout=-1)),
    "num_workers-not-a-number": (MAP, dict(num_workers="2")),
    "timeout<0": (MAP, dict(timeout=-0.5)),
    "timeout-not-a-number": (MAP, dict(timeout="1")),
    "prefetch_factor-without-workers": (MAP, dict(prefetch_factor=2)),
    "prefetch_factor=0-without-workers": (MAP, dict(prefetch_factor=0)),
    "prefetch_factor<0": (MAP, dict(num_workers=2, prefetch_factor=-1)),
    "persistent_workers-without-workers": (MAP, dict(persistent_workers=True)),
    "iterable-shuffle=True": (ITER, dict(shuffle=True)),
    "iterable-shuffle-truthy": (ITER, dict(shuffle="yes")),
    "iterable-sampler": (ITER, dict(sampler=SAMPLER)),
    "iterable-batch_sampler": (ITER, dict(batch_sampler=BATCH_SAMPLER)),
    "iterable-shuffle-before-sampler": (ITER, dict(shuffle=True, sampler=SAMPLER)),
    "sampler-with-shuffle": (MAP, dict(sampler=SAMPLER, shuffle=True)),
    "batch_sampler-with-batch_size": (MAP, dict(batch_sampler=BATCH_SAMPLER, batch_size=2)),
    "batch_sampler-with-batch_size=None": (MAP, dict(batch_sampler=BATCH_SAMPLER, batch_size=None)),
    "batch_sampler-with-shuffle": (MAP, dict(batch_sampler=BATCH_SAMPLER, shuffle=True)),
    "batch_sampler-with-sampler": (MAP, dict(batch_sampler=BATCH_SAMPLER, sampler=SAMPLER)),
    "batch_sampler-with-drop_last": (MAP, dict(batch_sampler=BATCH_SAMPLER, drop_last=True)),
    "batch_size=None-with-drop_last": (MAP, dict(batch_size=None, drop_last=True)),
    "context-bad-string": (MAP, dict(num_workers=2, multiprocessing_context="threads")),
    "context-bad-type-int": (MAP, dict(num_workers=2, multiprocessing_context=123)),
    "context-bad-type-object": (MAP, dict(num_workers=2, multiprocessing_context=CONTEXT_OBJECT)),
    "context-without-workers": (MAP, dict(multiprocessing_context="spawn")),
    "context-object-without-workers": (
        MAP, dict(multiprocessing_context=multiprocessing.get_context("spawn"))
    ),
    "unknown-keyword": (MAP, dict(num_worker=2)),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_same_error(case):
    dataset, kwargs = BAD_ARGS[case]
    dl, fl = both_raise(dataset, **kwargs)
    assert type(fl) is type(dl)
    # DataLoader's arguments go to the installed DataLoader as given, so one
    # it does not take fails there, in its own words.
    assert str(fl) == str(dl)


def test_too_many_positional_arguments():
    args = [MAP] + [None] * 13  # DataLoader takes dataset + 12 positional
    dl, fl = both_raise(*args)
    assert type(fl) is type(dl) is TypeError
    assert str(fl) == str(dl)


# torch's own iterator, failing in __init__, then fails again in __del__.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function _MultiProcessingDataLoaderIter.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)
def test_prefetch_factor_zero_fails_at_iteration():
    """prefetch_factor=0 passes the constructor (it is non-negative) and fails
    when an iterator with workers is made, before any worker starts."""
    kw = dict(num_workers=2, prefetch_factor=0)
    dl = raised(lambda: iter(DataLoader(MAP, **kw)))
    fl = raised(lambda: iter(FastLoader(MAP, **kw)))
    assert type(fl) is type(dl) is AssertionError
    assert str(fl).startswith("prefetch_factor must be greater than 0")
    # Older torch (2.1) asserts it bare, with no message.
    assert str(dl).startswith("prefetch_factor must be greater than 0") or str(dl) == ""


@pytest.mark.parametrize(
    "attr, value",
    [
        ("batch_size", 3),
        ("sampler", SAMPLER),
        ("batch_sampler", BATCH_SAMPLER),
        ("drop_last", True),
        ("dataset", MAP),
        ("persistent_workers", False),
    ],
)
def test_setting_frozen_attribute_after_init(attr, value):
    dl_loader, fl_loader = DataLoader(MAP), FastLoader(MAP)
    dl = raised(lambda: setattr(dl_loader, attr, value))
    fl = raised(lambda: setattr(fl_loader, attr, value))
    assert type(fl) is type(dl) is ValueError
    # DataLoader's message names the class of the loader.
    assert str(dl) == f"{attr} attribute should not be set after DataLoader is initialized"
    assert str(fl) == f"{attr} attribute should not be set after FastLoader is initialized"


def test_setting_other_attributes_after_init():
    """What DataLoader lets one change after init, FastLoader does too."""
    for cls in (DataLoader, FastLoader):
        loader = cls(MAP, num_workers=2)
        loader.num_workers = 1
        loader.timeout = 5.0
        loader.collate_fn = eqd.list_collate
        loader.prefetch_factor = 3
        loader.multiprocessing_context = "spawn"
        assert loader.multiprocessing_context is torch.multiprocessing.get_context("spawn")
        assert (loader.num_workers, loader.timeout, loader.prefetch_factor) == (1, 5.0, 3)


@pytest.mark.parametrize(
    "value, exc_type",
    [("threads", ValueError), (3.5, TypeError), (None, None)],
)
def test_setting_multiprocessing_context_after_init(value, exc_type):
    """The property setter validates later assignments too."""
    dl_loader, fl_loader = DataLoader(MAP, num_workers=1), FastLoader(MAP, num_workers=1)
    if exc_type is None:
        dl_loader.multiprocessing_context = value
        fl_loader.multiprocessing_context = value
        assert fl_loader.multiprocessing_context is dl_loader.multiprocessing_context is None
        return
    dl = raised(lambda: setattr(dl_loader, "multiprocessing_context", value))
    fl = raised(lambda: setattr(fl_loader, "multiprocessing_context", value))
    assert type(fl) is type(dl) is exc_type
    assert str(fl) == str(dl)


# ---------------------------------------------------------------------------
# fastload's own options
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, -(1 << 20), 1.5, float(1 << 20), "1048576", [], object()])
def test_bad_slot_bytes(value):
    with pytest.raises(ValueError, match=r"slot_bytes") as info:
        FastLoader(MAP, num_workers=1, slot_bytes=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [0, -1, 1.5, 2.0, "2", None, []])
def test_bad_held_batches(value):
    with pytest.raises(ValueError, match=r"held_batches") as info:
        FastLoader(MAP, num_workers=1, held_batches=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(slot_bytes=1), dict(slot_bytes=1 << 30), dict(held_batches=1),
                                    dict(held_batches=100), dict(slot_bytes=None, held_batches=2)])
def test_good_fastload_options(kwargs):
    loader = FastLoader(MAP, num_workers=1, **kwargs)
    for k, v in kwargs.items():
        assert getattr(loader, k) == v


def test_fastload_options_are_keyword_only():
    params = inspect.signature(FastLoader).parameters
    for name in ("slot_bytes", "held_batches", "allow_gpu_in_workers"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY


FASTLOAD_OPTIONS = ["allow_gpu_in_workers", "slot_bytes", "held_batches", "reuse_workers",
                    "hang_timeout", "max_worker_restarts", "device"]


def test_signature_extends_dataloaders():
    """Every parameter of the installed torch's DataLoader, in the same place,
    kind and default, then fastload's options, keyword-only: nothing else."""
    dl = list(inspect.signature(DataLoader).parameters.values())
    fl = list(inspect.signature(FastLoader).parameters.values())
    for d, f in zip(dl, fl):
        assert (f.name, f.kind, f.default) == (d.name, d.kind, d.default)
    assert [p.name for p in fl[len(dl):]] == FASTLOAD_OPTIONS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in fl[len(dl):])


# DataLoader arguments of newer torch than the oldest fastload supports.
NEWER_ARGUMENTS = {"in_order": False}


@pytest.mark.parametrize("name", list(NEWER_ARGUMENTS))
def test_an_argument_this_torch_lacks_fails_as_in_dataloader(name):
    """An argument the installed DataLoader does not take is not passed on
    quietly: DataLoader's own TypeError, where DataLoader raises it."""
    kwargs = {name: NEWER_ARGUMENTS[name], "num_workers": 2}
    if name in torch_versions.DATALOADER_PARAMS:
        assert getattr(FastLoader(MAP, **kwargs), name) == getattr(DataLoader(MAP, **kwargs), name)
        return
    dl, fl = both_raise(MAP, **kwargs)
    assert type(fl) is type(dl) is TypeError
    assert str(fl) == str(dl) == f"DataLoader.__init__() got an unexpected keyword argument '{name}'"
    assert f"DataLoader takes {name}= from torch " in "".join(getattr(fl, "__notes__", ()))


# ---------------------------------------------------------------------------
# warnings
# ---------------------------------------------------------------------------
def recorded(fn: Callable[[], Any]) -> Tuple[Any, List[Tuple[type, str]]]:
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        result = fn()
    return result, [(w.category, str(w.message)) for w in ws]


# torch with torch.accelerator warns that pin_memory has no accelerator to pin
# for; older torch (2.1) silently does not pin.
PIN_WARNINGS = 1 if torch_versions.HAS_ACCELERATOR_API else 0


def test_pin_memory_without_accelerator_warns_in_process():
    if torch_versions.accelerator_available():
        pytest.skip("an accelerator is available: pin_memory does not warn")
    if PIN_WARNINGS:
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator"):
            fl_batches = list(FastLoader(MAP, batch_size=4, pin_memory=True))
    dl_batches, dl_w = recorded(lambda: list(DataLoader(MAP, batch_size=4, pin_memory=True)))
    fl_batches, fl_w = recorded(lambda: list(FastLoader(MAP, batch_size=4, pin_memory=True)))
    assert fl_w == dl_w and len(dl_w) == PIN_WARNINGS
    assert all(torch.equal(a, b) for a, b in zip(fl_batches, dl_batches))
    kw = dict(batch_size=4, pin_memory=True, pin_memory_device="cpu")
    if not torch_versions.HAS_ACCELERATOR_API:
        # Older torch (2.1) pins for the device named, and has no CPU pinning.
        dl = raised(lambda: list(DataLoader(MAP, **kw)))
        fl = raised(lambda: list(FastLoader(MAP, **kw)))
        assert type(fl) is type(dl) and str(fl) == str(dl)
        return
    # The deprecated pin_memory_device adds its own warning, first.
    _, dl_w = recorded(lambda: list(DataLoader(MAP, **kw)))
    _, fl_w = recorded(lambda: list(FastLoader(MAP, **kw)))
    assert fl_w == dl_w and len(dl_w) == 2


def test_pin_memory_without_accelerator_warns_with_workers():
    if torch_versions.accelerator_available():
        pytest.skip("an accelerator is available: pin_memory does not warn")
    kw = dict(batch_size=4, pin_memory=True, num_workers=2)
    dl_batches, dl_w = recorded(lambda: list(DataLoader(MAP, **kw)))
    fl_batches, fl_w = recorded(lambda: list(FastLoader(MAP, **kw)))
    assert fl_w == dl_w and len(dl_w) == PIN_WARNINGS
    assert len(fl_batches) == len(dl_batches) == 3
    assert all(torch.equal(a, b) for a, b in zip(fl_batches, dl_batches))
    assert not any(b.is_pinned() for b in fl_batches)


def test_too_many_workers_warns_at_construction():
    cpus = torch_versions.cpu_count()
    n = max(64, cpus + 1)
    dl_loader, dl_w = recorded(lambda: DataLoader(MAP, num_workers=n))
    fl_loader, fl_w = recorded(lambda: FastLoader(MAP, num_workers=n))
    assert len(dl_w) == 1 and dl_w[0][1].startswith(f"This DataLoader will create {n} worker processes")
    assert fl_w == dl_w
    with pytest.warns(UserWarning, match=f"will create {n} worker processes in total"):
        FastLoader(MAP, num_workers=n)
    # Asking again gives the same warning (the check runs again for each iterator).
    _, dl_w2 = recorded(dl_loader.check_worker_number_rationality)
    _, fl_w2 = recorded(fl_loader.check_worker_number_rationality)
    assert fl_w2 == dl_w2 == dl_w


def test_enough_cpus_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FastLoader(MAP, num_workers=1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_longer_than_its_len_warns(num_workers):
    """After len(loader), yielding more samples than reported warns once per
    extra batch, with the multi-process hint when there are workers."""
    # Unsharded with 2 workers: each yields all 5 -> 10 batches for a len of 5.
    ds = eqd.SizedIterable(n=5 if num_workers else 7, reported=5)

    def run(cls: type) -> Any:
        loader = cls(ds, batch_size=1, num_workers=num_workers)
        assert len(loader) == 5
        return [b.item() for b in loader]

    dl_items, dl_w = recorded(lambda: run(DataLoader))
    fl_items, fl_w = recorded(lambda: run(FastLoader))
    assert fl_items == dl_items
    assert fl_w == dl_w
    expected_n = 5 if num_workers else 2
    assert len(dl_w) == expected_n and all(c is UserWarning for c, _ in dl_w)
    assert all(m.startswith(f"Length of IterableDataset {ds} was reported to be 5") for _, m in dl_w)
    assert all(("For multiprocessing data-loading" in m) == bool(num_workers) for _, m in dl_w)


def test_iterable_len_not_called_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [b.item() for b in FastLoader(eqd.SizedIterable(n=7, reported=5))] == list(range(7))


# ---------------------------------------------------------------------------
# class, attributes, len()
# ---------------------------------------------------------------------------
def test_type_subscription_and_subclass():
    alias = FastLoader[list]
    assert alias.__origin__ is FastLoader
    assert isinstance(alias(MAP), FastLoader)
    assert issubclass(FastLoader, DataLoader)
    assert isinstance(FastLoader(MAP), DataLoader)
    assert isinstance(FastLoader(ITER, num_workers=1), DataLoader)


def assert_same_sampler(a: Any, b: Any) -> None:
    """Samplers built by each loader: same type and same (shallow) state."""
    if a is b:
        return
    assert type(a) is type(b)
    if isinstance(a, (list, tuple)):
        assert a == b
        return
    va, vb = vars(a), vars(b)
    assert va.keys() == vb.keys()
    for k in va:
        if k == "sampler":
            assert_same_sampler(va[k], vb[k])
        else:
            assert va[k] is vb[k] or va[k] == vb[k], k


ATTRS = (
    "dataset",
    "batch_size",
    "drop_last",
    "num_workers",
    "prefetch_factor",
    "timeout",
    "collate_fn",
    "generator",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory",
    "pin_memory_device",
    *(("in_order",) if torch_versions.HAS_IN_ORDER else ()),
    "worker_init_fn",
    "_dataset_kind",
    "_auto_collation",
    "_IterableDataset_len_called",
)

GEN = torch.Generator().manual_seed(0)

ATTR_CASES: Dict[str, Tuple[Any, Dict[str, Any]]] = {
    "defaults": (MAP, {}),
    "shuffle": (MAP, dict(batch_size=4, shuffle=True, generator=GEN, drop_last=True)),
    "workers-default-prefetch": (MAP, dict(num_workers=2)),
    "workers-everything": (
        MAP,
        dict(num_workers=2, prefetch_factor=5, persistent_workers=True, timeout=3.5,
             worker_init_fn=eqd.worker_init, multiprocessing_context="spawn",
             pin_memory=False, batch_size=3, shuffle=False,
             **({"in_order": False} if torch_versions.HAS_IN_ORDER else {})),
    ),
    "context-object": (MAP, dict(num_workers=1, multiprocessing_context=multiprocessing.get_context("fork"))),
    "batch_sampler": (MAP, dict(batch_sampler=BATCH_SAMPLER)),
    "batch_sampler-list": (MAP, dict(batch_sampler=[[0, 1], [2]])),
    "sampler-no-batching": (MAP, dict(sampler=SAMPLER, batch_size=None, collate_fn=eqd.list_collate)),
    "iterable": (ITER, dict(batch_size=3, num_workers=1)),
    "iterable-no-batching": (ITER, dict(batch_size=None)),
}


@pytest.mark.parametrize("case", list(ATTR_CASES))
def test_attributes_match(case):
    dataset, kwargs = ATTR_CASES[case]
    dl = DataLoader(dataset, **kwargs)
    fl = FastLoader(dataset, **kwargs)
    for name in ATTRS:
        a, b = getattr(fl, name), getattr(dl, name)
        assert a is b or a == b, f"{name}: {a!r} != {b!r}"
    if kwargs.get("num_workers", 0) > 0:
        assert fl.prefetch_factor == kwargs.get("prefetch_factor", 2)
    assert_same_sampler(fl.sampler, dl.sampler)
    assert_same_sampler(fl.batch_sampler, dl.batch_sampler)
    assert type(fl._index_sampler) is type(dl._index_sampler)
    if dataset is ITER:
        assert isinstance(fl.sampler, _InfiniteConstantSampler)
    elif kwargs.get("shuffle"):
        assert isinstance(fl.sampler, RandomSampler) and fl.sampler.generator is GEN
    assert len(fl) == len(dl)
    assert fl._IterableDataset_len_called == dl._IterableDataset_len_called
