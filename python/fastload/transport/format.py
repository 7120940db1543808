"""The slot format: how a committed result lies in its slot (or an overflow segment).

What a slot holds depends on the result's kind (:class:`fastload.common.protocol.Kind`:
the worker's answer to a task, part of the protocol, which the ledger and
the iterator act on without reading the slot):

* ``Kind.DATA``, a batch::

      slot:     [arena: tensor data and out-of-band buffers, each 64-byte aligned][meta][trailer]
      overflow: [arena: what did not fit the slot][meta][trailer]   (FLAG_OVERFLOW set)

  The committed lengths say where: ``data_len`` is the slot's arena,
  ``meta_off``/``meta_len`` place the meta and trailer together, in the
  slot, or in the overflow segment when ``FLAG_OVERFLOW`` is set (whose fd
  reaches the main process on the worker's channel,
  :mod:`fastload.transport.overflow`).
* ``Kind.ERROR``: from the slot's start, ``meta_len`` bytes: a pickled
  ``ExceptionWrapper`` (what ``dataset[i]`` raised), then the trailer.
* ``Kind.EXHAUSTED``, and a session task's answer: nothing.

``meta`` is a pickle (protocol 5) of the batch in which every CPU tensor is
replaced by a *persistent id* — ``(buffer, offset, dtype, shape, stride,
extent, requires_grad, k)``, dtype as a small int where it can be, k the
tensor's number in the batch — naming bytes in the arena, and every
out-of-band pickle buffer (numpy arrays and the like) is listed as
``(buffer, offset, length)``. A tensor whose place is only known once the
whole batch has been seen (a small view of a big storage, see
:meth:`fastload.transport.writer.SlotWriter._describe`) has the persistent
id ``(j,)``, ``j`` indexing a table of such descriptions sent with the meta.
The meta's first byte says which: :data:`META_NO_TABLES` (the batch's pickle
follows) or :data:`META_WITH_TABLES` (a pickle of the buffer list, the
table and the batch's pickle follows). A nested tensor has ``(None, values,
sizes, strides, offsets, k)``, its four parts being plain tensors with
persistent ids of their own. ``buffer`` 0 is the slot, 1 the overflow
segment. Tensors that the default collate stacked straight into the slot
are described where they already lie: no copy. Anything else is copied once
into the arena. Tensors that share memory in the worker share it in the
main process (DataLoader's workers move whole storages to shared memory, so
its batches keep all aliasing).

The *trailer* is the worker's resume capture after the batch (or the
error): a pickle, then its length as 4 bytes (:func:`trailer`); the main
process cuts it off the meta (:func:`split_trailer`) and keeps it
(NOTE [ Resume ] in :mod:`fastload.resume.book`).

The main process rebuilds the batch with tensors and arrays that *view* the
slot: :func:`fastload.transport.reader.read_batch` takes the byte buffers
and never copies them.

This module holds the format and what both sides must agree on (alignment,
the meta's leading tag, dtype codes, how a tensor's layout is written, the
trailer). Which process calls what: :class:`fastload.transport.writer.SlotWriter`
lives in workers; its reading side, :func:`fastload.transport.reader.read_batch`
and :class:`fastload.transport.reader.SlotReader`, in the main process.
Neither knows about the ring's states: ``worker/loop.py`` and the ledger do.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Dict, Tuple

import torch

__all__ = ["ALIGN", "META_NO_TABLES", "META_WITH_TABLES", "DTYPES", "align", "extent_bytes",
           "layout", "trailer", "split_trailer"]

ALIGN = 64

META_NO_TABLES = b"\x00"  # meta is the batch's pickle alone
META_WITH_TABLES = b"\x01"  # meta pickles (buffers, deferred tensor descriptions, batch pickle)
# Tensor dtypes travel as their index in this tuple (a pickled torch.dtype is
# a global that the pickler checks and the unpickler looks up, on every
# batch); a dtype not listed travels as itself. Workers and the main process
# import the same torch, so both build the same tuple.
_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2",
)
DTYPES: Tuple[torch.dtype, ...] = tuple(
    getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype))
_DTYPE_CODE: Dict[torch.dtype, int] = {d: i for i, d in enumerate(DTYPES)}


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element."""
    if t.numel() == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def layout(t: torch.Tensor) -> Tuple[Any, Tuple[int, ...], Tuple[int, ...]]:
    """(dtype or its code, shape, stride): how a persistent id describes a tensor."""
    return (_DTYPE_CODE.get(t.dtype, t.dtype), tuple(t.shape), t.stride())


_TRAILER_LEN = struct.Struct("<I")


def trailer(capture: tuple) -> bytes:
    """``capture`` as it follows a result's meta in its slot: a pickle and its length."""
    data = pickle.dumps(capture, protocol=pickle.HIGHEST_PROTOCOL)
    return data + _TRAILER_LEN.pack(len(data))


def split_trailer(meta: Any) -> Tuple[Any, bytes]:
    """(the meta without its trailer, the trailer's pickle), from a memoryview or bytes."""
    mv = memoryview(meta)
    n = _TRAILER_LEN.unpack(mv[len(mv) - _TRAILER_LEN.size:])[0]
    end = len(mv) - _TRAILER_LEN.size
    return mv[: end - n], bytes(mv[end - n : end])
