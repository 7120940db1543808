"""``fastload.share``: shared memory made once, for every loader and worker.

:func:`share` puts a numpy array, a tensor, or a list of ``str``, ``bytes``
or ``int`` in a memfd (never ``/dev/shm``) for good, and returns what the
dataset should hold instead: an array over it, the tensor moved in place,
or a :class:`SharedSequence`. :mod:`.references` sends them to workers by
reference (:func:`shared_fd_of`, :class:`SharedRef`); workers map them
copy-on-write.
"""

from __future__ import annotations

import collections.abc
import mmap
import os
import struct
import sys
import weakref
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Union, overload

import torch

from .memfds import KeptFd, address_of, memfd, movable, move_to_shared

__all__ = ["SharedRef", "SharedSequence", "share", "shared_fd_of", "view_shared"]

_SHARED_NAME = "fastload-shared"  # fastload.share's memory



# The memfds of the memory fastload.share() made in this process, by the
# mmap its arrays view (an array's ``base`` chain ends there): how a shared
# array is told from any other when it is pickled. An entry, and its fd,
# go with the mmap.
_SHARED_MAPS: "weakref.WeakKeyDictionary[mmap.mmap, int]" = weakref.WeakKeyDictionary()


def _shared_map(size: int) -> Tuple[mmap.mmap, int]:
    """A new shared map of ``size`` bytes backed by a memfd, and the memfd
    (kept open while the map lives, closed with it)."""
    fd = memfd(_SHARED_NAME, size)
    try:
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    _SHARED_MAPS[mapping] = fd
    weakref.finalize(mapping, os.close, fd)
    return mapping, fd


def shared_fd_of(arr: Any) -> Optional[Tuple[int, int]]:
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap):
        return None
    fd = _SHARED_MAPS.get(base)
    if fd is None:
        return None
    return fd, address_of(base)


class SharedRef:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _map_shared, (KeptFd(self.fd),)


def _map_shared(fd: int) -> memoryview:
    """Shared memory on the receiving side, copy-on-write (as a forked
    worker's view of it is)."""
    try:
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def view_shared(view: memoryview, offset: int, nbytes: int, skip: int, dtype: Any,
                 shape: Tuple[int, ...], strides: Tuple[int, ...]) -> Any:
    import numpy as np
    return np.ndarray(shape, dtype, buffer=view[offset:offset + nbytes], offset=skip, strides=strides)


_KINDS = {str: 0, bytes: 1, int: 2}
_HEAD = struct.Struct("<qq")  # kind, length


class SharedSequence(collections.abc.Sequence):
    """A read-only list of ``str``, ``bytes`` or ``int`` in shared memory
    (made by :func:`share`).

    It indexes, slices (a slice is a plain ``list``), iterates, compares
    equal to the list it was made from, and pickles like it. Its items are
    built when read, so reading it writes to no shared page (no reference
    count lives there): a worker's memory does not grow as it reads, as it
    does under fork with a list of millions of Python strings
    (copy-on-read). Workers receive it by reference, not by value.
    """

    def __init__(self, items: Iterable[Union[str, bytes, int]] = ()) -> None:
        items = list(items)
        kinds = {type(x) for x in items}
        if len(kinds) > 1 or (kinds and not kinds <= set(_KINDS)):
            raise TypeError("fastload.share: a list to share must hold only str, only bytes or only "
                            f"int, not {', '.join(sorted(k.__name__ for k in kinds))}")
        kind = _KINDS[kinds.pop()] if kinds else 1
        n = len(items)
        if kind == 2:
            try:
                body = struct.pack(f"<{n}q", *items)
            except struct.error:
                raise OverflowError("fastload.share: an int in the list does not fit in 64 bits") from None
        else:
            blobs = [x.encode("utf-8", "surrogatepass") if kind == 0 else x for x in items]
            ends, total = [], 0
            for b in blobs:
                total += len(b)
                ends.append(total)
            body = struct.pack(f"<{n}q", *ends) + b"".join(blobs)
        mapping, fd = _shared_map(_HEAD.size + len(body))
        mapping[:] = _HEAD.pack(kind, n) + body
        self._attach(memoryview(mapping), fd)

    def _attach(self, view: memoryview, fd: Optional[int]) -> None:
        self._view, self._fd = view, fd  # fd: None where it was received (sent on by value)
        kind, n = _HEAD.unpack_from(view)
        self._kind, self._len = kind, n
        body = view[_HEAD.size:]
        self._ends = body[:8 * n].cast("q")
        self._data = body[8 * n:]

    def __len__(self) -> int:
        return self._len

    def _item(self, i: int) -> Union[str, bytes, int]:
        if self._kind == 2:
            return int(self._ends[i])
        lo = self._ends[i - 1] if i else 0
        raw = bytes(self._data[lo:self._ends[i]])
        return raw.decode("utf-8", "surrogatepass") if self._kind == 0 else raw

    @overload
    def __getitem__(self, i: int) -> Union[str, bytes, int]: ...

    @overload
    def __getitem__(self, i: slice) -> List[Union[str, bytes, int]]: ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(self._len))]
        try:
            j = i.__index__()
        except AttributeError:
            raise TypeError(f"list indices must be integers or slices, not {type(i).__name__}") from None
        if j < 0:
            j += self._len
        if not 0 <= j < self._len:
            raise IndexError("list index out of range")
        return self._item(j)

    def __iter__(self) -> Iterator[Union[str, bytes, int]]:
        for j in range(self._len):
            yield self._item(j)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (SharedSequence, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a list is

    def __repr__(self) -> str:
        head = ", ".join(repr(self._item(j)) for j in range(min(self._len, 3)))
        more = ", ..." if self._len > 3 else ""
        return f"SharedSequence([{head}{more}], len={self._len})"

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # By reference while a process is being started (a session, or
        # multiprocessing's spawn); by value anywhere else (a file, say).
        from multiprocessing import context
        if self._fd is not None and context.get_spawning_popen() is not None:
            return _attach_sequence, (SharedRef(self._fd),)
        return SharedSequence, (list(self),)


def _attach_sequence(view: memoryview) -> SharedSequence:
    seq = SharedSequence.__new__(SharedSequence)
    seq._attach(view, None)
    return seq


def share(obj: Any) -> Any:
    """Put ``obj`` in shared memory, once, so that every worker of every
    loader reads one copy of it.

    * a numpy array: returns an array with the same values, dtype and
      shape, backed by shared memory (a memfd, not ``/dev/shm``); workers
      receive it by reference and map it copy-on-write, so their writes
      stay their own.
    * a CPU tensor: moves its storage into shared memory in place (as
      ``share_memory_()`` does, but not in ``/dev/shm``) and returns it.
    * a list or tuple of ``str``, ``bytes`` or ``int`` (paths, labels,
      captions): returns a :class:`SharedSequence`, read-only, which
      workers read without their memory growing.

    Keep the returned object in the dataset in place of the one given.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"fastload.share: only CPU tensors can be shared, not {obj.device}")
        storage = obj.untyped_storage()
        if not storage.is_shared():
            if not hasattr(storage, "_swap_data_ptr_"):
                raise RuntimeError(f"fastload.share: torch {torch.__version__} cannot move a tensor's "
                                   "memory in place (it lacks UntypedStorage._swap_data_ptr_; torch "
                                   "2.13 has it): share a numpy array instead")
            if not movable(storage):
                raise ValueError("fastload.share: this tensor's memory is not torch's own (made by "
                                 "torch.from_numpy or torch.frombuffer?): share the array instead")
            move_to_shared(storage)
        return obj
    if isinstance(obj, SharedSequence):
        return obj
    if isinstance(obj, (list, tuple)):
        return SharedSequence(obj)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("fastload.share: an array of Python objects cannot be shared")
        mapping, _fd = _shared_map(max(obj.nbytes, 1))
        out = np.ndarray(obj.shape, obj.dtype, buffer=mapping)
        out[...] = obj
        return out
    raise TypeError("fastload.share: expected a numpy array, a CPU tensor, or a list of str, bytes "
                    f"or int, but got {type(obj).__name__}")
