"""Worker side of the slot format: a batch written into its slot.

:class:`SlotWriter` writes a batch in the format :mod:`fastload.transport.format`
describes: the default collate stacks tensors straight into the slot
(:meth:`SlotWriter.alloc_tensor`), and pickling the batch describes them where
they lie and copies anything else into the slot's arena, or into an overflow
memfd when the slot is full. Its reading side is :mod:`fastload.transport.reader`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import ExceptionWrapper

from ..common.pickling import dumps_by_value, is_script_name
from . import overflow
from .format import ALIGN, META_NO_TABLES, META_WITH_TABLES, align, extent_bytes, layout

__all__ = ["SlotWriter"]


# A storage this much bigger than what the batch views of it is not copied
# whole: only the viewed bytes are.
_SLACK_BYTES = 4096

# The message torch's own tensor reduction (what DataLoader's workers send
# with) refuses a non-leaf tensor that requires grad with.
_NON_LEAF_MESSAGE = (
    "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
    "since autograd does not support crossing process boundaries.  "
    "If you just want to transfer the data, call detach() on the tensor "
    "before serializing (e.g., putting it on the queue)."
)


# Whether the reader can rebuild a nested tensor as a view of the slot
# (torch._nested_view_from_buffer; not in torch 2.1). Without it a nested
# tensor is pickled by torch's own reduction, as DataLoader's queue sends it.
NESTED_VIEWS = hasattr(torch, "_nested_view_from_buffer")


def _plain_cpu_tensor(obj: Any) -> bool:
    # A nested tensor (layout strided too) has no strides of its own: see
    # SlotWriter._nested_id.
    return (
        type(obj) is torch.Tensor
        and obj.layout == torch.strided
        and obj.device.type == "cpu"
        and not obj.is_quantized
        and not obj.is_nested
    )


class _Arena:
    """Bump allocator over one byte range."""

    __slots__ = ("cap", "off")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.off = 0

    def alloc(self, nbytes: int) -> Optional[int]:
        start = align(self.off)
        if start + nbytes > self.cap:
            return None
        self.off = start + nbytes
        return start


class SlotWriter:
    """Worker side: writes batches into slots of the ring's payload.

    ``payload`` is a writable buffer over all slots (``Ring.payload_region()``);
    slot ``k`` is ``payload[k * slot_bytes:(k + 1) * slot_bytes]``.
    Call :meth:`begin` before the batch is made (the default collate then
    stacks into the slot through :meth:`alloc_tensor`), then :meth:`finish`.
    """

    def __init__(self, payload: Any, slot_bytes: int) -> None:
        self._u8 = torch.frombuffer(payload, dtype=torch.uint8)
        self._mv = memoryview(payload).cast("B")
        self._base_ptr = self._u8.data_ptr()
        self.slot_bytes = slot_bytes
        self._slot_start = 0
        self._arena: Optional[_Arena] = None
        self._overflow: Optional[_Arena] = None
        self._pending: List[Tuple[int, Any]] = []  # (overflow offset, tensor or memoryview)
        self._buffers: List[Tuple[int, int, int]] = []
        self._ids: Dict[int, tuple] = {}
        self._storages: Dict[Tuple[int, int], Tuple[int, int]] = {}
        # Small views of big storages, placed at the end of the batch:
        # (tensor, k, extent) by deferred number, deferred numbers by storage.
        self._deferred: List[Tuple[torch.Tensor, int, int]] = []
        self._views: Dict[Tuple[int, int], List[int]] = {}
        self._keep: List[Any] = []
        self._collating = False

    # -- during the batch --------------------------------------------------
    def begin(self, slot: int) -> None:
        self.abort()
        self._slot_start = slot * self.slot_bytes
        self._arena = _Arena(self.slot_bytes)

    def collating(self, fn: Any) -> Any:
        """Wrap the loader's collate_fn: only while it runs do stacked tensors
        go straight into the slot. A tensor made elsewhere in the worker (say a
        dataset caching ``default_collate`` output) may outlive the batch, so it
        must not live in memory the next batch overwrites; it is copied in at
        serialisation instead."""

        def collate_in_slot(batch: Any) -> Any:
            self._collating = True
            try:
                return fn(batch)
            finally:
                self._collating = False

        return collate_in_slot

    def abort(self) -> None:
        """Drop the batch being written (it failed); the slot is reused as is."""
        self._arena = None
        self._overflow = None
        self._pending = []
        self._buffers = []
        self._ids = {}
        self._storages = {}
        self._deferred = []
        self._views = {}
        self._keep = []

    def alloc_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A contiguous tensor in the current slot, or None when it is full or
        when no batch-level collate is running (see :meth:`collating`)."""
        if self._arena is None or not self._collating:
            return None
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        off = self._arena.alloc(nbytes)
        if off is None:
            return None
        start = self._slot_start + off
        return self._u8[start : start + nbytes].view(dtype).view(tuple(shape))

    def _place(self, nbytes: int) -> Tuple[int, int]:
        """(buffer id, offset) for nbytes: the slot if room is left, else overflow."""
        assert self._arena is not None
        off = self._arena.alloc(nbytes)
        if off is not None:
            return 0, off
        if self._overflow is None:
            self._overflow = _Arena(1 << 62)
        return 1, self._overflow.alloc(nbytes)  # type: ignore[return-value]

    # -- pickling hooks ----------------------------------------------------
    def tensor_id(self, t: torch.Tensor) -> Optional[tuple]:
        """The persistent id of a tensor: the same object always gets the same
        id (pickle consults persistent ids before its memo), and tensors that
        share memory share it in the copy, so aliasing, views and strides
        survive as they do through DataLoader."""
        key = id(t)
        pid = self._ids.get(key)
        if pid is None:
            if not _plain_cpu_tensor(t):
                if not (t.is_nested and t.layout == torch.strided and t.device.type == "cpu"
                        and NESTED_VIEWS):
                    return None
                pid = self._nested_id(t)
            else:
                if t.requires_grad and not t.is_leaf:
                    # torch's reduction refuses it too (DataLoader's worker
                    # then loses the batch): autograd cannot cross processes.
                    raise RuntimeError(_NON_LEAF_MESSAGE)
                pid = self._describe(t, len(self._ids))
            self._ids[key] = pid
        return pid

    def _nested_id(self, t: torch.Tensor) -> tuple:
        """A nested tensor's persistent id: ``(None, values, sizes, strides,
        storage offsets, k)``, the parts torch's own reduction sends. The
        pickler gives the four plain tensors persistent ids of their own, so
        the buffer travels in the arena like any tensor."""
        return (None, t.values(), t._nested_tensor_size(), t._nested_tensor_strides(),
                t._nested_tensor_storage_offsets(), len(self._ids))

    def _describe(self, t: torch.Tensor, k: int) -> tuple:
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        extent = extent_bytes(t)
        if extent == 0:
            return (0, 0) + layout(t) + (0, t.requires_grad, k)
        assert self._arena is not None
        ptr = t.data_ptr() - self._base_ptr - self._slot_start
        if 0 <= ptr and ptr + extent <= self._arena.off:
            # Already in this slot (stacked there by the collate): describe it.
            return (0, ptr) + layout(t) + (extent, t.requires_grad, k)
        storage = t.untyped_storage()
        skey = (storage.data_ptr(), storage.nbytes())
        placed = self._storages.get(skey)
        if placed is None:
            if storage.nbytes() > 2 * extent + _SLACK_BYTES:
                # A small view of a big storage. Copying the storage whole
                # would ship all of a dataset's table with each of its rows;
                # copying just the view would split it from other tensors of
                # the batch that share its memory (the table itself, an
                # overlapping view) and that pickling has not met yet.
                # Decided in _place_deferred, when the batch is known.
                j = len(self._deferred)
                self._deferred.append((t, k, extent))
                self._views.setdefault(skey, []).append(j)
                return (j,)
            # The storage is not much bigger than the view: copy it whole,
            # and other tensors of this batch viewing it share the copy.
            placed = self._storages[skey] = self._copy_bytes(storage, 0, storage.nbytes())
            self._keep.append(storage)  # its address must stay unique while pickling
        buf, off = placed
        return (buf, off + t.storage_offset() * t.element_size()) + layout(t) + (
            extent, t.requires_grad, k)

    def _place_deferred(self) -> List[tuple]:
        """Copy the small views of big storages and describe them.

        Per storage: if the batch also holds the storage whole (or enough of
        it), every view points into that one copy. Else views whose bytes
        overlap are copied together, as one byte range, so that they still
        share memory; a view that overlaps no other is copied alone, compacted.
        """
        deferred = self._deferred
        out: List[tuple] = [()] * len(deferred)
        for skey, js in self._views.items():
            storage_ptr, nbytes = skey
            placed = self._storages.get(skey)
            if placed is None:
                if len(js) == 1:  # the usual case: one row of a table
                    out[js[0]] = self._copy_alone(*deferred[js[0]])
                    continue
                groups: List[Tuple[int, int, List[int]]] = []  # (lo, hi, members)
                for lo, j in sorted((deferred[j][0].data_ptr() - storage_ptr, j) for j in js):
                    hi = lo + deferred[j][2]
                    if groups and lo < groups[-1][1]:
                        g = groups[-1]
                        groups[-1] = (g[0], max(g[1], hi), g[2] + [j])
                    else:
                        groups.append((lo, hi, [j]))
                storage = deferred[js[0]][0].untyped_storage()
                if nbytes <= 2 * sum(hi - lo for lo, hi, _ in groups) + _SLACK_BYTES:
                    placed = self._storages[skey] = self._copy_bytes(storage, 0, nbytes)
                else:
                    for lo, hi, members in groups:
                        if len(members) == 1:
                            out[members[0]] = self._copy_alone(*deferred[members[0]])
                            continue
                        lo -= lo % ALIGN  # keeps each member's alignment in the copy
                        buf, off = self._copy_bytes(storage, lo, hi - lo)
                        for j in members:
                            t, k, extent = deferred[j]
                            out[j] = (buf, off + t.data_ptr() - storage_ptr - lo) + layout(t) + (
                                extent, t.requires_grad, k)
                    continue
            buf, off = placed
            for j in js:
                t, k, extent = deferred[j]
                out[j] = (buf, off + t.storage_offset() * t.element_size()) + layout(t) + (
                    extent, t.requires_grad, k)
        return out

    def _copy_alone(self, t: torch.Tensor, k: int, extent: int) -> tuple:
        """A view that shares memory with nothing else in the batch: copy just
        its elements, compacted (contiguous strides where it was not)."""
        buf, off = self._copy_in(t)
        if t.is_contiguous():
            return (buf, off) + layout(t) + (extent, t.requires_grad, k)
        stride = torch.empty(t.shape, dtype=t.dtype, device="meta").stride()
        return (buf, off) + layout(t)[:2] + (stride, t.numel() * t.element_size(),
                                               t.requires_grad, k)

    def _copy_bytes(self, storage: Any, start: int, nbytes: int) -> Tuple[int, int]:
        """Copy ``nbytes`` of ``storage`` from byte ``start`` into the arena."""
        src = torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,), (1,))
        return self._copy_in(src)

    def _copy_in(self, t: torch.Tensor) -> Tuple[int, int]:
        """Copy ``t``'s elements, contiguously, to the slot or the overflow."""
        nbytes = t.numel() * t.element_size()
        buf, off = self._place(nbytes)
        if buf == 0:
            start = self._slot_start + off
            self._u8[start : start + nbytes].view(t.dtype).view(t.shape).copy_(t)
        else:
            self._pending.append((off, t))
        return buf, off

    def buffer_callback(self, pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()
        except BufferError:
            return True  # not contiguous: pickle it in band
        n = raw.nbytes
        buf, off = self._place(n)
        if buf == 0:
            start = self._slot_start + off
            self._mv[start : start + n] = raw
        else:
            self._pending.append((off, raw))
        self._buffers.append((buf, off, n))
        return False

    # -- end of batch ------------------------------------------------------
    def finish(self, obj: Any, trailer: bytes = b"") -> Tuple[int, int, int, Optional[int], int]:
        """Serialise ``obj``; returns (data_len, meta_offset, meta_len, overflow_fd, overflow_len).

        ``trailer`` is appended to the meta, and counted in meta_len (the
        worker's resume capture, :func:`fastload.transport.format.trailer`). With an
        overflow fd, data_len/meta_* describe the overflow segment for the
        meta (which then lies there) and the slot keeps its part.
        """
        try:
            bio = io.BytesIO()
            p = _BatchPickler(bio, self)
            p.dump(obj)
            body = bio.getbuffer()
            deferred = self._place_deferred() if self._deferred else None
            if self._buffers or deferred:
                meta = META_WITH_TABLES + pickle.dumps((self._buffers, deferred, bytes(body)), protocol=5)
            else:
                meta = META_NO_TABLES + bytes(body)
            if trailer:
                meta += trailer
            assert self._arena is not None
            data_len = self._arena.off
            if self._overflow is None:
                meta_off = self._arena.alloc(len(meta))
                if meta_off is not None:
                    start = self._slot_start + meta_off
                    self._mv[start : start + len(meta)] = meta
                    return data_len, meta_off, len(meta), None, 0
                self._overflow = _Arena(1 << 62)
            meta_off = self._overflow.alloc(len(meta))
            assert meta_off is not None
            total = meta_off + len(meta)
            fd = overflow.write(total, [*self._pending, (meta_off, meta)])
            return data_len, meta_off, len(meta), fd, total
        finally:
            self.abort()


    def write_error(self, slot: int, wrapper: ExceptionWrapper, trailer: bytes) -> int:
        """Write ``wrapper`` (what making a batch raised, with the worker's
        traceback), then ``trailer``, from the start of ``slot``, as a
        ``Kind.ERROR`` result lies (:mod:`fastload.transport.format`);
        returns the length to commit. An exception that cannot be pickled
        travels as a RuntimeError with its message, and one that does not
        fit the slot with the message's first 4096 characters."""
        try:
            meta = dumps_by_value(wrapper, "error")
        except Exception:
            plain = RuntimeError(wrapper.exc_msg)
            meta = pickle.dumps(ExceptionWrapper((RuntimeError, plain, None), wrapper.where))
        if len(meta) + len(trailer) > self.slot_bytes:
            short = RuntimeError(wrapper.exc_msg[:4096])
            meta = pickle.dumps(ExceptionWrapper((RuntimeError, short, None), wrapper.where))
        meta += trailer
        start = slot * self.slot_bytes
        self._mv[start : start + len(meta)] = meta
        return len(meta)


class _BatchPickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, writer: SlotWriter) -> None:
        super().__init__(f, protocol=5, buffer_callback=writer.buffer_callback)
        self._writer = writer

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if type(obj) is torch.Tensor:
            return self._writer.tensor_id(obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        # A class of the training script or notebook (``__main__``, or
        # ``__mp_main__`` in a spawn-started training process: a namedtuple, a
        # dataclass, an enum) reached this worker by value: plain pickle
        # cannot name it here. Sent back by value with cloudpickle, it is
        # rebuilt as the main process's own class: cloudpickle tags a class
        # it sends by value and, receiving the tag where the class came
        # from, returns the original (``type(batch) is Pair`` holds).
        if isinstance(obj, type) and is_script_name(obj.__module__):
            return _main_class_reduce(obj)
        return NotImplemented


_MAIN_CLASSES: Dict[type, bytes] = {}  # a worker's __main__ classes, pickled once each


def _main_class_reduce(cls: type) -> Tuple[Any, Tuple[bytes]]:
    data = _MAIN_CLASSES.get(cls)
    if data is None:
        import cloudpickle

        data = _MAIN_CLASSES[cls] = cloudpickle.dumps(cls, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads, (data,)
