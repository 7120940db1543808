"""What fork would share, sent by reference: tensors, arrays, mapped files.

Under ``fork``, a worker sees the training process's memory as it is: a
dataset holding a 2 GiB tensor, a numpy array or a memory-mapped token file
costs nothing more per worker, and nothing per epoch. Pickled by value, the
same dataset would be copied into every epoch's session and unpickled there.
While :func:`fastload.launching.parcels.pack` pickles a session, this
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
  copied into a memfd kept by the loader
  (:class:`~fastload.launching.buffer_copies.SharedBuffers`), which
  reuses the copy at later epochs while the bytes are unchanged and makes a
  new one when they changed (what the next epoch's workers see is what the
  dataset holds at that ``iter()``, as under fork), mapped copy-on-write on
  the other side, not unpickled.
* What :func:`fastload.share` made (:mod:`.share`) is sent as its memfd.

Small objects (under :data:`BUFFER_BYTES`) travel as bytes: a reference
costs more than it saves there.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from .buffer_copies import BufferRef, SharedBuffers
from .memfds import KeptFd, address_of, bytes_view, move_to_shared, movable, resizable, storage_fd
from .share import SharedRef, shared_fd_of, view_shared

log = logging.getLogger("fastload")

__all__ = ["BUFFER_BYTES", "MOVE_BYTES", "Packing", "reduce_by_reference"]

BUFFER_BYTES = 64 << 10  # a buffer this big or bigger crosses out of band
MOVE_BYTES = 4 << 20  # a tensor storage this big or bigger is moved into a memfd of its own
# At most this many storages of one session go as memfds of their own (each
# an fd passed, and one kept per moved tensor): the rest go through
# SharedBuffers, whose copies share one memfd (a message passes 250 fds).
_FDS_PER_PACK = 64


# ---- tensors ------------------------------------------------------------------


class _StorageRef:
    """A moved storage inside one session: pickled once (pickle's memo
    keeps one per storage), mapped copy-on-write on the other side."""

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _map_storage, (KeptFd(self.fd), self.nbytes)


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
    fd = storage_fd(storage)
    if fd is None:
        if storage.is_shared() or nbytes < BUFFER_BYTES:
            return NotImplemented  # torch's sharing (parcels), or small: bytes
        if t.is_pinned():
            return NotImplemented  # page-locked memory stays where it is
        if nbytes >= MOVE_BYTES and len(packing.storages) < _FDS_PER_PACK and movable(storage):
            fd = move_to_shared(storage)
            log.debug("fastload: moved a %d-byte tensor storage into shared memory", nbytes)
    if fd is not None and fd not in packing.storages and len(packing.storages) >= _FDS_PER_PACK:
        fd = None  # past the session's fd budget: this one goes as a buffer copy
    if fd is None and not storage.is_shared() and not resizable(storage):
        mapped = _mapped_storage(storage, t.element_size(), packing)
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
            view = bytes_view(storage.data_ptr(), nbytes, storage)
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


def _mapped_storage(storage: torch.UntypedStorage, itemsize: int,
                    packing: "Packing") -> Optional[_FileStorage]:
    """The file a storage's memory maps, unchanged by this process, or None."""
    lo, nbytes = storage.data_ptr(), storage.nbytes()
    found = _unchanged_file_mapping(lo, lo + nbytes, packing.mappings())
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

    def __init__(self, buf: "BufferRef") -> None:
        self.buf = buf

    def __reduce__(self) -> Tuple[Any, Tuple[Any]]:
        return _buffer_storage, (self.buf,)


def _buffer_storage(view: memoryview) -> torch.UntypedStorage:
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


# ---- one packing ------------------------------------------------------------------


class Packing:
    """What one :func:`fastload.launching.parcels.pack` sends by reference
    (main process): the storages and buffers met so far, so that each is
    sent once however many objects view it, and the pickle-5 buffers sent
    out of band. ``buffers``: the loader's copies (None: big arrays and
    buffers travel as bytes; moved tensors and mapped files still go by
    reference)."""

    def __init__(self, buffers: Optional[SharedBuffers]) -> None:
        self.buffers = buffers
        self.storages: Dict[int, _StorageRef] = {}
        self.memo: Dict[Tuple[Any, ...], Any] = {}
        self.out_of_band: List["BufferRef"] = []
        self._maps: Optional[List["_Mapping"]] = None

    def mappings(self) -> List["_Mapping"]:
        """This process's file mappings (``/proc/self/maps``), read once per
        packing: those of a dataset's files do not change while it is
        pickled."""
        if self._maps is None:
            self._maps = _mappings()
        return self._maps

    def buffer_callback(self, buf: "pickle.PickleBuffer") -> bool:
        """pickle's ``buffer_callback``: a big buffer goes to the loader's
        copies and is sent out of band (False); a small one in band."""
        if self.buffers is None:
            return True
        with buf.raw() as raw:
            if raw.nbytes < BUFFER_BYTES:
                return True
            view = bytes_view(address_of(raw), raw.nbytes, buf)
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


def _unchanged_file_mapping(lo: int, hi: int,
                            maps: List["_Mapping"]) -> Optional[Tuple["_Mapping", Tuple[int, int]]]:
    """The mapping of a file that holds [lo, hi) of this process's memory,
    and the file's identity, if its path still names that file and this
    process has not written to a private mapping of it (its bytes would no
    longer be the file's); else None."""
    for m in maps:
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


def _file_of(arr: Any, packing: "Packing") -> Optional[Tuple[_Mapping, Tuple[int, int]]]:
    """The file mapping an array lies in, if its memory comes from one
    (its ``base`` chain ends in an ``mmap.mmap``) and is the file's."""
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap) and not isinstance(getattr(arr, "_mmap", None), mmap.mmap):
        return None
    return _unchanged_file_mapping(*_span(arr), packing.mappings())


def _array_by_reference(arr: Any, packing: "Packing") -> Any:
    np = sys.modules["numpy"]
    if arr.dtype.hasobject or arr.nbytes < BUFFER_BYTES:
        return NotImplemented
    found = _file_of(arr, packing)
    if found is not None:
        m, identity = found
        lo, hi = _span(arr)
        private = m.perms[3] == "p"
        mode = "c" if private and "w" in m.perms else ("r+" if "w" in m.perms else "r")
        first = m.offset + (lo - m.start)
        return _map_array, (m.path, first, hi - lo, arr.ctypes.data - lo, arr.dtype,
                            arr.shape, arr.strides, mode, isinstance(arr, np.memmap),
                            getattr(arr, "offset", first), identity)
    shared = shared_fd_of(arr)
    if shared is not None:
        fd, base_address = shared
        lo, hi = _span(arr)
        return view_shared, (SharedRef(fd), lo - base_address, hi - lo, arr.ctypes.data - lo,
                              arr.dtype, arr.shape, arr.strides)
    if packing.buffers is None:
        return NotImplemented
    lo, hi = _span(arr)
    key = ("array", lo, hi)
    ref = packing.memo.get(key)
    if ref is None:
        ref = packing.memo[key] = packing.buffers.add(bytes_view(lo, hi - lo, arr))
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
