"""A batch's way from worker to tensor, with no process: ``SlotWriter``
writes it into a slot (and an overflow segment when it does not fit),
``read_batch`` rebuilds it from the bytes, views or copies; and the whole
way through a ring in this process, its worker played by the test:
written, committed, seen by the ledger, taken by ``SlotReader``."""

from __future__ import annotations

import collections
import gc
import mmap
import os
import pickle
import threading
from typing import Any, Iterator, List, Optional, Tuple

import pytest
import torch
from torch._utils import ExceptionWrapper

from fastload import _core
from fastload.pool.ledger import Role, SlotLedger
from fastload.transport.overflow import send as send_segment
from fastload.transport.format import split_trailer, trailer
from fastload.transport.reader import SlotReader, read_batch
from fastload.transport.writer import SlotWriter
from fastload.common.protocol import FLAG_OVERFLOW, Kind
from support.processes import open_fds
from support.ring_driver import Channels, FakeWorker, new_ring

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


class RingWay:
    """A ring of 4 slots and one worker, played by the test with a
    :class:`SlotWriter` over its side of the payload, as ``worker/loop.py`` does."""

    def __init__(self, held_batches: int = 4) -> None:
        self.ring = new_ring(4, 1)
        self.channels = Channels(1)
        self.overflow = self.channels.segments
        self.ledger = SlotLedger(self.ring, self.overflow)
        self.reader = SlotReader(self.ring, self.overflow, held_batches)
        self.worker = FakeWorker(self.ring, 0, self.channels.theirs[0])
        self.writer = SlotWriter(self.worker.ring.payload_region(), self.ring.slot_bytes)

    def send(self, obj: Any, capture: tuple = ("capture",)) -> Any:
        """``obj`` made by the worker as a batch and taken by the reader."""
        rec = self.ledger.assign(Role.BATCH, 0, b"task", idx=0, index=[0])
        slot, seq = self.worker.take()  # type: ignore[misc]
        self.writer.begin(slot)
        data_len, meta_off, meta_len, fd, _total = self.writer.finish(obj, trailer(capture))
        kind = Kind.DATA
        if fd is not None:
            try:
                send_segment(self.channels.theirs[0], seq, fd)
            finally:
                os.close(fd)
            kind |= FLAG_OVERFLOW
        self.worker.commit(slot, kind, data_len, meta_off=meta_off, meta_len=meta_len)
        assert self.ledger.wait(1.0) is rec
        return self.reader.take(self.ledger.take(rec), self.ledger.live_leases())

    def fail(self, error: BaseException) -> None:
        """The worker's batch raised ``error``: the reader raises it."""
        rec = self.ledger.assign(Role.BATCH, 0, b"task", idx=0, index=[0])
        slot, _seq = self.worker.take()  # type: ignore[misc]
        try:
            raise error
        except BaseException:
            wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
        meta_len = self.writer.write_error(slot, wrapper, trailer(("capture",)))
        self.worker.commit(slot, Kind.ERROR, meta_len=meta_len)
        assert self.ledger.wait(1.0) is rec
        self.reader.take(self.ledger.take(rec), self.ledger.live_leases())

    def close(self) -> None:
        self.channels.close()
        # pytest keeps the fixture's value past the leak check: let go of
        # both sides' fds of the ring now.
        self.ring.close_fd()
        del self.writer, self.worker


@pytest.fixture
def way() -> Iterator[RingWay]:
    w = RingWay()
    yield w
    w.close()


def test_through_a_ring_the_batch_views_its_slot_until_its_last_tensor_dies(way: RingWay) -> None:
    batch = way.send({"x": torch.arange(10), "name": "a"})
    _same(batch, {"x": torch.arange(10), "name": "a"})
    assert not way.reader.copied and pickle.loads(way.reader.capture) == ("capture",)
    assert way.ring.state(0) == _core.SlotState.LEASED
    del batch
    gc.collect()
    assert way.ring.free_slot_count() == way.ring.num_slots


def test_through_a_ring_a_batch_bigger_than_its_slot_comes_with_its_segment(way: RingWay) -> None:
    big = torch.arange(3 * way.ring.slot_bytes // 8, dtype=torch.int64)
    before = open_fds()
    batch = way.send((big, torch.tensor([1, 2])))
    _same(batch, (big, torch.tensor([1, 2])))
    assert pickle.loads(way.reader.capture) == ("capture",)
    assert way.reader.batch_bytes >= big.numel() * 8 and not len(way.overflow)
    del batch
    gc.collect()  # the mapping goes with the last tensor viewing it
    assert open_fds() <= before and way.ring.free_slot_count() == way.ring.num_slots


def test_through_a_ring_a_batch_past_held_batches_is_copied_and_its_slot_freed() -> None:
    way = RingWay(held_batches=0)
    try:
        batch = way.send([torch.ones(4)])
        assert way.reader.copied and way.ring.free_slot_count() == way.ring.num_slots
        _same(batch, [torch.ones(4)])
    finally:
        way.close()


def test_through_a_ring_an_error_is_raised_with_its_type_and_frees_the_slot(way: RingWay) -> None:
    with pytest.raises(KeyError, match="sample 7"):
        way.fail(KeyError("sample 7"))
    assert pickle.loads(way.reader.capture) == ("capture",)
    assert way.ring.free_slot_count() == way.ring.num_slots


def test_an_error_too_long_for_its_slot_keeps_the_start_of_its_message(way: RingWay) -> None:
    long = "x" * (2 * way.ring.slot_bytes)
    with pytest.raises(RuntimeError) as info:
        way.fail(ValueError(long))
    assert 4000 < len(str(info.value)) < 2 * way.ring.slot_bytes and "ValueError" in str(info.value)


def test_an_error_that_cannot_be_pickled_arrives_as_its_message(way: RingWay) -> None:
    class Unpicklable(Exception):  # a class of the script, sent by value: its lock cannot be
        lock = threading.Lock()

    with pytest.raises(RuntimeError, match="cannot travel"):
        way.fail(Unpicklable("cannot travel"))
