"""Pinned batches and device prefetch.

The logic is tested on the CPU with a fake runtime that behaves like an
asynchronous device. A fake "non_blocking copy" is queued on a fake stream
and reads the ring only when the stream later runs it, as a real DMA would;
if a slot were handed back to the workers before its copy ran, the copy
would read another batch and the test fails (a control run with a runtime
whose events lie shows that it does). The real-GPU tests at the end (marked
``gpu``) skip without an accelerator.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from torch.utils.data import DataLoader

import fastload
from fastload import FastLoader
from fastload.debug import debug_view
from fastload.device.prefetch import DevicePrefetcher, move_to
from fastload.device.pinning import ReleaseGate
from support.datasets import GrowingRows, Plain
from support.faults import Misbehave

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


def rows(n: int, width: int = 4096) -> Plain:
    """Sample i: a float32 row of ``width`` filled with i (content checkable from the index)."""
    return Plain(n, width=width, dtype=torch.float32)


# ---- a fake asynchronous device --------------------------------------------
class FakeStream:
    """Operations run in order, only when the test advances the stream."""

    def __init__(self) -> None:
        self.ops: List[Any] = []
        self.done = 0

    def run(self, upto: Optional[int] = None) -> None:
        upto = len(self.ops) if upto is None else min(upto, len(self.ops))
        while self.done < upto:
            op = self.ops[self.done]
            self.done += 1
            if callable(op):
                op()


class FakeEvent:
    def __init__(self, stream: FakeStream, honest: bool = True) -> None:
        self.stream = stream
        self.at = -1
        self.honest = honest

    def record(self) -> None:
        self.stream.ops.append(None)
        self.at = len(self.stream.ops)

    def query(self) -> bool:
        return (not self.honest) or self.stream.done >= self.at

    def synchronize(self) -> None:
        self.stream.run(self.at)


class FakeRuntime:
    """Registers ranges, records events on a FakeStream, pins by copying."""

    def __init__(self, fail_register: bool = False, honest_events: bool = True,
                 fail_after: Optional[int] = None) -> None:
        self.stream = FakeStream()
        self.registered: Dict[int, int] = {}
        self.log: List[Tuple[str, int, int]] = []
        self.fail_register = fail_register
        self.honest_events = honest_events
        self.copies = 0  # tensors pin() had to copy
        self.kept: List[torch.Tensor] = []
        self.fail_after = fail_after  # registrations that succeed before the rest fail

    def host_register(self, address: int, nbytes: int) -> Optional[str]:
        if self.fail_register or (self.fail_after is not None
                                  and len(self.registered) >= self.fail_after):
            return "invalid argument (code 1)"
        for a, n in self.registered.items():
            assert address + nbytes <= a or a + n <= address, "overlapping registration"
        self.registered[address] = nbytes
        self.log.append(("register", address, nbytes))
        return None

    def host_unregister(self, address: int) -> Optional[str]:
        n = self.registered.pop(address)
        self.log.append(("unregister", address, n))
        return None

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.stream, self.honest_events)

    def is_registered(self, t: torch.Tensor) -> bool:
        p = t.untyped_storage().data_ptr()
        return any(a <= p and p + t.untyped_storage().nbytes() <= a + n
                   for a, n in self.registered.items())

    def pin(self, data: Any) -> Any:
        def one(t: torch.Tensor) -> torch.Tensor:
            if self.is_registered(t):
                return t
            self.copies += 1
            copy = t.clone()
            # torch's pinned-memory allocator keeps a block until the copies
            # queued from it are done; keeping them all is simpler.
            self.kept.append(copy)
            return copy

        return move_to(data, one)

    def copy_async(self, t: torch.Tensor, expect: float, errors: List[str]) -> None:
        """A non_blocking copy of float32 ``t``: like a DMA, it holds no
        reference to the tensor and reads its memory when the stream runs it."""
        assert t.dtype == torch.float32 and t.is_contiguous()
        address, n = t.data_ptr(), t.numel()

        def run() -> None:
            got = torch.tensor(list((ctypes.c_float * n).from_address(address)))
            if not bool((got == expect).all()):
                errors.append(f"copy read {got[:3].tolist()}..., expected {expect}")

        self.stream.ops.append(run)


class FakeAccelerator:
    """Makes DataLoader's iterator believe a CUDA accelerator is present."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda *a, **k: torch.device("cuda"))


def pinned_loader(runtime: FakeRuntime, dataset: Any, **kw: Any) -> FastLoader:
    class Loader(FastLoader):
        def _device_runtime(self, device_type: Optional[str]) -> Any:
            assert device_type == "cuda"
            return runtime

    kw.setdefault("num_workers", 2)
    kw.setdefault("batch_size", 4)
    return Loader(dataset, pin_memory=True, **kw)


# ---- ReleaseGate -------------------------------------------------------------
def test_release_gate_frees_only_finished_slots() -> None:
    stream = FakeStream()
    freed: List[int] = []
    gate = ReleaseGate(freed.append, lambda: FakeEvent(stream))
    for slot in (3, 1, 2):
        stream.ops.append(lambda: None)  # a copy from this slot
        gate.hold(slot)
    assert gate.collect() == 0 and freed == [] and len(gate) == 3
    stream.run(2)  # the first copy and its event
    assert gate.collect() == 1 and freed == [3]
    assert gate.wait_one() and freed == [3, 1]  # synchronises the oldest
    assert stream.done == 4
    gate.drain()
    assert freed == [3, 1, 2] and len(gate) == 0 and not gate.wait_one()


def test_release_gate_events_on_other_streams_finish_in_any_order() -> None:
    a, b = FakeStream(), FakeStream()
    streams = iter([a, b])
    freed: List[int] = []
    gate = ReleaseGate(freed.append, lambda: FakeEvent(next(streams)))
    gate.hold(0)
    gate.hold(1)
    b.run()
    assert gate.collect() == 1 and freed == [1]
    a.run()
    assert gate.collect() == 1 and freed == [1, 0]


# ---- the loader with a fake runtime -----------------------------------------
def run_async_loop(loader: FastLoader, runtime: FakeRuntime, lag: int) -> Tuple[List[int], List[str]]:
    """Each batch is 'copied' asynchronously and dropped at once; the fake
    stream runs ``lag`` batches behind."""
    errors: List[str] = []
    seen: List[int] = []
    for batch in loader:
        for row in range(batch.shape[0]):
            value = float(batch[row, 0])
            seen.append(int(value))
            runtime.copy_async(batch[row], value, errors)
        del batch, row  # the release event is recorded after the copies
        runtime.stream.run(max(0, len(runtime.stream.ops) - lag * 10))
    runtime.stream.run()
    return seen, errors


@pytest.mark.heavy
def test_pinned_batches_are_views_of_registered_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime()
    ds = rows(64, 4096)  # 64 KiB per batch of 4
    loader = pinned_loader(runtime, ds)
    ring_ptrs = []
    for batch in loader:
        assert runtime.is_registered(batch), "a batch from the ring was not registered"
        ring_ptrs.append(batch.untyped_storage().data_ptr())
    assert runtime.copies == 0  # no copy: every batch was pinned in place
    regs = [n for op, _a, n in runtime.log if op == "register"]
    assert regs and all(n == 1 << 20 for n in regs)  # per slot, the used bytes in whole MiB
    assert len(regs) <= loader.num_workers * (loader.prefetch_factor + 1) + loader.held_batches
    expected = [b for b in DataLoader(ds, batch_size=4)]
    assert [b for b in loader] and all(torch.equal(a, b) for a, b in zip(loader, expected))
    del loader, batch
    gc.collect()
    assert runtime.registered == {}, "the ring was not unregistered when the loader ended"


@pytest.mark.heavy
def test_slot_waits_for_copies_before_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime()
    ds = rows(400, 1024)
    seen, errors = run_async_loop(pinned_loader(runtime, ds, batch_size=2), runtime, lag=3)
    assert errors == []
    assert seen == list(range(400))


def test_control_lying_events_let_workers_overwrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with events that claim to be done at once,
    slots are reused under the pending copies and they read other batches."""
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime(honest_events=False)
    ds = rows(400, 1024)
    seen, errors = run_async_loop(pinned_loader(runtime, ds, batch_size=2), runtime, lag=3)
    assert seen == list(range(400))
    assert errors, "lying events should have let a worker overwrite a slot under a copy"


@pytest.mark.heavy
def test_registration_grows_with_the_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime()
    ds = GrowingRows(n=64, width=60000)  # batches under 1 MiB, then under 4 MiB
    loader = pinned_loader(runtime, ds, num_workers=1)
    for batch in loader:
        assert runtime.is_registered(batch)
        del batch
    sizes = sorted({n for op, _a, n in runtime.log if op == "register"})
    assert sizes == [1 << 20, 4 << 20]
    regrown = [a for op, a, n in runtime.log if op == "unregister"]
    assert regrown, "a slot that got a longer batch was not re-registered"
    del loader
    gc.collect()
    assert runtime.registered == {}


@pytest.mark.heavy
def test_registration_failure_falls_back_to_copies(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime(fail_register=True)
    ds = rows(48, 64)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        got = list(pinned_loader(runtime, ds))
        got2 = list(pinned_loader(runtime, ds))
    expected = list(DataLoader(ds, batch_size=4))
    assert all(torch.equal(a, b) for a, b in zip(got + got2, expected + expected))
    assert len(got) == len(expected) and runtime.copies == 2 * len(expected)
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 2  # once per loader (per ring), not per batch
    assert "copied into pinned memory" in warnings[0].getMessage()


@pytest.mark.heavy
def test_slots_registered_before_a_failure_stay_gated(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime(fail_after=2)
    ds = rows(400, 1024)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        seen, errors = run_async_loop(pinned_loader(runtime, ds, batch_size=2), runtime, lag=3)
    assert errors == [] and seen == list(range(400))
    assert 0 < runtime.copies < 200  # some batches were views of the 2 registered slots
    assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.heavy
def test_registration_outlives_the_loader_while_batches_live(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAccelerator(monkeypatch)
    runtime = FakeRuntime()
    loader = pinned_loader(runtime, rows(32, 1024))
    kept = [b for i, b in enumerate(loader) if i >= 6]  # the last two of 8
    del loader
    gc.collect()
    assert runtime.registered, "unregistered while tensors still view the ring"
    assert all(runtime.is_registered(t) for t in kept)
    assert [float(t[0, 0]) for t in kept] == [24.0, 28.0]
    del kept
    gc.collect()
    assert runtime.registered == {}


@pytest.mark.heavy
def test_pinned_warm_pool_and_persistent_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAccelerator(monkeypatch)
    ds = rows(40, 256)
    expected = list(DataLoader(ds, batch_size=4))
    for persistent in (False, True):
        runtime = FakeRuntime()
        loader = pinned_loader(runtime, ds, persistent_workers=persistent)
        for _ in range(3):
            seen, errors = run_async_loop(loader, runtime, lag=2)
            assert errors == [] and seen == list(range(40))
        assert all(torch.equal(a, b) for a, b in zip(loader, expected))
        registrations = [op for op, _a, _n in runtime.log if op == "register"]
        assert len(registrations) <= loader.num_workers * 3 + loader.held_batches  # kept
        del loader
        gc.collect()
        assert runtime.registered == {}


# ---- device prefetch ---------------------------------------------------------
class FakeOps:
    """Stream ops that 'copy to the device' by cloning, and log what happens."""

    def __init__(self) -> None:
        self.log: List[str] = []

    def copy_to_device(self, fetch: Any) -> Any:
        batch = fetch()
        self.log.append("copy")
        return move_to(batch, lambda t: t.clone())

    def hand_over(self, data: Any) -> Any:
        self.log.append("hand_over")
        return data


def prefetch_loader(ops: FakeOps, dataset: Any, **kw: Any) -> FastLoader:
    class Loader(FastLoader):
        def _stream_ops(self) -> Any:
            return ops

    kw.setdefault("batch_size", 4)
    return Loader(dataset, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_prefetch_runs_one_batch_ahead(num_workers: int) -> None:
    ops = FakeOps()
    ds = rows(40, 8)
    it = iter(prefetch_loader(ops, ds, num_workers=num_workers))
    first = next(it)
    assert ops.log == ["copy", "copy", "hand_over"]  # batch 1 already on its way
    rest = list(it)
    assert ops.log.count("copy") == 10 and ops.log.count("hand_over") == 10
    expected = list(DataLoader(ds, batch_size=4))
    assert all(torch.equal(a, b) for a, b in zip([first] + rest, expected))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.heavy
def test_device_prefetch_errors_arrive_with_their_batch(num_workers: int) -> None:
    ds = Misbehave(40, {13: "raise"}, width=16, dtype=torch.float32)  # batch 3 of 10
    def run(loader: Any) -> List[Any]:
        out: List[Any] = []
        it = iter(loader)
        while True:
            try:
                out.append(next(it)[:, 0].tolist())
            except StopIteration:
                return out
            except ValueError as err:
                out.append(type(err).__name__)
    mp = {} if num_workers == 0 else {"multiprocessing_context": "spawn"}
    expected = run(DataLoader(ds, batch_size=4, num_workers=num_workers, **mp))
    got = run(prefetch_loader(FakeOps(), ds, num_workers=num_workers))
    assert got == expected and expected[3] == "ValueError" and len(expected) == 10


@pytest.mark.heavy
def test_device_prefetch_persistent_workers_and_break() -> None:
    ops = FakeOps()
    ds = rows(24, 4)
    loader = prefetch_loader(ops, ds, num_workers=2, persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    epochs = [list(loader) for _ in range(2)]
    expected = list(DataLoader(ds, batch_size=4))
    for got in epochs:
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_device_cpu_is_a_no_op() -> None:
    ds = rows(20, 4)
    for nw in (0, 2):
        got = list(FastLoader(ds, batch_size=4, num_workers=nw, device="cpu"))
        assert all(torch.equal(a, b) for a, b in zip(got, DataLoader(ds, batch_size=4)))
        assert all(t.device.type == "cpu" for t in got)


def test_device_option_errors() -> None:
    ds = rows(4)
    with pytest.raises(ValueError, match="device option should be"):
        FastLoader(ds, device="not-a-device")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match=r"device option is 'cuda'.*is_available\(\) is False"):
            FastLoader(ds, device="cuda")


def test_move_to_keeps_structure() -> None:
    from collections import namedtuple, OrderedDict

    P = namedtuple("P", "a b")
    data = {"x": torch.ones(2), "l": [torch.zeros(1), "s", 3], "p": P(torch.ones(1), b"b"),
            "o": OrderedDict(k=torch.ones(1))}
    out = move_to(data, lambda t: t * 2)
    assert out["x"].tolist() == [2.0, 2.0] and out["l"][1:] == ["s", 3]
    assert isinstance(out["p"], P) and out["p"].b == b"b" and isinstance(out["o"], OrderedDict)


def test_the_real_runtime_s_events_let_a_waiting_loader_sleep(monkeypatch) -> None:
    from fastload.device.pinning import CudaRuntime

    made: List[Dict[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw))
    CudaRuntime.__new__(CudaRuntime).new_event()
    assert made == [{"blocking": True}]  # cudaEventBlockingSync: no spinning in wait_one


def test_import_does_not_initialise_an_accelerator() -> None:
    list(FastLoader(rows(8), batch_size=4, num_workers=2, pin_memory=False))
    assert not torch.cuda.is_initialized()


# ---- real accelerator (skipped here: no GPU) ---------------------------------
@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm device")
def test_gpu_batches_are_pinned_in_place() -> None:
    loader = FastLoader(rows(64, 4096), batch_size=4, num_workers=2,
                        pin_memory=True)
    for batch in loader:
        assert batch.is_pinned()
    pool = debug_view(loader).idle_pool  # the warm pool kept after the epoch
    assert pool is not None and pool.pinned
    if pool.pin_failed is None:  # registration worked: batches were views of the ring
        assert pool.pinned_bytes > 0
    else:  # it failed (some ROCm versions): the batches were pinned copies
        pytest.xfail(f"host registration failed here, copies were pinned: {pool.pin_failed}")


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm device")
def test_gpu_non_blocking_copies_never_read_a_reused_slot() -> None:
    ds = rows(512, 1 << 16)
    outs = []
    for batch in FastLoader(ds, batch_size=8, num_workers=2, pin_memory=True):
        torch.cuda._sleep(2_000_000)  # keep the stream busy so the copy really lags
        outs.append(batch.to("cuda", non_blocking=True))
        del batch
    torch.cuda.synchronize()
    got = torch.cat([o[:, 0] for o in outs]).cpu()
    assert got.tolist() == [float(i) for i in range(512)]
    assert all(bool((o == o[:, :1]).all()) for o in outs)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm device")
def test_gpu_device_prefetch() -> None:
    ds = rows(256, 1 << 14)
    got = []
    for batch in FastLoader(ds, batch_size=8, num_workers=2, device="cuda"):
        assert batch.device.type == "cuda"
        torch.cuda._sleep(1_000_000)
        got.append(batch.sum(dim=1).cpu())
    expected = [b.sum(dim=1) for b in DataLoader(ds, batch_size=8)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == 32


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm device")
def test_gpu_a_loader_waiting_for_the_gpu_sleeps() -> None:
    """The loop queues GPU work faster than the GPU runs it, so the loader
    spends most of the epoch waiting for slots the GPU still copies from."""
    import time

    it = iter(FastLoader(rows(256, 1 << 14), batch_size=8, num_workers=2, pin_memory=True))
    outs = [next(it).to("cuda", non_blocking=True)]
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in it:
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time a step
        outs.append(batch.to("cuda", non_blocking=True))
        del batch
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    torch.cuda.synchronize()
    assert torch.cat([o[:, 0] for o in outs]).cpu().tolist() == [float(i) for i in range(256)]
    assert cpu < 0.3 * wall, f"the loop used {cpu:.2f} s of CPU in {wall:.2f} s waiting for the GPU"


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA or ROCm device")
def test_gpu_h2d_benchmark_delivers_every_batch_and_spares_the_main_process() -> None:
    from fastload.bench import h2d

    res = h2d.measure_h2d(rounds=1, workers=2, steps_ms=(0.0,), batches=40, warmup=8)
    assert res["correct"] == {m: True for m in h2d.MODES}
    assert res["pinned"] == {m: True for m in h2d.MODES}
    m = res["median"]["0.0"]
    # DataLoader's pin thread copies every 38.5 MB batch once more in this
    # process; fastload's batches are already pinned where the workers wrote them.
    assert m["fastload"]["main_cpu_ms_per_batch"] < m["DataLoader"]["main_cpu_ms_per_batch"]
    assert "fastload device" in h2d.report_lines(res)
