"""A batch's way from worker to tensor, with no process: ``SlotWriter``
writes it into a slot (and an overflow segment when it does not fit),
``read_batch`` rebuilds it from the bytes, views or copies."""

from __future__ import annotations

import collections
import gc
import mmap
import os
import pickle
from typing import Any, List, Optional, Tuple

import pytest
import torch

from fastload.transport.format import split_trailer, trailer
from fastload.transport.reader import read_batch
from fastload.transport.writer import SlotWriter

SLOT = 1 << 16
Pair = collections.namedtuple("Pair", "x y")


def _round_trip(obj: Any, copy: bool = False, extra: bytes = b"") -> Tuple[Any, Optional[int], bytes]:
    """``obj`` written into slot 1 of a 3-slot payload and read back:
    (the batch, the overflow segment's length or None, the trailer read)."""
    payload = mmap.mmap(-1, 3 * SLOT)
    writer = SlotWriter(payload, SLOT)
    writer.begin(1)
    data_len, meta_off, meta_len, fd, total = writer.finish(obj, extra)
    slot = torch.frombuffer(payload, dtype=torch.uint8)[SLOT : 2 * SLOT]
    overflow: Optional[mmap.mmap] = None
    if fd is None:
        meta = bytes(payload[SLOT + meta_off : SLOT + meta_off + meta_len])
    else:
        try:
            overflow = mmap.mmap(fd, os.fstat(fd).st_size)  # as the reader maps it
        finally:
            os.close(fd)
        meta = bytes(overflow[meta_off : meta_off + meta_len])
    meta, got_trailer = split_trailer(meta) if extra else (meta, b"")
    return read_batch(meta, [slot, overflow], copy=copy), (total if fd is not None else None), \
        got_trailer or b""


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b) if a.dtype != torch.bool else bool((a == b).all())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def _shapes() -> List[Tuple[str, Any]]:
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    return [
        ("tensor", t),
        ("scalar tensor", torch.tensor(7)),
        ("empty tensor", torch.empty(0, 3)),
        ("transposed view", t.transpose(0, 2)),
        ("strided slice", t[:, ::2, 1:]),
        ("expanded", torch.tensor([1.0, 2.0]).expand(3, 2)),
        *[(f"dtype {d}", (torch.arange(6) % 2).to(d)) for d in DTYPES],
        ("dict of tensors", {"image": t, "label": torch.tensor([1, 2])}),
        ("tuple and list", (t, [torch.tensor(1), torch.tensor(2)])),
        ("namedtuple", Pair(t, torch.tensor(3))),
        ("plain values", {"path": "a/b.jpg", "n": 3, "f": 0.5, "none": None, "b": b"\x00\x01"}),
        ("nested", {"a": [{"b": (t, "s")}]}),
    ]


def test_every_batch_shape_comes_back_as_it_went() -> None:
    for name, obj in _shapes():
        for copy in (False, True):  # views of the slot, or copies (held_batches)
            out, overflow, _ = _round_trip(obj, copy=copy)
            assert overflow is None, name
            _same(out, obj)


def test_views_share_what_shared_and_copies_do_not() -> None:
    base = torch.arange(32, dtype=torch.int32)
    out, _, _ = _round_trip((base[:8], base[4:12]))
    assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr()
    assert out[1].data_ptr() - out[0].data_ptr() == 4 * 4
    copied, _, _ = _round_trip((base[:8], base[20:24]), copy=True)
    assert copied[0].untyped_storage().data_ptr() != copied[1].untyped_storage().data_ptr()


def test_a_batch_bigger_than_its_slot_arrives_whole_through_an_overflow_segment() -> None:
    big = torch.arange(3 * SLOT // 8, dtype=torch.int64)  # 3 slots' worth
    out, overflow, _ = _round_trip({"big": big, "small": torch.tensor([1, 2, 3])})
    assert overflow is not None and overflow >= big.numel() * 8
    _same(out, {"big": big, "small": torch.tensor([1, 2, 3])})
    del out
    gc.collect()  # the segment goes with the last tensor viewing it


def test_the_worker_s_trailer_rides_after_the_meta() -> None:
    extra = trailer(("capture", 3))
    out, _, got = _round_trip(torch.tensor([1, 2]), extra=extra)
    _same(out, torch.tensor([1, 2]))
    assert pickle.loads(got) == ("capture", 3)


def test_out_of_band_buffers_of_numpy_arrays() -> None:
    np = pytest.importorskip("numpy")
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out, _, _ = _round_trip({"a": arr, "t": torch.tensor(1)})
    assert isinstance(out["a"], np.ndarray) and (out["a"] == arr).all()
    assert out["a"].dtype == arr.dtype and out["a"].shape == arr.shape
