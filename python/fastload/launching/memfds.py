"""Memfds that hold what fastload shares, and the tools around them.

Shared by :mod:`.buffer_copies`, :mod:`.share` and :mod:`.references`:
making a memfd, passing the fd of one this process keeps, looking at bytes
as a tensor (torch's copy and ``equal`` are vectorised; numpy is optional),
and moving a tensor's storage into a memfd in place
(:func:`move_to_shared`). Main process side, but for :func:`detach`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import warnings
from multiprocessing import reduction
from typing import Any, Optional, Tuple

import torch

__all__ = ["PAGE", "KeptFd", "address_of", "bytes_view", "memfd", "movable", "move_to_shared",
           "page_up", "resizable", "same_bytes", "storage_fd"]

PAGE = mmap.ALLOCATIONGRANULARITY
MOVED_NAME = "fastload-data"  # a tensor moved by fastload: mapped copy-on-write by workers


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def bytes_view(address: int, nbytes: int, keep: Any) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``address`` (memory that ``keep``
    keeps alive): how bytes are copied and compared here (torch's copy and
    ``equal`` are vectorised; numpy is optional)."""
    buf = (ctypes.c_char * nbytes).from_address(address)
    with warnings.catch_warnings():  # a read-only source warns; we only read it
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=torch.uint8)  # type: ignore[arg-type]
    t._fastload_keep = keep  # type: ignore[attr-defined]
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 tensors of one length hold the same bytes (compared
    eight at a time where aligned: eight times faster than byte by byte)."""
    n = a.numel()
    bulk = n - n % 8
    if bulk and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        if not torch.equal(a[:bulk].view(torch.int64), b[:bulk].view(torch.int64)):
            return False
        return torch.equal(a[bulk:], b[bulk:])
    return torch.equal(a, b)


class KeptFd:
    """An fd this process keeps (a moved tensor's, an arena's), pickled as a
    duplicate the receiving side owns (``reduction.DupFd``: fastload's
    collector while a session is packed, multiprocessing's while a process
    is started)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return detach, (reduction.DupFd(self.fd),)


def detach(handle: Any) -> int:
    return int(handle.detach())



def address_of(buffer: Any) -> int:
    """The address of a writable or read-only buffer's first byte."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()

def storage_fd(storage: torch.UntypedStorage) -> Optional[int]:
    """The memfd a storage that fastload moved lives in (kept by torch's
    mapping), or None for any other storage (torch's own shared memory keeps
    DataLoader's shared semantics: see parcels)."""
    if not storage.is_shared():
        return None
    try:
        fd = storage._share_fd_cpu_()[0]  # private; pinned by tests/test_references.py
        target = os.readlink(f"/proc/self/fd/{fd}")
    except Exception:  # noqa: BLE001 - a file_system-strategy storage, or no fd
        return None
    return fd if target.startswith(f"/memfd:{MOVED_NAME}") else None


def resizable(storage: torch.UntypedStorage) -> bool:
    """Whether torch allocated the storage's memory itself (not numpy's,
    a file mapping's or a buffer's). Torch before 2.2 cannot say: False."""
    resizable = getattr(storage, "resizable", None)
    return bool(resizable()) if resizable is not None else False


def movable(storage: torch.UntypedStorage) -> bool:
    """Whether the storage's memory is torch's own and this torch can swap
    it for a memfd's in place (``_swap_data_ptr_``: torch 2.13 and 2.15 have
    it, 2.11 and 2.1 do not), without un-aliasing anything that views it."""
    return (resizable(storage) and hasattr(storage, "_swap_data_ptr_")
            and hasattr(torch.UntypedStorage, "_new_shared_fd_cpu"))


_MOVE_CHUNK = 64 << 20  # bytes copied between releases of the old pages
_MADV_DONTNEED = 4


def _release_pages(address: int, nbytes: int) -> None:
    """Give the whole pages inside [address, address + nbytes) back to the
    system (they read as zeros from now on)."""
    lo = -(-address // PAGE) * PAGE
    hi = (address + nbytes) // PAGE * PAGE
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_DONTNEED)  # advice: failure only keeps pages


def move_to_shared(storage: torch.UntypedStorage) -> int:
    """Move a CPU storage's bytes, in place, into a new memfd: every tensor
    viewing the storage keeps its values and now views shared memory.
    Returns the memfd (kept open by torch's mapping, closed when the storage
    is freed).

    One copy of the bytes, made a chunk at a time. Where no other Python
    thread runs (none can read the storage meanwhile), each chunk's old
    pages are given back as soon as it is copied, so the move never holds
    the data twice: a 20 GiB tensor needs 20 GiB and a chunk, not 40 GiB.
    With other threads running, the old pages go only once the move is
    done (a thread reading the tensor meanwhile must not see zeros)."""
    nbytes = storage.nbytes()
    fd = memfd(MOVED_NAME, nbytes)
    try:
        # Private, as torch.multiprocessing uses it: a storage mapping the
        # memfd that keeps its fd (pinned by tests/test_references.py).
        new = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)
    finally:
        os.close(fd)  # the new storage holds its own duplicate
    src = torch.empty((0,), dtype=torch.uint8).set_(storage)
    dst = torch.empty((0,), dtype=torch.uint8).set_(new)
    alone = threading.active_count() == 1
    for start in range(0, nbytes, _MOVE_CHUNK):
        end = min(nbytes, start + _MOVE_CHUNK)
        dst[start:end].copy_(src[start:end])
        if alone:
            _release_pages(storage.data_ptr() + start, end - start)
    del src, dst
    # Private: swaps the two storages' memory in place, as share_memory_()
    # does, so views, the tensor object and its autograd state all follow.
    storage._swap_data_ptr_(new)
    del new  # the storage's former memory, freed
    moved = storage_fd(storage)
    assert moved is not None, "fastload: a moved storage lost its memfd"
    return moved
