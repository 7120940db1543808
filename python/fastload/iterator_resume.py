"""The resume half of :class:`fastload.iterator.FastLoaderIter`.

Where an iterator stands, for ``FastLoader.state_dict()``, and how an
iterator made after ``load_state_dict()`` gets back there: draw the
epoch's order again as DataLoader's iterator drew it, skip the batches
delivered before the state was saved, and prime the pipeline from the
first undelivered one (NOTE [ Resume ] in resume.py). A mixin, so that the
iterator's own module keeps to DataLoader's iterator; the state it reads
and sets is the iterator's.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch.utils.data.dataloader import _BaseDataLoaderIter

from . import resume


class ResumeMixin:
    """The iterator's resume methods (mixed into FastLoaderIter only)."""

    def _fast_forward(self, saved: dict, loader: Any) -> Tuple[int, resume.Replay]:
        """A resumed epoch: draw the order again from the saved state and skip
        the delivered batches' indices; returns the worker the first
        undelivered batch goes to, and the replay to end once the pipeline
        is primed (NOTE [ Resume ])."""
        first, ahead = saved["position"], saved["delivered_ahead"]
        resume.draw_as_usual(self._sampler_iter)
        replay = resume.Replay(saved["epoch_start"])
        replay.rewind(loader)
        if saved["epoch_start"]["first_iter"]:  # as DataLoader's iterator began that epoch:
            iter(self._index_sampler)  # an iterator in __init__, then the base seed,
            resume.draw_base_seed(loader)
        self._sampler_iter = iter(self._index_sampler)  # then its first _reset()
        self._book.new_epoch(saved["epoch_start"], 0, first, ahead)
        for _ in range(first):
            try:
                _BaseDataLoaderIter._next_index(self)
            except StopIteration:
                self._sampler_done = True
                break
        self._drawn = self._send_idx = self._rcvd_idx = first
        self._num_yielded = first + len(ahead)
        self._skip_draw, self._skip_send = set(ahead), set(ahead)
        active = list(saved["workers_active"])
        self._workers_status = (active + [True] * self._capacity)[: self._capacity]
        return int(saved["next_worker"]), replay

    def _next_index(self) -> Any:
        """The sampler's next index; a resumed epoch skips those of batches
        delivered before the state was saved."""
        while self._drawn in self._skip_draw:
            self._skip_draw.discard(self._drawn)
            self._drawn += 1
            super()._next_index()
        index = super()._next_index()
        self._drawn += 1
        return index

    def resume_state(self) -> Dict[str, Any]:
        """This iterator's position, for ``FastLoader.state_dict()``."""
        if self._fatal is not None:
            raise RuntimeError(f"state_dict: the loader's iterator failed: {self._fatal}")
        book = self._book
        book.fold(self._num_yielded)
        persistent = self._persistent_workers
        if self._finished:
            return {"position": None, "base_seed": self._base_seed if persistent else None,
                    "workers": book.worker_states() if persistent else [None] * self._num_workers}
        first = book.first_undelivered
        rec = self._task_info.get(first)
        return {
            "position": first, "delivered_ahead": book.ahead(),
            "epoch_start": book.start, "base_seed": self._base_seed,
            "next_worker": rec.worker if rec is not None else self._cycle_next,
            # A replica seen to end that still has undelivered batches is
            # active for the resumed epoch: it makes them again, then ends.
            "workers_active": [self._workers_status[w] or any(
                r.worker == w for r in self._task_info.values()) for w in range(self._num_workers)],
            "workers": book.worker_states(),
            "workers_in_use": self._num_workers,  # num_workers="auto" resumes with it
        }
