"""One session of a worker: a dataset replica, its seeds and its fetcher.

Runs in worker processes (:mod:`fastload.worker.loop`). A session task gives
the worker the session's objects (the dataset, ``collate_fn``,
``worker_init_fn``, ...: unpickled here, or inherited with the fork); the
worker then seeds itself exactly as torch's ``_worker_loop`` does, runs
``worker_init_fn``, and, to resume, puts its generators and replica back to
a capture (NOTE [ Resume ] in :mod:`fastload.resume.book`). After each batch the
session captures that state again, as the trailer of the batch's meta.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import _DatasetKind
from torch.utils.data._utils import HAS_NUMPY
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data._utils.fetch import _BaseDatasetFetcher

from ..resume.capture import Capturer, CountingIter
from ..resume.capture import apply as apply_resume
from ..transport.format import trailer as resume_trailer

__all__ = ["Session"]


class Session:
    """One session of a worker: a dataset replica, its seeds and its fetcher."""

    def __init__(self, load: Callable[[], tuple], base_seed: int, worker_id: int,
                 num_workers: int, wrap_collate: Callable[[Any], Any],
                 resume_from: Optional[tuple] = None) -> None:
        self.worker_id = worker_id
        self.capturer = Capturer()
        self.where = f"in DataLoader worker process {worker_id}"
        self.init_exception: Optional[ExceptionWrapper] = None
        self.fetcher: Optional[_BaseDatasetFetcher] = None
        self.iteration_end = False
        self.epoch: Optional[int] = None
        self.dataset: Any = None
        (self.dataset, self.collate_fn, init_fn, self.dataset_kind, self.auto_collation,
         self.drop_last) = (None, None, None, 0, True, False)
        try:
            # The inherited settings' environment and torch modes were applied
            # as it was unpickled (here or in the zygote); its warnings
            # filters go in now, with the dataset's modules imported.
            (state, self.dataset, self.collate_fn, init_fn, self.dataset_kind,
             self.auto_collation, self.drop_last) = load()
            state.apply_filters()
            self.collate_fn = wrap_collate(self.collate_fn)
        except Exception:
            self.init_exception = ExceptionWrapper(
                where=f"{self.where} while unpickling the dataset"
            )
        # Exactly what torch's _worker_loop does, in the same order.
        seed = base_seed + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        if HAS_NUMPY:
            import numpy as np  # optional: imported only when present, as torch's worker loop does

            np.random.seed(torch_worker._generate_state(base_seed, worker_id))
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=self.dataset
        )
        if self.init_exception is None:
            try:
                if init_fn is not None:
                    init_fn(worker_id)
                self.fetcher = self.make_fetcher()
                apply_resume(self, resume_from)
            except Exception:
                self.init_exception = ExceptionWrapper(where=self.where)

    def make_fetcher(self) -> _BaseDatasetFetcher:
        fetcher = _DatasetKind.create_fetcher(
            self.dataset_kind, self.dataset, self.auto_collation, self.collate_fn, self.drop_last
        )
        if self.dataset_kind == _DatasetKind.Iterable:
            # Counts the samples the replica gave: a resumed replica without
            # state_dict() is fast-forwarded by that many.
            fetcher.dataset_iter = CountingIter(fetcher.dataset_iter)
        return fetcher

    def capture(self) -> bytes:
        """The resume trailer of the batch just made (see fastload.transport.format)."""
        it = getattr(self.fetcher, "dataset_iter", None)
        if isinstance(it, CountingIter):
            return resume_trailer(self.capturer.capture(it.count, self.dataset))
        return resume_trailer(self.capturer.capture(0))

    def new_epoch(self, epoch: int) -> None:
        if self.epoch is not None and self.init_exception is None:
            self.fetcher = self.make_fetcher()  # DataLoader's _ResumeIteration
        self.epoch = epoch
        self.iteration_end = False
