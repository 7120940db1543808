"""Main side of the slot format: a done slot back into a batch.

:class:`SlotReader` is the reading half of :class:`fastload.transport.writer.SlotWriter`
(the layout is :mod:`fastload.transport.format`): it turns a slot a worker committed into the
batch, or raises the error the worker sent. Its rule for memory is the point
of fastload: the batch's tensors *view* the slot (a lease; the slot goes back
to the workers when the last view dies), unless the training loop already
holds ``held_batches`` batches, in which case the batch is copied out and
the slot freed at once, so the workers never run out of slots to fill.
"""

from __future__ import annotations

import bisect
import ctypes
import io
import mmap
import pickle
from typing import Any, Dict, List, Optional, Protocol

import torch

from .. import _core
from ..common.errors import add_note, as_list, short_list
from ..device.pinning import PinnedRing
from ..common.protocol import FLAG_OVERFLOW, Kind
from .format import DTYPES, META_WITH_TABLES, split_trailer
from .overflow import OverflowSegments


class DoneBatch(Protocol):
    """A batch's record as the reader reads it (a :class:`fastload.pool.ledger.Record`:
    the ledger imports this package, so the reader names what it reads)."""

    slot: int
    seq: int
    worker: int
    idx: int  # its number in the epoch, and ``index`` the sampler's output: for errors
    index: Any
    result: Optional[tuple]  # the ring's result, read by the ledger once the slot was READY


class SlotReader:
    """Reads done batch slots of one ring for one iterator.

    ``overflow`` holds the overflow segments of the ring's workers;
    ``pinner``, when the ring is pinned, hands out leases registered with
    the device runtime.
    """

    def __init__(self, ring: _core.Ring, overflow: OverflowSegments,
                 held_batches: int, pinner: Optional[PinnedRing] = None) -> None:
        self._ring = ring
        self._overflow = overflow
        self._held_batches = held_batches
        self._pinner = pinner
        self.batch_bytes = 0  # bytes of the batch last read, to size slots
        self.copied = False  # the batch last read was copied out of its slot (held_batches)
        # The resume capture that came with the batch last taken (pickled; see
        # fastload.resume.book): the worker's state when it had made that batch.
        self.capture: Optional[bytes] = None

    def take(self, rec: DoneBatch, leases: int) -> Any:
        """The batch in done record ``rec``'s slot (or its error, raised),
        handed over by the ledger (``SlotLedger.take``); the slot is leased
        to the batch's tensors or freed. ``leases``: how many slots the loop
        already holds (``SlotLedger.live_leases``): past ``held_batches``,
        the batch is copied out of its slot."""
        ring = self._ring
        kind, data_len, meta_off, meta_len, _make_ns = rec.result  # type: ignore[misc]
        self.capture = None
        self.copied = False
        if kind == Kind.ERROR:
            try:
                error, self.capture = split_trailer(self._bytes(rec.slot, meta_len))
                wrapper = pickle.loads(error)
            finally:
                ring.release(rec.slot)
            wrapper.reraise()
        overflow: Optional[mmap.mmap] = None
        meta: Any = None
        lease_len = meta_off + meta_len  # the slot holds data then meta
        if kind & FLAG_OVERFLOW:
            overflow = self._overflow.open(rec.worker, rec.seq)
            meta = memoryview(overflow)[meta_off : meta_off + meta_len]
            lease_len = data_len  # the meta lies in the overflow segment
        self.batch_bytes = lease_len + (len(overflow) if overflow is not None else 0)
        if lease_len == 0:
            ring.release(rec.slot)
            return _read(rec, meta, [None, overflow])
        lease = (self._pinner.lease(rec.slot, lease_len) if self._pinner is not None
                 else ring.lease(rec.slot, lease_len))
        if meta is None:
            meta = memoryview(lease)[meta_off : meta_off + meta_len]
        meta, self.capture = split_trailer(meta)
        if leases <= self._held_batches:
            return _read(rec, meta, [lease, overflow])
        # The loop keeps batches alive: copy this one out so workers keep
        # enough slots to fill (never a deadlock, never an overwrite). Each
        # tensor (each group of overlapping ones) and each buffer gets
        # memory of its own, as with DataLoader: code that keeps a batch's
        # labels and drops its images keeps the labels' bytes alone.
        self.copied = True
        try:
            return _read(rec, bytes(meta), [lease, overflow], copy=True)
        finally:
            del lease  # frees the slot now: nothing read refers to it

    def peek_capture(self, rec: DoneBatch) -> Optional[bytes]:
        """The resume capture of a batch still in its slot, left there (None
        if its meta lies in an overflow segment). The slot is READY; the
        ledger may not have seen it yet."""
        result = rec.result if rec.result is not None else self._ring.result(rec.slot)
        kind, _data_len, meta_off, meta_len, _make_ns = result
        if kind & FLAG_OVERFLOW:
            return None
        return split_trailer(self._bytes(rec.slot, meta_off + meta_len)[meta_off:])[1]

    def _bytes(self, slot: int, n: int) -> bytes:
        region = self._ring.payload_region()
        start = slot * self._ring.slot_bytes
        return bytes(memoryview(region)[start : start + n])


def _read(rec: DoneBatch, meta: Any, buffers: List[Any], copy: bool = False) -> Any:
    """read_batch; an error (e.g. an object that cannot be unpickled here)
    keeps its type and message and gets a note naming the batch."""
    try:
        return read_batch(meta, buffers, copy)
    except Exception as e:
        add_note(e, f"fastload: raised while rebuilding batch {rec.idx} (sample indices "
                   f"{short_list(as_list(rec.index))}) in the main process")
        raise


def _nested_from_buffer(values: torch.Tensor, sizes: torch.Tensor, strides: torch.Tensor,
                        offsets: torch.Tensor) -> torch.Tensor:
    """A nested tensor over ``values`` (1-D, contiguous), no copy.

    torch's nested view reads its buffer from the start of the buffer's
    storage, and values whose storage they share with other tensors of the
    batch start inside it: they get a storage of their own over the same
    bytes (which keeps the shared one alive, see :func:`_tensor_bytes`).
    """
    if values.storage_offset() or values.untyped_storage().nbytes() != values.nbytes:
        values = torch.frombuffer(_tensor_bytes(values.view(torch.uint8)),
                                  dtype=torch.uint8).view(values.dtype)
    return torch._nested_view_from_buffer(values, sizes, strides, offsets)



class _Rebuild:
    """Rebuilds a batch's tensors as views of the slot (or overflow) bytes:
    the ``persistent_load`` of the batch's unpickler (:func:`read_batch`).

    Each tensor gets a storage of its own over just its bytes, as it would
    through DataLoader, where every tensor arrives in a shared-memory block
    of its own: ``torch.save``, ``pickle`` and ``copy.deepcopy`` of one
    tensor then see that tensor's bytes, not the whole batch's (and a batch
    whose tensors have different dtypes can be saved at all). Tensors whose
    bytes overlap (a row and its table, overlapping views) share one
    storage over the union, so aliasing survives the trip. See
    :class:`_Storages`.

    A plain object whose method is set on a C ``pickle.Unpickler``, not a
    subclass of it: this runs for every batch, and a Python subclass costs
    more to make and to call back.
    """

    __slots__ = ("_bases", "_copy", "_deferred", "_storages", "_memo", "_grad")

    def __init__(self, bases: List[Any], deferred: Optional[List[tuple]],
                 copy: bool = False) -> None:
        self._bases = bases
        self._copy = copy
        self._deferred = deferred
        self._storages: List[Optional[_Storages]] = [None] * len(bases)
        self._memo: Dict[int, torch.Tensor] = {}
        self._grad: List[torch.Tensor] = []  # requires_grad set once storages are final

    def load(self, body: Any, buffers: Optional[list]) -> Any:
        """The batch pickled in ``body`` (out-of-band ``buffers``)."""
        unpickler = pickle.Unpickler(io.BytesIO(body), buffers=buffers)
        unpickler.persistent_load = self.persistent_load
        out = unpickler.load()
        for t in self._grad:
            t.requires_grad_(True)
        return out

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        # Runs once per tensor of every batch: _build is inlined here.
        if len(pid) == 1:
            pid = self._deferred[pid[0]]  # type: ignore[index]
        t = self._memo.get(pid[-1])
        if t is not None:
            return t
        buf = pid[0]
        if buf is None:
            t = _nested_from_buffer(*pid[1:-1])
        else:
            _buf, off, dtype, shape, stride, extent, requires_grad, k = pid
            if type(dtype) is int:
                dtype = DTYPES[dtype]
            if extent == 0:
                t = torch.empty(shape, dtype=dtype)
            else:
                storages = self._storages[buf]
                if storages is None:
                    storages = self._storages[buf] = _Storages(self._bases[buf], self._copy)
                t = storages.view(off, extent, dtype, shape, stride)
            if requires_grad:
                self._grad.append(t)
        self._memo[pid[-1]] = t
        return t


_MAX_ITEMSIZE = 16  # complex128


class _Storages:
    """The storages of one buffer's tensors: one per group of overlapping
    byte ranges, each over just that group's bytes (``torch.frombuffer``
    with an offset and a count: no copy), or, for a batch copied out of its
    slot, each a copy of just that group's bytes.

    Groups are kept sorted by start. A tensor whose bytes overlap no group
    gets a storage of its own; one that overlaps groups merges them into a
    storage over the union, and their tensors are moved onto it
    (``Tensor.set_``, same bytes, same strides), so that the order in which
    pickling meets a row and its table does not matter.
    """

    def __init__(self, base: Any, copy: bool = False) -> None:
        # The storages keep the base alive, or with ``copy`` hold copies of
        # its bytes (one per group) and let it go.
        self._base = _bytes_view(base)
        self._copy = copy
        self._groups: List[list] = []  # [start, end, u8 tensor, [(tensor, offset)]]

    def view(self, off: int, extent: int, dtype: Any, shape: tuple, stride: tuple) -> torch.Tensor:
        lo, hi = off, off + extent
        groups = self._groups
        i = bisect.bisect_right(groups, lo, key=_group_start) if groups else 0
        if (not i or groups[i - 1][1] <= lo) and (i == len(groups) or groups[i][0] >= hi):
            # Overlaps no group (the usual case: a batch's tensors lie apart):
            # a storage over just its bytes, made with its dtype, in one step.
            if self._copy:
                t = torch.frombuffer(bytearray(self._base[lo:hi]), dtype=dtype)
            else:
                t = torch.frombuffer(self._base, dtype=dtype, count=extent // dtype.itemsize,
                                     offset=lo)
            if len(shape) != 1 or stride[0] != 1 or shape[0] != t.shape[0]:
                t = t.as_strided(shape, stride)
            groups.insert(i, [lo, hi, None, [(t, off)]])
            return t
        j = i - 1 if i and groups[i - 1][1] > lo else i  # first group overlapping
        k = i
        while k < len(groups) and groups[k][0] < hi:
            k += 1  # groups j..k-1 overlap [lo, hi)
        size = dtype.itemsize
        if (j == k - 1 and groups[j][0] <= lo and hi <= groups[j][1]
                and (off - groups[j][0]) % size == 0):
            group = groups[j]  # inside one group: view its storage
        else:
            # Members may differ in dtype: a start aligned for the largest
            # element keeps every member's offset a whole number of its
            # elements (the writer aligns each tensor to its own). Groups the
            # aligned start reaches join too, so that groups stay disjoint
            # and sorted.
            lo, hi = min(lo, groups[j][0]), max(hi, groups[k - 1][1])
            lo -= lo % _MAX_ITEMSIZE
            while j and groups[j - 1][1] > lo:
                j -= 1
                lo = min(lo, groups[j][0])
                lo -= lo % _MAX_ITEMSIZE
            merged = groups[j:k]
            if self._copy:  # over a bytearray: not resizable, as DataLoader's shared storages
                u8 = torch.frombuffer(bytearray(self._base[lo:hi]), dtype=torch.uint8)
            else:
                u8 = torch.frombuffer(self._base, dtype=torch.uint8, count=hi - lo, offset=lo)
            members = [m for g in merged for m in g[3]]
            for m, m_off in members:
                m.set_(u8.untyped_storage(), (m_off - lo) // m.element_size(), m.shape, m.stride())
            group = [lo, hi, u8, members]
            groups[j:k] = [group]
        start = group[0]
        u8 = group[2]
        if u8 is None:  # made by the fast path above: a uint8 tensor over the same storage
            u8 = group[2] = torch.empty(0, dtype=torch.uint8).set_(group[3][0][0].untyped_storage())
        t = u8[off - start : off - start + extent].view(dtype).as_strided(shape, stride)
        group[3].append((t, off))
        return t


def _group_start(group: list) -> int:
    return group[0]


def read_batch(meta: Any, bases: List[Any], copy: bool = False) -> Any:
    """Main side: rebuild a batch from ``meta`` whose tensors view ``bases``.

    ``bases[0]`` is the slot's data (a leased Region), ``bases[1]`` the
    overflow mapping if any. The result keeps the bases alive for as long as
    any of its tensors or arrays is; with ``copy``, its tensors and buffers
    are copies, each in memory of its own, and it refers to no base.
    """
    mv = memoryview(meta)
    head, body = bytes(mv[:1]), mv[1:]
    buffers = None
    deferred = None
    if head == META_WITH_TABLES:
        descs, deferred, body = pickle.loads(body)
        if descs:
            views = [_bytes_view(b) for b in bases]
            buffers = [(bytearray(views[b][off : off + n]) if copy else views[b][off : off + n])
                       if n else memoryview(bytearray()) for b, off, n in descs]
    return _Rebuild(bases, deferred, copy).load(body, buffers)


def _bytes_view(base: Any) -> Optional[memoryview]:
    if base is None:
        return None
    if isinstance(base, torch.Tensor):
        return _tensor_bytes(base)
    return memoryview(base).cast("B")


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` as a writable buffer that
    keeps ``t`` alive. ``Tensor.numpy()`` would do, but torch does not
    depend on numpy and neither may fastload: a ctypes array over the same
    address is the standard library's way."""
    if not t.is_contiguous():
        raise ValueError("fastload: a batch base must be a contiguous tensor")
    arr = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    arr._owner = t  # type: ignore[attr-defined]  # the tensor lives as long as the buffer
    return memoryview(arr).cast("B")
