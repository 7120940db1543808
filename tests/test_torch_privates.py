"""The private torch names fastload relies on, present in the installed torch.

fastload mirrors DataLoader's multi-process iterator and worker loop, which
have no public API, so it reads some of torch's private names. Each is
listed here with where fastload uses it, so that a torch that moves one
fails here, by name, rather than somewhere in a worker. ``.ci/torch-matrix``
runs this file on the oldest torch fastload supports (2.1) and on the newest.
Names that only newer torch has are optional: fastload takes another path
without them, and the test checks it knows which.
"""

from __future__ import annotations

import importlib
from typing import List, Tuple

import pytest
import torch

# (module, attribute path, where fastload uses it)
REQUIRED: List[Tuple[str, str, str]] = [
    ("torch.utils.data", "DataLoader._get_iterator", "FastLoader and fastload.install(): the hook"),
    ("torch.utils.data", "DataLoader.check_worker_number_rationality", "FastLoader._get_iterator"),
    ("torch.utils.data", "DataLoader._index_sampler", "loader: the first index"),
    ("torch.utils.data", "_DatasetKind.create_fetcher", "worker/session: the fetcher"),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter._reset", "FastLoaderIter's base"),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter._next_index", "loader, single_process"),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__", "FastLoaderIter, a profiler on"),
    ("torch._C._autograd", "_profiler_enabled", "FastLoaderIter: is a profiler on"),
    ("torch.utils.data.dataloader", "_SingleProcessDataLoaderIter", "num_workers=0"),
    ("torch.utils.data._utils", "HAS_NUMPY", "worker/session: numpy's seed"),
    ("torch.utils.data._utils.worker", "_generate_state", "worker/session: numpy's seed"),
    ("torch.utils.data._utils.worker", "WorkerInfo", "worker/session: get_worker_info()"),
    ("torch.utils.data._utils.worker", "_worker_info", "worker/session: get_worker_info()"),
    ("torch.utils.data._utils.fetch", "_BaseDatasetFetcher", "worker/session"),
    ("torch.utils.data._utils.collate", "collate_tensor_fn", "worker: stacking into the slot"),
    ("torch.utils.data._utils.collate", "default_collate_fn_map", "worker: stacking into the slot"),
    ("torch.utils.data._utils.signal_handling", "_set_worker_signal_handlers", "worker"),
    ("torch.utils.data._utils.pin_memory", "pin_memory", "iterator, pinning"),
    ("torch._utils", "ExceptionWrapper", "errors from workers"),
    ("torch", "UntypedStorage._new_shared_fd_cpu", "launching.memfds: a storage over a memfd"),
    ("torch", "UntypedStorage._share_fd_cpu_", "launching.memfds: a moved storage's memfd"),
]


def _lookup(module: str, path: str) -> object:
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module, path, used_by", REQUIRED,
                         ids=[f"{m}.{p}" for m, p, _ in REQUIRED])
def test_required_private_name(module: str, path: str, used_by: str) -> None:
    try:
        _lookup(module, path)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch {torch.__version__} has no {module}.{path} ({used_by}): {e}")


def test_the_base_iterator_draws_from_its_sampler_iter() -> None:
    """FastLoaderIter's resume cursor draws ``next(it._sampler_iter)`` (and
    makes ``iter(it._index_sampler)`` anew), as ``_next_index`` and
    ``_reset`` of torch's base iterator do."""
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    loader = DataLoader(range(10), batch_size=3)
    it = _BaseDataLoaderIter(loader)
    it._reset(loader, first_iter=True)
    assert it._next_index() == [0, 1, 2]
    assert next(it._sampler_iter) == [3, 4, 5]
    assert next(iter(it._index_sampler)) == [0, 1, 2]


def test_worker_info_takes_what_the_worker_gives() -> None:
    """fastload's workers set get_worker_info() as torch's worker loop does:
    WorkerInfo(id=, num_workers=, seed=, dataset=), torch's defaults for the rest."""
    from torch.utils.data._utils.worker import WorkerInfo

    info = WorkerInfo(id=1, num_workers=2, seed=3, dataset=None)
    assert (info.id, info.num_workers, info.seed, info.dataset) == (1, 2, 3, None)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_views_where_torch_has_them() -> None:
    """A nested tensor travels as a view of the slot only where torch can make
    one over a buffer (torch._nested_view_from_buffer, not in torch 2.1);
    elsewhere it is pickled by torch's own reduction."""
    from fastload.transport import writer

    assert writer.NESTED_VIEWS == hasattr(torch, "_nested_view_from_buffer")
    if writer.NESTED_VIEWS:
        nt = torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])
        for name in ("_nested_tensor_size", "_nested_tensor_strides",
                     "_nested_tensor_storage_offsets", "values"):
            assert callable(getattr(nt, name)), name


def test_moving_storages_in_place_where_torch_can() -> None:
    """A big tensor in a dataset is moved into shared memory in place only
    where torch can swap two storages' memory (UntypedStorage._swap_data_ptr_,
    not in torch 2.1 nor 2.11) and say whether torch allocated a storage
    (UntypedStorage.resizable, not in 2.1); elsewhere it crosses as a buffer
    copied once per loader (tests/test_references.py checks both)."""
    from fastload.launching import memfds

    storage = torch.zeros(4).untyped_storage()
    can = hasattr(storage, "_swap_data_ptr_") and hasattr(storage, "resizable")
    assert memfds.movable(storage) == can
