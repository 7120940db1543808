"""The loader's copies of the big buffers its sessions carry.

A numpy array or a pickle-5 buffer that is not a file mapping and not in
shared memory is copied into a memfd once per loader (:class:`SharedBuffers`,
main process), reused at later epochs while the bytes are unchanged and made
anew when they changed, and mapped copy-on-write on the other side
(:func:`_map_arena`, worker side): nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from typing import Any, Dict, Optional, Tuple

import torch

from .memfds import KeptFd, address_of, bytes_view, memfd, page_up, same_bytes

__all__ = ["BufferRef", "SharedBuffers"]

_ARENA_NAME = "fastload-buffers"  # SharedBuffers' copies



@dataclasses.dataclass
class _Arena:
    """One memfd holding buffers' copies, each at a page boundary."""

    fd: int
    size: int
    view: Optional[mmap.mmap]  # the main process's read-only map, to compare with

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


@dataclasses.dataclass
class _Copy:
    arena: _Arena
    offset: int
    nbytes: int


class BufferRef:
    """A buffer's copy in an arena, inside one session: pickled as the arena
    (once, by pickle's memo) and the copy's place in it."""

    def __init__(self, arena: "_ArenaRef", offset: int, nbytes: int) -> None:
        self.arena, self.offset, self.nbytes = arena, offset, nbytes

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _slice_arena, (self.arena, self.offset, self.nbytes)


class _ArenaRef:
    def __init__(self, arena: _Arena) -> None:
        self.arena = arena

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _map_arena, (KeptFd(self.arena.fd),)


def _map_arena(fd: int) -> memoryview:
    """An arena on the receiving side, mapped copy-on-write: what is
    rebuilt over it is writable, and writes stay in this process."""
    try:
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def _slice_arena(arena: memoryview, offset: int, nbytes: int) -> memoryview:
    return arena[offset:offset + nbytes]


class SharedBuffers:
    """The loader's copies of the big buffers its sessions carry (main
    process).

    :meth:`add` returns a reference to a copy of the bytes, in a memfd: the
    copy made for an earlier session when the same memory still holds the
    same bytes, or a new one. A session's new copies share one memfd (one fd
    to pass, whatever the number of buffers). Copies no session of the
    loader still refers to are dropped when the next one is packed;
    :meth:`close` drops them all (the loader's end).
    """

    def __init__(self) -> None:
        self._copies: Dict[Tuple[int, int], _Copy] = {}  # by (address, length) of the original
        self._used: Dict[Tuple[int, int], _Copy] = {}  # those the session being packed uses
        self._refs: Dict[int, _ArenaRef] = {}
        self._new: Optional[_Arena] = None

    def begin(self) -> None:
        """A session is being packed."""
        self._used, self._refs, self._new = {}, {}, None

    def add(self, view: torch.Tensor) -> BufferRef:
        """A reference to a copy of the bytes ``view`` (a uint8 tensor over
        them) holds now."""
        key = (view.data_ptr(), view.numel())
        copy = self._used.get(key) or self._copies.get(key)
        if copy is not None and (copy.arena.view is None or self._holds(copy, view)):
            self._used[key] = copy  # (no view yet: copied during this packing)
            return BufferRef(self._ref(copy.arena), copy.offset, copy.nbytes)
        # A new copy, in this packing's arena (made on its first copy, grown
        # by each; the receiving side maps it whole once it is complete).
        arena = self._new
        if arena is None:
            arena = self._new = _Arena(memfd(_ARENA_NAME, 0), 0, None)
        offset, nbytes = arena.size, view.numel()
        span = page_up(nbytes)
        os.ftruncate(arena.fd, offset + span)
        with mmap.mmap(arena.fd, span, offset=offset) as out:
            bytes_view(address_of(out), nbytes, None).copy_(view)
        arena.size = offset + span
        copy = self._used[key] = _Copy(arena, offset, nbytes)
        return BufferRef(self._ref(arena), offset, nbytes)

    @staticmethod
    def _holds(copy: _Copy, view: torch.Tensor) -> bool:
        assert copy.arena.view is not None
        held = bytes_view(address_of(copy.arena.view) + copy.offset, copy.nbytes, None)
        return same_bytes(held, view)

    def _ref(self, arena: _Arena) -> _ArenaRef:
        ref = self._refs.get(id(arena))
        if ref is None:
            ref = self._refs[id(arena)] = _ArenaRef(arena)
        return ref

    def finish(self) -> None:
        """The session is packed: keep the copies it uses, drop the rest."""
        arena = self._new
        if arena is not None and arena.size:
            arena.view = mmap.mmap(arena.fd, arena.size, prot=mmap.PROT_READ)
        live = {id(c.arena) for c in self._used.values()}
        for copy in self._copies.values():
            if id(copy.arena) not in live:
                copy.arena.close()
        self._copies, self._used, self._refs, self._new = self._used, {}, {}, None

    def abort(self) -> None:
        """Packing failed: the copies from before it stay."""
        if self._new is not None:
            self._new.close()
        self._used, self._refs, self._new = {}, {}, None

    def close(self) -> None:
        """Drop every copy (the loader is gone)."""
        for copy in list(self._copies.values()) + list(self._used.values()):
            copy.arena.close()
        self._copies, self._used = {}, {}

    @property
    def nbytes(self) -> int:
        """The bytes the copies take (for diagnostics and tests)."""
        return sum({id(c.arena): c.arena.size for c in self._copies.values()}.values())
