"""``num_workers=0``: DataLoader's own single-process iterator, with what a
``FastLoader`` adds to it: device prefetch (one batch copied ahead), resume
from ``load_state_dict()``, and ``stats()`` (each ``next()`` both waits for
and makes its batch, in the main process)."""

from __future__ import annotations

import time
import weakref
from typing import Any, Dict, Optional

from torch.utils.data import DataLoader, IterableDataset, _DatasetKind
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

from ..resume import capture
from ..resume import book
from ..device.prefetch import DevicePrefetcher, StreamOps
from ..stats.meter import loader_label, samples_in
from .loader_runtime import LoaderRuntime

__all__ = ["SingleProcessIter"]


class SingleProcessIter(_SingleProcessDataLoaderIter):
    """``num_workers=0``: DataLoader's own iterator, with device prefetch
    (one batch copied ahead) when asked, and resume (NOTE [ Resume ] in
    :mod:`fastload.resume.book`)."""

    def __init__(self, loader: DataLoader, state: LoaderRuntime, ops: Optional[StreamOps]) -> None:
        self._prefetcher = DevicePrefetcher(ops) if ops is not None else None
        self._meter = state.meter
        self._meter.begin(0, loader_label(loader))
        self._meter_epoch = self._meter.epoch
        saved = state.take_resume()
        stateful = (isinstance(loader.dataset, IterableDataset)  # DataLoader's _DatasetKind.Iterable
                    and capture.is_stateful(loader.dataset))
        if saved is None:
            self._start = book.epoch_start(loader, None, True)
        else:
            self._start = saved["epoch_start"]
            if stateful and saved.get("dataset_state") is not None:
                loader.dataset.load_state_dict(saved["dataset_state"])
        super().__init__(loader)  # draws the base seed as any iter() does
        self._samples = 0  # in the batch last drawn
        try:  # the epoch's length, to know its last batch (an IterableDataset's: unknown)
            self._epoch_len = (len(self._index_sampler)
                               if self._dataset_kind == _DatasetKind.Map else None)
        except TypeError:
            self._epoch_len = None
        self._meter.started()
        self._stateful = stateful
        self._finished = False
        state.live_iterator = weakref.ref(self)
        if saved is None:
            self._start["base_seed"] = self._base_seed
            return
        self._base_seed = saved["base_seed"]
        # The sampler's own first draw waits for the first next(), as in any
        # iter(): nothing more is drawn here than the base seed above.
        replay = book.Replay(self._start)
        replay.rewind(loader)
        try:
            self._sampler_iter = iter(self._index_sampler)  # as DataLoader's iterator began:
            if self._start["first_iter"]:  # the sampler's iterator, then the base seed
                book.draw_base_seed(loader)
            self._fast_forward(int(saved["position"]), stateful)
        finally:
            replay.done()

    def _fast_forward(self, batches: int, stateful: bool) -> None:
        if self._dataset_kind == _DatasetKind.Map:
            # With no batch to skip, a RandomSampler's seed is drawn at the
            # first next(), from the process's generator, as in the run that
            # saved the state (the dataset draws from it too: restore it).
            for _ in range(batches):
                self._next_index()
        elif not stateful:
            # The skipped samples' draws from the global generators were made
            # before the state was saved: made again here, they do not count.
            with book.global_generators_kept():
                for _ in range(batches):
                    self._dataset_fetcher.fetch(self._next_index())
        self._num_yielded = batches

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if self._prefetcher is not None:
            self._prefetcher.reset()

    def _next_index(self) -> Any:
        index = super()._next_index()
        self._samples = samples_in(index, self._auto_collation)
        return index

    def __next__(self) -> Any:
        # stats(): each next() both waits for and makes its batch.
        t0 = time.perf_counter_ns()
        meter = self._meter
        try:
            data = super().__next__()
        except StopIteration:
            if self._meter_epoch == meter.epoch:
                meter.waited(time.perf_counter_ns() - t0)
                meter.end()
            raise
        if self._meter_epoch == meter.epoch:
            took = time.perf_counter_ns() - t0
            meter.made(-1, took, self._num_yielded - 1, None)
            meter.delivered(took, 0, self._samples, 0)
            if self._num_yielded == self._epoch_len:
                meter.end()
        return data

    def _next_data(self) -> Any:
        try:
            if self._prefetcher is not None:
                return self._prefetcher.next(super()._next_data)
            return super()._next_data()
        except StopIteration:
            self._finished = True
            raise

    def resume_state(self) -> Dict[str, Any]:
        """This iterator's position, for ``FastLoader.state_dict()``."""
        if self._finished:
            return {"position": None, "base_seed": None, "workers": []}
        return {"position": self._num_yielded, "delivered_ahead": [], "epoch_start": self._start,
                "base_seed": self._base_seed, "next_worker": 0, "workers_active": [],
                "workers": [],
                "dataset_state": self._dataset.state_dict() if self._stateful else None}
