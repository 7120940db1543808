"""FastLoaderIter's ``next()``: DataLoader's, with its profiler annotation
made only while a profiler runs (it costs about as much as the rest of a
small batch's main-process work)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from fastload import FastLoader


def _names(prof: torch.profiler.profile) -> list:
    return [e.name for e in prof.events()]


def test_under_a_profiler_each_next_is_annotated_as_by_dataloader() -> None:
    data = torch.arange(12)
    for cls in (FastLoader, DataLoader):
        it = iter(cls(data, batch_size=4, num_workers=1))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            batches = [next(it) for _ in range(3)]
        assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        name = f"enumerate(DataLoader)#{type(it).__name__}.__next__"
        assert _names(prof).count(name) == 3, (name, sorted(set(_names(prof))))


def test_without_a_profiler_no_annotation_is_made() -> None:
    seen = {}
    real = torch.autograd.profiler.record_function.__enter__
    for cls in (FastLoader, DataLoader):
        it = iter(cls(torch.arange(12), batch_size=4, num_workers=1))
        calls = []

        def spy(self):  # type: ignore[no-untyped-def]
            calls.append(self.name)
            return real(self)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.autograd.profiler.record_function, "__enter__", spy)
            assert [b.tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        seen[cls] = [c for c in calls if c.startswith("enumerate(DataLoader)")]
    assert len(seen[DataLoader]) == 4  # the spy sees DataLoader's: 3 batches, then the end
    assert seen[FastLoader] == []


class _Longer(IterableDataset):
    """Says it has 3 samples and yields 5."""

    def __len__(self) -> int:
        return 3

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        if info is None or info.id == 0:
            yield from range(5)


@pytest.mark.heavy
def test_an_iterable_dataset_longer_than_its_len_warns_in_dataloaders_words() -> None:
    got = {}
    dataset = _Longer()  # one object: the warning quotes its repr
    for cls in (FastLoader, DataLoader):
        loader = cls(dataset, batch_size=None, num_workers=1)
        len(loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert list(loader) == [0, 1, 2, 3, 4]
        got[cls] = [str(w.message).replace(type(loader).__name__, "L") for w in caught
                    if "Length of IterableDataset" in str(w.message)]
    assert got[FastLoader] and got[FastLoader] == got[DataLoader]
