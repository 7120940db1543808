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
Its result is plain data (ints, bytes, lists, dicts) that ``torch.save`` /
``torch.load(weights_only=True)`` carry.
"""

from __future__ import annotations

import array
import collections
import contextlib
import pickle
import random
import struct
import sys
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch

FORMAT = 1
_KEY = "fastload_resume"
_TRAILER_LEN = struct.Struct("<I")

# ---- worker side -------------------------------------------------------------


class Capturer:
    """Captures a worker's state at the end of each batch (see NOTE [ Resume ]).

    Per batch it costs ``random.getstate()`` (~25 us, no cheaper public way
    exists) and torch's generator state (~5 us). numpy's global generator
    state is slow to read through ``np.random.get_state()`` (~70-90 us), so
    its Mersenne Twister words are read raw through the bit generator's
    public ctypes interface (~1 us) and the full state is read only when
    they changed since the last batch, i.e. when the batch drew from numpy.
    The raw read is checked against ``get_state()`` once, at start; where
    they disagree (another numpy layout), ``get_state()`` is read every time.
    """

    _MT_BYTES = 624 * 4 + 4  # key words, then pos

    def __init__(self) -> None:
        self._np: Any = None
        self._np_addr: Optional[int] = None
        self._np_raw: Optional[bytes] = None
        self._np_state: Any = None

    def _numpy_state(self) -> Any:
        np = sys.modules.get("numpy")
        if np is None:
            return None
        if self._np is not np:
            self._np = np
            self._np_addr = self._raw_address(np)
        if self._np_addr is not None:
            import ctypes

            raw = ctypes.string_at(self._np_addr, self._MT_BYTES)
            if raw == self._np_raw:
                return self._np_state
            self._np_raw = raw
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        self._np_state = (name, keys.tobytes(), int(pos), int(has_gauss), float(cached))
        return self._np_state

    def _raw_address(self, np: Any) -> Optional[int]:
        try:
            import ctypes

            addr = np.random.get_bit_generator().ctypes.state_address  # numpy >= 1.25
            raw = ctypes.string_at(addr, self._MT_BYTES)
            _name, keys, pos = np.random.get_state(legacy=True)[:3]
            if raw == keys.tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True):
                return int(addr)
        except Exception:  # another numpy: the slow, public way every time
            pass
        return None

    def capture(self, samples: int, dataset: Any = None) -> tuple:
        """The state at the end of a batch: the three global generators, the
        samples its IterableDataset replica gave this epoch, and the replica's
        own ``state_dict()`` if it has one (else None)."""
        version, internal, gauss = random.getstate()
        py = (version, array.array("I", internal).tobytes(), gauss)
        ds_state = dataset.state_dict() if dataset is not None and is_stateful(dataset) else None
        return (py, _tensor_bytes(torch.get_rng_state()), self._numpy_state(), samples, ds_state)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, with or without numpy installed."""
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


def trailer(snapshot: tuple) -> bytes:
    """``snapshot`` as it follows a batch's meta in its slot: a pickle and its length."""
    data = pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)
    return data + _TRAILER_LEN.pack(len(data))


def split_trailer(meta: Any) -> Tuple[Any, bytes]:
    """(the meta without its trailer, the trailer's pickle), from a memoryview or bytes."""
    mv = memoryview(meta)
    n = _TRAILER_LEN.unpack(mv[len(mv) - _TRAILER_LEN.size:])[0]
    end = len(mv) - _TRAILER_LEN.size
    return mv[: end - n], bytes(mv[end - n : end])


def apply(session: Any, resume: Optional[tuple]) -> None:
    """Worker side, at the end of a session's set-up: put the replica and
    the generators back to ``resume`` = (snapshot, samples to skip)."""
    if resume is None:
        return
    snapshot, skip = resume
    if skip or snapshot[4] is not None:
        # Mid-epoch: the fetcher made here is that epoch's (the first epoch
        # of the resumed iterator, tagged 0); the next epoch makes a new one.
        session.epoch = 0
    ds_state = snapshot[4]
    if ds_state is not None:
        session.dataset.load_state_dict(ds_state)
        session.fetcher = session.make_fetcher()  # its iterator starts where the state says
    elif skip:
        it = session.fetcher.dataset_iter
        for _ in range(skip):
            try:
                next(it)
            except StopIteration:
                session.iteration_end = True
                break
    restore_generators(snapshot)


def restore_generators(snapshot: tuple) -> None:
    """Put a worker's generators back to ``snapshot`` (see :func:`capture`)."""
    (version, internal, gauss), torch_state, np_state = snapshot[0], snapshot[1], snapshot[2]
    random.setstate((version, tuple(array.array("I", internal)), gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))
    if np_state is not None:
        import numpy as np

        name, keys, pos, has_gauss, cached = np_state
        np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))


def is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and \
        callable(getattr(dataset, "load_state_dict", None))


class CountingIter:
    """An IterableDataset replica's iterator that counts what it gave."""

    __slots__ = ("_it", "count")

    def __init__(self, it: Any, count: int = 0) -> None:
        self._it = it
        self.count = count

    def __iter__(self) -> "CountingIter":
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self.count += 1
        return item


# ---- main side ---------------------------------------------------------------


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
        self.last: List[Any] = [None] * num_workers
        self.last_epoch: List[int] = [-1] * num_workers
        self.made: List[Any] = [None] * num_workers
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
        self.last = list(workers)
        self.made = list(workers)
        self.last_epoch = [self.epoch + 1 if cur else -1 for cur in this_epoch]

    def taken(self, worker: int, idx: int, snapshot: Any, yielded: int) -> None:
        """Batch ``idx`` of ``worker`` left the ring (``yielded``: how many
        batches the loop has received so far this epoch)."""
        if snapshot is not None:
            self.made[worker] = snapshot
        self._pending.append((self._taken, worker, idx, snapshot))
        self._taken += 1
        if len(self._pending) > 2:
            self.fold(yielded)

    def fold(self, yielded: int) -> None:
        """Move what the loop has received out of ``_pending``."""
        while self._pending and self._pending[0][0] < yielded:
            _n, worker, idx, snapshot = self._pending.popleft()
            if snapshot is not None:
                self.last[worker] = snapshot
                self.last_epoch[worker] = self.epoch
            self._ahead.add(idx)
            while self.first_undelivered in self._ahead:
                self._ahead.discard(self.first_undelivered)
                self.first_undelivered += 1

    def worker_states(self) -> List[Optional[Dict[str, Any]]]:
        """Per worker, its capture (plain data) and whether it is of this epoch."""
        return [None if snap is None else
                {"capture": decode(snap), "this_epoch": self.last_epoch[w] == self.epoch}
                for w, snap in enumerate(self.last)]

    def ahead(self) -> List[int]:
        return sorted(self._ahead)


def decode(snapshot: Any) -> Any:
    """A capture as plain data (it travels pickled from the worker)."""
    return pickle.loads(snapshot) if isinstance(snapshot, bytes) else snapshot


def worker_resume(state: Optional[Dict[str, Any]], mid_epoch: bool) -> Optional[tuple]:
    """What a resumed worker's session gets: (capture, samples to skip)."""
    if state is None:
        return None
    capture_ = tuple(state["capture"])
    skip = capture_[3] if mid_epoch and state["this_epoch"] and capture_[4] is None else 0
    return (capture_, skip)


def is_stateful_dataloader_state(sd: Any) -> bool:
    """Whether ``sd`` looks like the state dict torchdata's StatefulDataLoader writes."""
    return isinstance(sd, dict) and _KEY not in sd and (
        "_snapshot" in sd or ("_num_yielded" in sd and "_sampler_iter_state" in sd))


def from_stateful_dataloader(sd: Dict[str, Any], loader: Any) -> Dict[str, Any]:
    """A fastload state from the state dict torchdata's ``StatefulDataLoader``
    writes for a map-style dataset, where the two map exactly: the position
    (batches delivered) and the sampler's order, which is the same when the
    order comes from the loader's ``generator`` (StatefulDataLoader keeps its
    state as the epoch's permutation was drawn) or from no generator at all
    (a sequential sampler). Its workers carry no generator states, so the
    workers start as fresh ones from its base seed, as its own would.
    """
    facts = loader_facts(loader)
    if facts["dataset_kind"] != "map":
        raise ValueError("load_state_dict: a StatefulDataLoader state can be taken over for a "
                         "map-style dataset only")
    main = sd["_snapshot"]["_main_snapshot"] if "_snapshot" in sd else sd
    finished = bool(sd.get("_iterator_finished", False))
    if "_snapshot" in sd:
        position = sd["_snapshot"]["_snapshot_step"] + sd.get("_steps_since_snapshot", 0)
        num_workers = main.get("_num_workers", 0)
    else:
        position, num_workers = sd["_num_yielded"], 0
    if num_workers != facts["num_workers"]:
        raise ValueError(f"load_state_dict: the StatefulDataLoader state was saved with "
                         f"num_workers={num_workers}, this loader has "
                         f"num_workers={facts['num_workers']}; resume needs the same")
    it_state = main.get("_sampler_iter_state") or {}
    it_state = it_state.get("sampler_iter_state", it_state) or {}
    generator = it_state.get("generator") if isinstance(it_state, dict) else None
    if generator is not None and not isinstance(loader.generator, torch.Generator):
        raise ValueError("load_state_dict: this StatefulDataLoader state shuffles with its own "
                         "generator; fastload can take its order over only when the loader is "
                         "given a generator (generator=torch.Generator()), as torch's "
                         "RandomSampler then draws its permutation from it")
    base_seed = main.get("_base_seed")
    if base_seed is None:
        base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    start = {"torch_rng": torch.get_rng_state(), "generator": generator, "samplers": {},
             "first_iter": False, "base_seed": base_seed}
    nw = facts["num_workers"]
    return {**facts, "position": None if finished else int(position), "delivered_ahead": [],
            "epoch_start": start, "base_seed": base_seed, "next_worker": int(position) % max(nw, 1),
            "workers_active": [True] * nw, "workers": [None] * nw, "dataset_state": None}


def check_compatible(saved: Dict[str, Any], here: Dict[str, Any]) -> None:
    """Raise ValueError naming what differs between a saved state and this loader."""
    if not isinstance(saved, dict) or _KEY not in saved:
        raise ValueError("load_state_dict: not a fastload loader state (no "
                         f"'{_KEY}' entry); got keys {sorted(saved)[:8] if isinstance(saved, dict) else type(saved).__name__}")
    if saved[_KEY] != FORMAT:
        raise ValueError(f"load_state_dict: state format {saved[_KEY]} was written by another "
                         f"fastload version; this one reads format {FORMAT}")
    for key in ("num_workers", "batch_size", "drop_last", "dataset_kind", "dataset_len",
                "persistent_workers"):
        if saved.get(key) != here.get(key):
            raise ValueError(f"load_state_dict: the state was saved with {key}={saved.get(key)!r}, "
                             f"this loader has {key}={here.get(key)!r}; resume needs the same")


def loader_facts(loader: Any) -> Dict[str, Any]:
    """What a state must agree with to resume exactly on ``loader``."""
    from torch.utils.data import _DatasetKind

    kind = "map" if loader._dataset_kind == _DatasetKind.Map else "iterable"
    length = None
    if kind == "map":
        try:
            length = len(loader.dataset)
        except TypeError:
            pass
    return {_KEY: FORMAT, "num_workers": loader.num_workers, "batch_size": loader.batch_size,
            "drop_last": loader.drop_last, "dataset_kind": kind, "dataset_len": length,
            "persistent_workers": bool(loader.persistent_workers and loader.num_workers > 0)}
