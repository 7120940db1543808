"""Where a multi-process iterator stands in its epochs, and getting back there.

:class:`ResumeCursor` owns the iterator's resume state: the resume book (the
capture of each worker's last delivered batch, NOTE [ Resume ] in
:mod:`fastload.resume.book`), the loaded state the first epoch resumes, and
the sampler draws a resumed epoch skips. For ``FastLoader.state_dict()`` it
says where the iterator stands; after ``load_state_dict()`` it draws the
epoch's order again as DataLoader's iterator drew it, skips the batches
delivered before the state was saved, and tells the iterator where to prime
the pipeline from: the first undelivered batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..resume import book


@dataclasses.dataclass
class FastForward:
    """Where a resumed epoch starts (what :meth:`ResumeCursor.fast_forward`
    found): the sampler's iterator, drawn up to ``first_batch``, the batch
    numbers ``skip`` delivered past it, and the replay to end once the
    pipeline is primed."""

    sampler_iter: Any
    first_batch: int
    skip: Tuple[int, ...]
    yielded: int
    first_worker: int
    active: List[bool]
    sampler_done: bool
    replay: book.Replay


class ResumeCursor:
    """An iterator's position, for ``state_dict()``, and the way back to a
    loaded one. ``saved``: the state loaded with ``load_state_dict()`` that
    the iterator's first epoch resumes (None: start afresh); ``first_start``:
    what a fresh iterator's first epoch is drawn from (recorded before
    DataLoader's iterator draws its base seed)."""

    def __init__(self, capacity: int, saved: Optional[dict],
                 first_start: Optional[Dict[str, Any]]) -> None:
        self.book = book.ResumeBook(capacity)
        self._capacity = capacity
        self._saved = saved
        self._first_start = first_start
        self._start: Optional[Dict[str, Any]] = None
        self._drawn = 0  # indices drawn this epoch, skipped ones included
        self._skip: set = set()  # batch numbers whose indices are drawn and dropped

    def worker_resumes(self) -> Optional[List[Optional[tuple]]]:
        """Per worker slot, what its session is put back to (None: start
        afresh): the loaded state's captures, fitted to this iterator's
        capacity (``num_workers="auto"`` may have room for more or fewer)."""
        saved = self._saved
        if saved is None:
            return None
        mid_epoch = saved["position"] is not None
        capacity = self._capacity
        workers = [book.worker_resume(ws, mid_epoch) for ws in saved["workers"]]
        workers = (workers + [None] * capacity)[:capacity]
        this_epoch = [mid_epoch and bool(ws and ws["this_epoch"]) for ws in saved["workers"]]
        self.book.resumed([w and w[0] for w in workers],
                          (this_epoch + [False] * capacity)[:capacity])
        return workers

    def begin_epoch(self, loader: Any, base_seed: int, first_iter: bool) -> bool:
        """Record what an epoch's order is drawn from, before DataLoader's
        ``_reset`` draws it; returns whether the epoch resumes mid-way."""
        saved = self._saved if first_iter else None
        mid_epoch = saved is not None and saved["position"] is not None
        if first_iter and self._first_start is not None:
            self._start = self._first_start
        elif mid_epoch:
            self._start = saved["epoch_start"]  # type: ignore[index]
        else:
            self._start = book.epoch_start(loader, base_seed, False)
        self._drawn = 0
        self._skip = set()  # a resumed epoch's skips end with it (fast_forward sets them)
        return mid_epoch

    def enter_epoch(self, yielded_before: int) -> None:
        """A fresh epoch (``yielded_before``: the batches the loop received
        of the one before)."""
        self.book.new_epoch(self._start or {}, yielded_before)

    def fast_forward(self, loader: Any, sampler_iter: Any, index_sampler: Any) -> FastForward:
        """A resumed epoch: draw the order again from the saved state and
        drop the delivered batches' indices (NOTE [ Resume ])."""
        saved = self._saved
        assert saved is not None
        first, ahead = saved["position"], saved["delivered_ahead"]
        book.draw_as_usual(sampler_iter)
        replay = book.Replay(saved["epoch_start"])
        replay.rewind(loader)
        if saved["epoch_start"]["first_iter"]:  # as DataLoader's iterator began that epoch:
            iter(index_sampler)  # an iterator in __init__, then the base seed,
            book.draw_base_seed(loader)
        sampler_iter = iter(index_sampler)  # then its first _reset()
        self.book.new_epoch(saved["epoch_start"], 0, first, ahead)
        sampler_done = False
        for _ in range(first):
            try:
                next(sampler_iter)
            except StopIteration:
                sampler_done = True
                break
        self._drawn = first
        self._skip = set(ahead)
        active = list(saved["workers_active"])
        return FastForward(sampler_iter, first, tuple(ahead), first + len(ahead),
                           int(saved["next_worker"]), active, sampler_done, replay)

    def draw(self, sampler_iter: Any) -> Any:
        """The sampler's next index; a resumed epoch drops those of batches
        delivered before the state was saved."""
        while self._drawn in self._skip:
            self._skip.discard(self._drawn)
            self._drawn += 1
            next(sampler_iter)
        index = next(sampler_iter)
        self._drawn += 1
        return index

    def taken(self, worker: int, idx: int, capture: Any, yielded: int) -> None:
        """Batch ``idx`` of ``worker`` left the ring with capture ``capture``."""
        self.book.taken(worker, idx, capture, yielded)

    def state(self, *, yielded: int, finished: bool, persistent: bool, base_seed: int,
              num_workers: int,
              position: Callable[[int], Tuple[int, List[bool]]]) -> Dict[str, Any]:
        """The iterator's position, for ``FastLoader.state_dict()``
        (``position``: the schedule's worker and active replicas for a given
        first undelivered batch)."""
        resume_book = self.book
        resume_book.fold(yielded)
        if finished:
            return {"position": None, "base_seed": base_seed if persistent else None,
                    "workers": (resume_book.worker_states() if persistent
                                else [None] * num_workers)}
        first = resume_book.first_undelivered
        next_worker, active = position(first)
        return {
            "position": first, "delivered_ahead": resume_book.ahead(),
            "epoch_start": resume_book.start, "base_seed": base_seed,
            "next_worker": next_worker, "workers_active": active,
            "workers": resume_book.worker_states(),
            "workers_in_use": num_workers,  # num_workers="auto" resumes with it
        }
