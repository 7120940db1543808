"""A worker's resumable state: captured after each batch, put back on resume.

Runs in worker processes (see NOTE [ Resume ] in :mod:`fastload.resume.book`).
After each batch, :class:`Capturer` takes the worker's ``random``, torch and
numpy generator states and what its IterableDataset replica has given
(:class:`CountingIter`, or the replica's own ``state_dict()``); the capture
follows the batch's meta in its slot as a trailer
(:func:`fastload.transport.format.trailer`), which the main process cuts
off again. A resumed or restarted worker is put back to a capture by
:func:`apply`.
"""

from __future__ import annotations

import array
import random
import sys
from typing import Any, Optional

import torch

__all__ = ["Capturer", "CountingIter", "apply", "restore_generators", "is_stateful"]


class Capturer:
    """Captures a worker's state at the end of each batch.

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
        return (py, tensor_bytes(torch.get_rng_state()), self._numpy_state(), samples, ds_state)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, with or without numpy installed."""
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


def apply(session: Any, resume: Optional[tuple]) -> None:
    """Worker side, at the end of a session's set-up: put the replica and
    the generators back to ``resume`` = (capture, samples to skip)."""
    if resume is None:
        return
    capture, skip = resume
    if skip or capture[4] is not None:
        # Mid-epoch: the fetcher made here is that epoch's (the first epoch
        # of the resumed iterator, tagged 0); the next epoch makes a new one.
        session.epoch = 0
    ds_state = capture[4]
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
    restore_generators(capture)


def restore_generators(capture: tuple) -> None:
    """Put a worker's generators back to ``capture`` (see :func:`capture`)."""
    (version, internal, gauss), torch_state, np_state = capture[0], capture[1], capture[2]
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
