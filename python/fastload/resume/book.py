"""Mid-epoch resume: ``FastLoader.state_dict()`` and ``load_state_dict()``.

NOTE [ Resume ]
fastload delivers batches exactly once and in order, so a position in an
epoch is a number of delivered batches. What else the rest of the epoch
depends on, and how it is kept without work per step:

* **The sampler's order.** At the start of each epoch the iterator records
  what the sampler's order is drawn from: torch's global generator state,
  the loader's ``generator``, the base seed, and ``state_dict()`` of a
  sampler or batch sampler that has one. To resume, those are put back, the
  sampler is iterated anew and the delivered batches' indices are drawn and
  dropped (fast-forward). The caller's global generator is restored
  afterwards: resuming neither consumes it nor depends on it.
* **Randomness inside workers** (augmentations drawing from ``random``,
  ``torch``, ``numpy``). Each worker captures its generators' states when
  it finishes a batch (a few microseconds, in the worker) and the capture
  travels in the batch's slot with the batch. The main process keeps, per
  worker, the capture of its last *delivered* batch: a reference, no copy.
  A resumed worker is seeded and initialised as a fresh one
  (``worker_init_fn`` included) and then put back to that capture, which
  is exactly its state before its first undelivered batch.
* **IterableDataset replicas.** A replica that has ``state_dict`` /
  ``load_state_dict`` (torchdata's ``Stateful`` protocol) is captured with
  the generators and restored before its iterator is made; any other replica
  is fast-forwarded by the number of samples its worker had delivered.

``state_dict()`` only packs what is kept: no worker round trip, no waiting.
Its result is plain data (ints, lists, dicts, uint8 tensors) that
``torch.save`` / ``torch.load(weights_only=True)`` carry on every torch
fastload supports: the generators' raw states are saved as uint8 tensors,
not bytes, which ``weights_only`` loading refuses before torch 2.5.

This module is the main process's side: what an epoch's order is drawn
from (:func:`epoch_start`), drawing it again (:class:`Replay`), and each
worker's last delivered capture (:class:`ResumeBook`). The workers' side,
taking and putting back a capture, is :mod:`fastload.resume.capture` (the capture
travels as a trailer of the batch's meta, :mod:`fastload.transport.format`);
the saved state's format and checks are :mod:`fastload.resume.format`.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import random
import sys
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch

from .capture import Capturer, CountingIter, tensor_bytes

# The workers' side (fastload.resume.capture) is named here too, for callers that
# measure or test a capture's round trip through fastload.resume.book.
__all__ = ["Capturer", "CountingIter", "global_generators_kept",
           "epoch_start", "Replay", "draw_base_seed", "draw_as_usual", "ResumeBook", "decode",
           "worker_resume"]


@contextlib.contextmanager
def global_generators_kept() -> Iterator[None]:
    """The global generators (``random``, torch's, numpy's) as they were
    before, whatever the block draws."""
    py, torch_state = random.getstate(), torch.get_rng_state()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(torch_state)
        if np is not None:
            np.random.set_state(np_state)


def _generator_state(gen: Optional[torch.Generator]) -> Optional[torch.Tensor]:
    return gen.get_state() if isinstance(gen, torch.Generator) else None


def _sampler_state(loader: Any) -> Dict[str, Any]:
    """``state_dict()`` of the loader's sampler and batch sampler, where they have one."""
    out = {}
    for name in ("sampler", "batch_sampler"):
        obj = getattr(loader, name, None)
        if obj is not None and callable(getattr(obj, "state_dict", None)) and \
                callable(getattr(obj, "load_state_dict", None)):
            out[name] = obj.state_dict()
    return out


def epoch_start(loader: Any, base_seed: Optional[int], first_iter: bool) -> Dict[str, Any]:
    """What the epoch's sampler order (and, for an iterator's first epoch,
    the base seed) will be drawn from; taken just before they are drawn."""
    return {"torch_rng": torch.get_rng_state(), "generator": _generator_state(loader.generator),
            "samplers": _sampler_state(loader), "first_iter": first_iter, "base_seed": base_seed}


class Replay:
    """Draws a resumed epoch's order again from the state it was drawn from.

    A resumed ``iter()`` first draws from the global generator what any
    ``iter()`` of a new loader draws (the base seed, the sampler's seed), so
    a script that seeds once at start and does not restore generators
    (Lightning's way) has the same global generator afterwards as the run
    that was never stopped; a script that restores its generators after the
    first ``iter()`` (the HF Trainer's way) gets exactly its own state back.
    Then :meth:`rewind` puts the saved epoch-start state in place, the
    order is drawn again from it, and :meth:`done` puts back the global
    generator as the first draws left it. The loader's own ``generator`` is
    left as the replay leaves it: as the uninterrupted run left it.
    """

    def __init__(self, start: Dict[str, Any]) -> None:
        self.start = start
        self._after: Optional[torch.Tensor] = None

    def rewind(self, loader: Any) -> None:
        """After the usual draws, before the saved order is drawn again."""
        self._after = torch.get_rng_state()
        torch.set_rng_state(self.start["torch_rng"])
        gen = self.start["generator"]
        if gen is not None and isinstance(loader.generator, torch.Generator):
            loader.generator.set_state(gen)
        for name, sd in self.start["samplers"].items():
            getattr(loader, name).load_state_dict(sd)

    def done(self) -> None:
        """The order is drawn: the global generator goes back to after the usual draws."""
        if self._after is not None:
            torch.set_rng_state(self._after)
            self._after = None


def draw_base_seed(loader: Any) -> None:
    """Draw (and drop) a base seed as DataLoader's iterator draws it."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


def draw_as_usual(sampler_iter: Any) -> None:
    """What any epoch's first index draws from the generators (a
    RandomSampler draws its seed lazily, at its first ``next()``)."""
    try:
        next(sampler_iter)
    except StopIteration:
        pass


class ResumeBook:
    """The main process's record of one iterator, for ``state_dict()``.

    Per worker: the capture of its last *delivered* batch in this session
    (None: it has delivered none, so a fresh worker is exact) and whether
    that batch was of the current epoch; and the capture of its last batch
    taken from the ring (delivered or not), for a restart. Batches the
    device prefetcher took ahead wait in ``_pending`` until the loop has
    received them. Captures stay pickled until ``state_dict()`` asks.
    """

    def __init__(self, num_workers: int) -> None:
        self.last_delivered: List[Any] = [None] * num_workers
        self.last_epoch: List[int] = [-1] * num_workers
        self.last_made: List[Any] = [None] * num_workers
        self.start: Optional[Dict[str, Any]] = None
        self.epoch = -1
        self._pending: Deque[Tuple[int, int, int, Any]] = collections.deque()
        self._taken = 0
        self.first_undelivered = 0
        self._ahead: set = set()  # delivered batch numbers past first_undelivered

    def new_epoch(self, start: Dict[str, Any], yielded_before: int = 0,
                  first_undelivered: int = 0, ahead: Tuple[int, ...] = ()) -> None:
        """An epoch starts (``yielded_before``: how many batches the loop
        received of the one before); a resumed one at ``first_undelivered``
        with the batches in ``ahead`` delivered too."""
        self.fold(yielded_before)  # the last batches of the epoch before
        self.start = start
        self.epoch += 1
        self._pending.clear()
        self._taken = first_undelivered + len(ahead)  # numbered as the loop counts them
        self.first_undelivered = first_undelivered
        self._ahead = set(ahead)

    def resumed(self, workers: List[Any], this_epoch: List[bool]) -> None:
        """Start from a loaded state's worker captures (before the first epoch;
        ``this_epoch``: the capture is of the epoch being resumed)."""
        self.last_delivered = list(workers)
        self.last_made = list(workers)
        self.last_epoch = [self.epoch + 1 if cur else -1 for cur in this_epoch]

    def taken(self, worker: int, idx: int, capture: Any, yielded: int) -> None:
        """Batch ``idx`` of ``worker`` left the ring (``yielded``: how many
        batches the loop has received so far this epoch)."""
        if capture is not None:
            self.last_made[worker] = capture
        self._pending.append((self._taken, worker, idx, capture))
        self._taken += 1
        if len(self._pending) > 2:
            self.fold(yielded)

    def fold(self, yielded: int) -> None:
        """Move what the loop has received out of ``_pending``."""
        while self._pending and self._pending[0][0] < yielded:
            _n, worker, idx, capture = self._pending.popleft()
            if capture is not None:
                self.last_delivered[worker] = capture
                self.last_epoch[worker] = self.epoch
            self._ahead.add(idx)
            while self.first_undelivered in self._ahead:
                self._ahead.discard(self.first_undelivered)
                self.first_undelivered += 1

    def worker_states(self) -> List[Optional[Dict[str, Any]]]:
        """Per worker, its capture (plain data) and whether it is of this epoch."""
        return [None if cap is None else
                {"capture": _saved_capture(decode(cap)),
                 "this_epoch": self.last_epoch[w] == self.epoch}
                for w, cap in enumerate(self.last_delivered)]

    def ahead(self) -> List[int]:
        return sorted(self._ahead)


def decode(capture: Any) -> Any:
    """A capture as plain data (it travels pickled from the worker)."""
    return pickle.loads(capture) if isinstance(capture, bytes) else capture


def worker_resume(state: Optional[Dict[str, Any]], mid_epoch: bool) -> Optional[tuple]:
    """What a resumed worker's session gets: (capture, samples to skip)."""
    if state is None:
        return None
    capture_ = _loaded_capture(tuple(state["capture"]))
    skip = capture_[3] if mid_epoch and state["this_epoch"] and capture_[4] is None else 0
    return (capture_, skip)


# A capture's generator states are raw bytes (see fastload.resume.capture); a
# saved state holds them as uint8 tensors, which torch.load(weights_only=True)
# reads on every torch (bytes only from torch 2.5 on).
def _saved_capture(capture_: tuple) -> tuple:
    """A capture as the saved state holds it: its raw states as uint8 tensors."""
    (version, internal, gauss), torch_state, np_state = capture_[:3]
    if np_state is not None:
        np_state = (np_state[0], _as_tensor(np_state[1]), *np_state[2:])
    return ((version, _as_tensor(internal), gauss), _as_tensor(torch_state), np_state,
            *capture_[3:])


def _loaded_capture(capture_: tuple) -> tuple:
    """A capture as :func:`_saved_capture` saved it, its raw states bytes again."""
    (version, internal, gauss), torch_state, np_state = capture_[:3]
    if np_state is not None:
        np_state = (np_state[0], _as_bytes(np_state[1]), *np_state[2:])
    return ((version, _as_bytes(internal), gauss), _as_bytes(torch_state), np_state,
            *capture_[3:])


def _as_tensor(raw: Any) -> Any:
    if isinstance(raw, (bytes, bytearray)):
        if not raw:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return raw


def _as_bytes(raw: Any) -> Any:
    if isinstance(raw, torch.Tensor):
        return tensor_bytes(raw.contiguous().view(torch.uint8))
    return raw
