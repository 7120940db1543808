"""What fork would share, sent by reference: tensors, arrays, mapped files.

Under ``fork``, a worker sees the training process's memory as it is: a
dataset holding a 2 GiB tensor, a numpy array or a memory-mapped token file
costs nothing more per worker, and nothing per epoch. Pickled by value, the
same dataset would be copied into every epoch's session and unpickled there.
While :func:`fastload.launching.crossing.pack` pickles a session, this
module sends such data by reference instead (main process side), and maps it
again on the other side (worker side):

* **Tensors.** A CPU tensor of at least :data:`MOVE_BYTES` whose storage is
  not yet shared is *moved*, once and in place, into a memfd: the user's
  tensor is the same object with the same values and the same views, its
  memory now shared, as ``share_memory_()`` does for DataLoader's spawn
  workers, except that a memfd is not limited by the size of ``/dev/shm``.
  It is sent as that memfd, and a worker maps it copy-on-write: its writes
  stay its own, as under fork. Later epochs, iterators and loaders find the
  storage shared already and send the same memfd. A storage fastload cannot
  move (not owned by torch's allocator: ``torch.from_numpy``,
  ``torch.frombuffer``; or a torch without the call that moves it) is sent
  as a buffer, below, never un-aliased from what it views.
* **Mapped files.** A numpy array whose memory is a mapping of a file
  (``np.memmap``, ``np.load(..., mmap_mode=...)``, their slices and views) is
  sent as (path, offset, dtype, shape, strides, mode) and the file is mapped
  again, so the pages are shared through the page cache exactly as under
  fork: ``'r'`` stays read-only, ``'r+'`` writes to the file, ``'c'`` keeps
  writes private. An array in a private mapping that this process has
  written to (mode ``'c'``) is sent as a buffer instead: its bytes differ
  from the file's.
* **Other large buffers** (numpy arrays, pickle-5 buffers of any object):
  copied into a memfd kept by the loader (:class:`SharedBuffers`), which
  reuses the copy at later epochs while the bytes are unchanged and makes a
  new one when they changed (what the next epoch's workers see is what the
  dataset holds at that ``iter()``, as under fork), mapped copy-on-write on
  the other side, not unpickled.
* :func:`share` puts an array, a tensor, or a list of ``str``, ``bytes`` or
  ``int`` into shared memory for good, for one copy in all processes.

Small objects (under :data:`BUFFER_BYTES`) travel as bytes: a reference
costs more than it saves there.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import mmap
import os
import pickle
import struct
import sys
import threading
import warnings
import weakref
from multiprocessing import reduction
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union, overload

import torch

log = logging.getLogger("fastload")

__all__ = ["BUFFER_BYTES", "MOVE_BYTES", "SharedBuffers", "SharedSequence", "move_to_shared",
           "reduce_by_reference", "share"]

BUFFER_BYTES = 64 << 10  # a buffer this big or bigger crosses out of band
MOVE_BYTES = 4 << 20  # a tensor storage this big or bigger is moved into a memfd of its own
# At most this many storages of one session go as memfds of their own (each
# an fd passed, and one kept per moved tensor): the rest go through
# SharedBuffers, whose copies share one memfd (a message passes 250 fds).
_FDS_PER_PACK = 64
_PAGE = mmap.ALLOCATIONGRANULARITY
_MEMFD_NAME = "fastload-data"  # a tensor moved by fastload: mapped copy-on-write by workers
_ARENA_NAME = "fastload-buffers"  # SharedBuffers' copies
_SHARED_NAME = "fastload-shared"  # fastload.share's memory


def _page_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bytes_view(address: int, nbytes: int, keep: Any) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``address`` (memory that ``keep``
    keeps alive): how bytes are copied and compared here (torch's copy and
    ``equal`` are vectorised; numpy is optional)."""
    import ctypes
    buf = (ctypes.c_char * nbytes).from_address(address)
    with warnings.catch_warnings():  # a read-only source warns; we only read it
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=torch.uint8)  # type: ignore[arg-type]
    t._fastload_keep = keep  # type: ignore[attr-defined]
    return t


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two uint8 tensors of one length hold the same bytes (compared
    eight at a time where aligned: eight times faster than byte by byte)."""
    n = a.numel()
    bulk = n - n % 8
    if bulk and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
        if not torch.equal(a[:bulk].view(torch.int64), b[:bulk].view(torch.int64)):
            return False
        return torch.equal(a[bulk:], b[bulk:])
    return torch.equal(a, b)


# ---- passing fds ------------------------------------------------------------


class _Fd:
    """An fd this process keeps (a moved tensor's, an arena's), pickled as a
    duplicate the receiving side owns (``reduction.DupFd``: fastload's
    collector while a session is packed, multiprocessing's while a process
    is started)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(handle: Any) -> int:
    return int(handle.detach())


# ---- tensors ------------------------------------------------------------------


def _storage_fd(storage: torch.UntypedStorage) -> Optional[int]:
    """The memfd a storage that fastload moved lives in (kept by torch's
    mapping), or None for any other storage (torch's own shared memory keeps
    DataLoader's shared semantics: see crossing)."""
    if not storage.is_shared():
        return None
    try:
        fd = storage._share_fd_cpu_()[0]  # private; pinned by tests/test_references.py
        target = os.readlink(f"/proc/self/fd/{fd}")
    except Exception:  # noqa: BLE001 - a file_system-strategy storage, or no fd
        return None
    return fd if target.startswith(f"/memfd:{_MEMFD_NAME}") else None


def _resizable(storage: torch.UntypedStorage) -> bool:
    """Whether torch allocated the storage's memory itself (not numpy's,
    a file mapping's or a buffer's). Torch before 2.2 cannot say: False."""
    resizable = getattr(storage, "resizable", None)
    return bool(resizable()) if resizable is not None else False


def _movable(storage: torch.UntypedStorage) -> bool:
    """Whether the storage's memory is torch's own and this torch can swap
    it for a memfd's in place (``_swap_data_ptr_``: torch 2.13 and 2.15 have
    it, 2.11 and 2.1 do not), without un-aliasing anything that views it."""
    return (_resizable(storage) and hasattr(storage, "_swap_data_ptr_")
            and hasattr(torch.UntypedStorage, "_new_shared_fd_cpu"))


_MOVE_CHUNK = 64 << 20  # bytes copied between releases of the old pages
_MADV_DONTNEED = 4


def _release_pages(address: int, nbytes: int) -> None:
    """Give the whole pages inside [address, address + nbytes) back to the
    system (they read as zeros from now on)."""
    import ctypes
    lo = -(-address // _PAGE) * _PAGE
    hi = (address + nbytes) // _PAGE * _PAGE
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
    fd = _memfd(_MEMFD_NAME, nbytes)
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
    moved = _storage_fd(storage)
    assert moved is not None, "fastload: a moved storage lost its memfd"
    return moved


class _StorageRef:
    """A moved storage inside one session: pickled once (pickle's memo
    keeps one per storage), mapped copy-on-write on the other side."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _map_storage, (_Fd(self.fd), self.nbytes)


def _map_storage(fd: int, nbytes: int) -> torch.UntypedStorage:
    """A moved storage on the receiving side: its memfd mapped copy-on-write
    (``from_file`` with ``shared=False`` is ``MAP_PRIVATE``)."""
    try:
        return torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", False, nbytes)
    finally:
        os.close(fd)


def _rebuild_tensor(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int,
                    size: Tuple[int, ...], stride: Tuple[int, ...], requires_grad: bool,
                    parameter: bool) -> torch.Tensor:
    t = torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _tensor_by_reference(t: torch.Tensor, packing: "Packing") -> Any:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_sparse:
        return NotImplemented
    if t.is_conj() or t.is_neg() or (t.requires_grad and not t.is_leaf):
        return NotImplemented  # plain pickle says what it says of these
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    fd = _storage_fd(storage)
    if fd is None:
        if storage.is_shared() or nbytes < BUFFER_BYTES:
            return NotImplemented  # torch's sharing (crossing), or small: bytes
        if t.is_pinned():
            return NotImplemented  # page-locked memory stays where it is
        if nbytes >= MOVE_BYTES and len(packing.storages) < _FDS_PER_PACK and _movable(storage):
            fd = move_to_shared(storage)
            log.debug("fastload: moved a %d-byte tensor storage into shared memory", nbytes)
    if fd is not None and fd not in packing.storages and len(packing.storages) >= _FDS_PER_PACK:
        fd = None  # past the session's fd budget: this one goes as a buffer copy
    if fd is None and not storage.is_shared() and not _resizable(storage):
        mapped = _mapped_storage(storage, t.element_size())
        if mapped is not None:  # torch.load(mmap=True), torch.from_file: the file again
            return _rebuild_tensor, (mapped, t.dtype, t.storage_offset() + mapped.first // t.element_size(),
                                     tuple(t.size()),
                                     tuple(t.stride()), t.requires_grad,
                                     type(t) is torch.nn.Parameter)
    if fd is not None:
        ref = packing.storages.get(fd)
        if ref is None:
            ref = packing.storages[fd] = _StorageRef(fd, nbytes)
    else:
        if packing.buffers is None:
            return NotImplemented
        key = ("storage", storage.data_ptr(), nbytes)
        ref = packing.memo.get(key)
        if ref is None:
            view = _bytes_view(storage.data_ptr(), nbytes, storage)
            ref = packing.memo[key] = _BufferStorage(packing.buffers.add(view))
    return _rebuild_tensor, (ref, t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()),
                             t.requires_grad, type(t) is torch.nn.Parameter)


class _FileStorage:
    """A storage that maps a file (``torch.load(..., mmap=True)``), sent as
    the file: mapped again on the other side, from the file's start (the
    storage begins ``first`` bytes in)."""

    def __init__(self, path: str, first: int, nbytes: int, shared: bool,
                 identity: Tuple[int, int]) -> None:
        self.first = first
        self.args = (path, first + nbytes, shared, identity)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _map_file_storage, self.args


def _mapped_storage(storage: torch.UntypedStorage, itemsize: int) -> Optional[_FileStorage]:
    """The file a storage's memory maps, unchanged by this process, or None."""
    lo, nbytes = storage.data_ptr(), storage.nbytes()
    found = _unchanged_file_mapping(lo, lo + nbytes)
    if found is None:
        return None
    m, identity = found
    first = m.offset + (lo - m.start)
    if first % itemsize:
        return None  # a storage offset in elements could not say where it starts
    return _FileStorage(m.path, first, nbytes, m.perms[3] == "s" and "w" in m.perms, identity)


def _map_file_storage(path: str, end: int, shared: bool,
                      identity: Tuple[int, int]) -> torch.UntypedStorage:
    st = os.stat(path)
    if (st.st_dev, st.st_ino) != identity:
        raise RuntimeError(f"fastload: {path} was replaced since the dataset mapped it; "
                           "the workers cannot map the same file")
    return torch.UntypedStorage.from_file(path, shared, end)


class _BufferStorage:
    """A storage sent as a buffer (:class:`SharedBuffers`); rebuilt as a
    storage over the mapped bytes."""

    def __init__(self, buf: "_BufferRef") -> None:
        self.buf = buf

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _buffer_storage, (self.buf,)


def _buffer_storage(view: memoryview) -> torch.UntypedStorage:
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


# ---- one packing ------------------------------------------------------------------


class Packing:
    """What one :func:`fastload.launching.crossing.pack` sends by reference
    (main process): the storages and buffers met so far, so that each is
    sent once however many objects view it, and the pickle-5 buffers sent
    out of band. ``buffers``: the loader's copies (None: big arrays and
    buffers travel as bytes; moved tensors and mapped files still go by
    reference)."""

    def __init__(self, buffers: Optional["SharedBuffers"]) -> None:
        self.buffers = buffers
        self.storages: Dict[int, _StorageRef] = {}
        self.memo: Dict[Tuple[Any, ...], Any] = {}
        self.out_of_band: List["_BufferRef"] = []

    def buffer_callback(self, buf: "pickle.PickleBuffer") -> bool:
        """pickle's ``buffer_callback``: a big buffer goes to the loader's
        copies and is sent out of band (False); a small one in band."""
        if self.buffers is None:
            return True
        with buf.raw() as raw:
            if raw.nbytes < BUFFER_BYTES:
                return True
            view = _bytes_view(_address_of(raw), raw.nbytes, buf)
        self.out_of_band.append(self.buffers.add(view))
        return False


def reduce_by_reference(obj: Any, packing: Packing) -> Any:
    """How ``obj`` crosses by reference (a reduce tuple), or NotImplemented
    where it crosses as pickle has it."""
    cls = type(obj)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return _tensor_by_reference(obj, packing)
    np = sys.modules.get("numpy")
    if np is not None and (cls is np.ndarray or cls is np.memmap):
        return _array_by_reference(obj, packing)
    return NotImplemented


# ---- buffers copied once per loader ------------------------------------------


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


class _BufferRef:
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
        return _map_arena, (_Fd(self.arena.fd),)


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

    def add(self, view: torch.Tensor) -> _BufferRef:
        """A reference to a copy of the bytes ``view`` (a uint8 tensor over
        them) holds now."""
        key = (view.data_ptr(), view.numel())
        copy = self._used.get(key) or self._copies.get(key)
        if copy is not None and (copy.arena.view is None or self._holds(copy, view)):
            self._used[key] = copy  # (no view yet: copied during this packing)
            return _BufferRef(self._ref(copy.arena), copy.offset, copy.nbytes)
        # A new copy, in this packing's arena (made on its first copy, grown
        # by each; the receiving side maps it whole once it is complete).
        arena = self._new
        if arena is None:
            arena = self._new = _Arena(_memfd(_ARENA_NAME, 0), 0, None)
        offset, nbytes = arena.size, view.numel()
        span = _page_up(nbytes)
        os.ftruncate(arena.fd, offset + span)
        with mmap.mmap(arena.fd, span, offset=offset) as out:
            _bytes_view(_address_of(out), nbytes, None).copy_(view)
        arena.size = offset + span
        copy = self._used[key] = _Copy(arena, offset, nbytes)
        return _BufferRef(self._ref(arena), offset, nbytes)

    @staticmethod
    def _holds(copy: _Copy, view: torch.Tensor) -> bool:
        assert copy.arena.view is not None
        held = _bytes_view(_address_of(copy.arena.view) + copy.offset, copy.nbytes, None)
        return _same_bytes(held, view)

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


def _address_of(buffer: Any) -> int:
    """The address of a writable or read-only buffer's first byte."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(buffer, dtype=torch.uint8, count=1).data_ptr()


# ---- numpy arrays ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Mapping:
    """One line of /proc/self/maps."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str


def _mappings() -> List[_Mapping]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append(_Mapping(lo, hi, parts[1], int(parts[2], 16), int(parts[4]), parts[5].rstrip("\n")))
    return out


def _private_pages_written(mapping: _Mapping) -> bool:
    """Whether this process wrote to pages of a private file mapping (they
    are anonymous copies now, no longer the file's)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            if line[:1] in "0123456789abcdef" and "-" in line.split(maxsplit=1)[0]:
                inside = int(line.split("-", 1)[0], 16) == mapping.start
            elif inside and line.startswith("Anonymous:"):
                return int(line.split()[1]) > 0
    return True  # not found: assume the worst


def _span(arr: Any) -> Tuple[int, int]:
    """[lowest, highest) address of the bytes an array's elements occupy."""
    lo = hi = arr.ctypes.data
    for n, s in zip(arr.shape, arr.strides):
        if n == 0:
            return lo, lo
        if s >= 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    return lo, hi + arr.itemsize


def _unchanged_file_mapping(lo: int, hi: int) -> Optional[Tuple[_Mapping, Tuple[int, int]]]:
    """The mapping of a file that holds [lo, hi) of this process's memory,
    and the file's identity, if its path still names that file and this
    process has not written to a private mapping of it (its bytes would no
    longer be the file's); else None."""
    for m in _mappings():
        if m.start <= lo and hi <= m.end:
            break
    else:
        return None
    if m.path.endswith(" (deleted)"):
        return None
    if m.perms[3] == "p" and "w" in m.perms and _private_pages_written(m):
        return None
    try:
        st = os.stat(m.path)
    except OSError:
        return None
    return (m, (st.st_dev, st.st_ino)) if st.st_ino == m.inode else None


def _file_of(arr: Any) -> Optional[Tuple[_Mapping, Tuple[int, int]]]:
    """The file mapping an array lies in, if its memory comes from one
    (its ``base`` chain ends in an ``mmap.mmap``) and is the file's."""
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap) and not isinstance(getattr(arr, "_mmap", None), mmap.mmap):
        return None
    return _unchanged_file_mapping(*_span(arr))


def _array_by_reference(arr: Any, packing: "Packing") -> Any:
    np = sys.modules["numpy"]
    if arr.dtype.hasobject or arr.nbytes < BUFFER_BYTES:
        return NotImplemented
    found = _file_of(arr)
    if found is not None:
        m, identity = found
        lo, hi = _span(arr)
        private = m.perms[3] == "p"
        mode = "c" if private and "w" in m.perms else ("r+" if "w" in m.perms else "r")
        first = m.offset + (lo - m.start)
        return _map_array, (m.path, first, hi - lo, arr.ctypes.data - lo, arr.dtype,
                            arr.shape, arr.strides, mode, isinstance(arr, np.memmap),
                            getattr(arr, "offset", first), identity)
    shared = _shared_fd_of(arr)
    if shared is not None:
        fd, base_address = shared
        lo, hi = _span(arr)
        return _view_shared, (_SharedRef(fd), lo - base_address, hi - lo, arr.ctypes.data - lo,
                              arr.dtype, arr.shape, arr.strides)
    if packing.buffers is None:
        return NotImplemented
    lo, hi = _span(arr)
    key = ("array", lo, hi)
    ref = packing.memo.get(key)
    if ref is None:
        ref = packing.memo[key] = packing.buffers.add(_bytes_view(lo, hi - lo, arr))
    return _view_buffer, (ref, arr.ctypes.data - lo, arr.dtype, arr.shape, arr.strides,
                          arr.flags.writeable)


def _map_array(path: str, first: int, nbytes: int, skip: int, dtype: Any, shape: Tuple[int, ...],
               strides: Tuple[int, ...], mode: str, memmap: bool, offset: int,
               identity: Tuple[int, int]) -> Any:
    """A file-mapped array on the receiving side: the same bytes of the
    same file, mapped again (``mode`` as numpy's memmap has it: ``'r+'``
    shared and writable, ``'c'`` private, ``'r'`` read-only). Mapped through
    torch's ``from_file``, which keeps no fd open: a zygote holding it stays
    one that workers may be forked from."""
    import numpy as np
    st = os.stat(path)
    if (st.st_dev, st.st_ino) != identity:
        raise RuntimeError(f"fastload: {path} was replaced since the dataset mapped it; "
                           "the workers cannot map the same file")
    storage = torch.UntypedStorage.from_file(path, mode == "r+", first + nbytes)
    whole = torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()
    arr = np.ndarray(shape, dtype, buffer=whole, offset=first + skip, strides=strides)
    if memmap:
        arr = arr.view(np.memmap)
        arr.filename, arr.offset, arr.mode = os.path.abspath(path), offset, mode
    if mode == "r":
        arr.flags.writeable = False
    return arr


def _view_buffer(view: memoryview, skip: int, dtype: Any, shape: Tuple[int, ...],
                 strides: Tuple[int, ...], writeable: bool) -> Any:
    import numpy as np
    arr = np.ndarray(shape, dtype, buffer=view, offset=skip, strides=strides)
    if not writeable:
        arr.flags.writeable = False
    return arr


# ---- fastload.share -------------------------------------------------------------


# The memfds of the memory fastload.share() made in this process, by the
# mmap its arrays view (an array's ``base`` chain ends there): how a shared
# array is told from any other when it is pickled. An entry, and its fd,
# go with the mmap.
_SHARED_MAPS: "weakref.WeakKeyDictionary[mmap.mmap, int]" = weakref.WeakKeyDictionary()


def _shared_map(size: int) -> Tuple[mmap.mmap, int]:
    """A new shared map of ``size`` bytes backed by a memfd, and the memfd
    (kept open while the map lives, closed with it)."""
    fd = _memfd(_SHARED_NAME, size)
    try:
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    _SHARED_MAPS[mapping] = fd
    weakref.finalize(mapping, os.close, fd)
    return mapping, fd


def _shared_fd_of(arr: Any) -> Optional[Tuple[int, int]]:
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap):
        return None
    fd = _SHARED_MAPS.get(base)
    if fd is None:
        return None
    return fd, _address_of(base)


class _SharedRef:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _map_shared, (_Fd(self.fd),)


def _map_shared(fd: int) -> memoryview:
    """Shared memory on the receiving side, copy-on-write (as a forked
    worker's view of it is)."""
    try:
        return memoryview(mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def _view_shared(view: memoryview, offset: int, nbytes: int, skip: int, dtype: Any,
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
            return _attach_sequence, (_SharedRef(self._fd),)
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
            if not _movable(storage):
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
