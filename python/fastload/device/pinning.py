"""Pinned batches: register the ring with the accelerator runtime, and keep a
slot away from the workers until device copies reading it have finished.

Everything that touches CUDA/HIP goes through one small interface,
:class:`DeviceRuntime`, so the logic here is tested on the CPU with a fake
runtime (``tests/test_pinning.py``); :class:`CudaRuntime` is the real one
(``torch.cuda.cudart()`` is HIP on ROCm builds of torch).

How it fits together:

* :class:`PinnedRing` belongs to one worker pool (one ring). When the loop
  receives a batch, :meth:`PinnedRing.lease` registers the slot's used bytes
  with ``cudaHostRegister`` the first time (growing the registration when a
  later batch in that slot is longer), so tensors viewing the slot are
  pinned and ``.to(device, non_blocking=True)`` is a real DMA from the ring.
  Registration is per slot, never across slots, so no tensor straddles two
  registrations, and only bytes batches really use are locked: the ring's
  address space is mostly never committed.
* When the last view of a pinned slot dies, the slot is not freed at once:
  an event is recorded on the current stream (after any copy the loop
  queued from it) and the slot waits in :class:`ReleaseGate` until that
  event has completed; only then do workers get it back. Without this a
  fast loop would train on a batch a worker is already overwriting.
* If registration fails (it does for shared mappings on some ROCm
  versions), one warning is logged and batches are copied into torch's own
  pinned memory instead, as DataLoader's pin thread does.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Tuple

import torch

from .. import _core

log = logging.getLogger("fastload")

__all__ = ["DeviceEvent", "DeviceRuntime", "CudaRuntime", "ReleaseGate", "PinnedRing",
           "cuda_runtime_or_none"]

# cudaHostRegisterPortable: the pages count as pinned for every device/context.
_HOST_REGISTER_PORTABLE = 1


class DeviceEvent(Protocol):
    """What :class:`ReleaseGate` needs of an event (``torch.cuda.Event`` has it)."""

    def record(self) -> None: ...  # on the current stream
    def query(self) -> bool: ...  # True once the work recorded before it is done
    def synchronize(self) -> None: ...


class DeviceRuntime(Protocol):
    """The accelerator calls fastload makes; one real implementation (CUDA/HIP),
    fakes in the tests."""

    def host_register(self, address: int, nbytes: int) -> Optional[str]:
        """Page-lock ``[address, address + nbytes)``; None on success, else the error."""
        ...

    def host_unregister(self, address: int) -> Optional[str]:
        """Undo :meth:`host_register` of the range starting at ``address``."""
        ...

    def new_event(self) -> DeviceEvent: ...

    def pin(self, data: Any) -> Any:
        """DataLoader's pinning: tensors not already pinned are copied into
        pinned memory; pinned ones are returned as they are."""
        ...


class CudaRuntime:
    """CUDA, or HIP on ROCm builds of torch (``torch.cuda`` serves both)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self._cudart = torch.cuda.cudart()
        self._device_type = device_type

    def _check(self, err: Any) -> Optional[str]:
        if err == self._cudart.cudaError.success:
            return None
        try:
            text = self._cudart.cudaGetErrorString(err)
        except Exception:  # pragma: no cover - depends on the runtime
            text = "unknown error"
        _drain_last_error()
        return f"{text} (code {int(err)})"

    def host_register(self, address: int, nbytes: int) -> Optional[str]:
        return self._check(self._cudart.cudaHostRegister(address, nbytes,
                                                         _HOST_REGISTER_PORTABLE))

    def host_unregister(self, address: int) -> Optional[str]:
        return self._check(self._cudart.cudaHostUnregister(address))

    def new_event(self) -> DeviceEvent:
        # blocking=True (cudaEventBlockingSync): a loader waiting in
        # ReleaseGate.wait_one for the GPU to finish with a slot sleeps
        # instead of spinning. A training loop that queues work ahead of
        # the GPU waits there for most of every step, and a spinning wait
        # takes a core from the workers.
        return torch.cuda.Event(blocking=True)

    def pin(self, data: Any) -> Any:
        from torch.utils.data._utils.pin_memory import pin_memory

        return pin_memory(data, self._device_type)


def _drain_last_error() -> None:
    """A failed runtime call leaves a 'last error' that torch's next kernel
    launch check would report as its own; launching a trivial kernel and
    synchronising consumes it."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def cuda_runtime_or_none(device_type: Optional[str]) -> Optional[DeviceRuntime]:
    """The runtime whose host-register call can pin the ring, if the current
    accelerator has one (CUDA and ROCm do; others are pinned by copying)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return CudaRuntime(device_type)
    return None


class ReleaseGate:
    """Slots whose last view died, held until the device work queued before
    that moment (the loop's ``non_blocking`` copies from them) has finished.

    ``hold(slot)`` is called from the view's destructor, in whatever thread
    drops it; ``collect()`` and ``wait_one()`` run in the loader's thread.
    """

    def __init__(self, release: Callable[[int], None],
                 new_event: Callable[[], DeviceEvent]) -> None:
        self._release = release
        self._new_event = new_event
        self._lock = threading.Lock()
        self._pending: Deque[Tuple[int, DeviceEvent]] = collections.deque()

    def hold(self, slot: int) -> None:
        event = self._new_event()
        event.record()
        with self._lock:
            self._pending.append((slot, event))

    def __len__(self) -> int:
        return len(self._pending)

    def collect(self) -> int:
        """Free every held slot whose event has completed; returns how many."""
        with self._lock:
            held = list(self._pending)
            self._pending.clear()
        done: List[int] = []
        keep: List[Tuple[int, DeviceEvent]] = []
        for slot, event in held:  # events on different streams finish in any order
            if event.query():
                done.append(slot)
            else:
                keep.append((slot, event))
        with self._lock:  # ahead of any hold() that came in meanwhile: oldest first
            self._pending.extendleft(reversed(keep))
        for slot in done:
            self._release(slot)
        return len(done)

    def wait_one(self) -> bool:
        """Block until the oldest held slot's copies are done and free it."""
        with self._lock:
            if not self._pending:
                return False
            slot, event = self._pending.popleft()
        event.synchronize()
        self._release(slot)
        return True

    def drain(self) -> None:
        """Wait for every held slot (before the ring's memory is unregistered)."""
        while self.wait_one():
            pass


class PinnedRing:
    """Pins one ring's slots for one runtime, with a :class:`ReleaseGate`.

    Leases it hands out keep it alive (through their release callback), and
    it keeps the ring's mapping alive, so the memory is unregistered only
    after the last tensor viewing it has died and its copies have finished,
    and before it is unmapped.
    """

    def __init__(self, ring: _core.Ring, runtime: DeviceRuntime) -> None:
        self._ring = ring
        self._runtime = runtime
        self._payload = ring.payload_region()  # keeps the mapping alive until we unregister
        self._base = self._payload.address
        self._slot_bytes = ring.slot_bytes
        self._registered: Dict[int, int] = {}  # slot -> registered bytes
        self.failed: Optional[str] = None  # set once registration has failed: copy instead
        self.gate = ReleaseGate(ring.release, runtime.new_event)
        self._owner_pid = os.getpid()  # a forked copy must not touch the parent's slots

    def lease(self, slot: int, nbytes: int) -> _core.Region:
        """Lease ``slot`` (READY) as a Region that is pinned if registration works."""
        if self.failed is None and nbytes > self._registered.get(slot, 0):
            self._register(slot, nbytes)
        if nbytes > self._registered.get(slot, 0):
            # Not pinned (registration failed): pin() copies it, and the slot
            # is free as soon as its views die.
            return self._ring.lease(slot, nbytes)
        # Pinned views: the slot waits for their device copies (the gate),
        # even after a later failure elsewhere. The callback is a method of
        # self, so live views keep the registration and the mapping alive.
        return self._ring.lease(slot, nbytes, self._hold)

    def _hold(self, slot: int) -> None:
        self.gate.hold(slot)

    def _register(self, slot: int, nbytes: int) -> None:
        address = self._base + slot * self._slot_bytes
        if slot in self._registered:
            # A longer batch than this slot held before: its previous lease is
            # dead and its copies are done (the gate freed it), so re-register.
            err = self._runtime.host_unregister(address)
            del self._registered[slot]
            if err is not None:
                self._fail(f"cudaHostUnregister of slot {slot} failed: {err}")
                return
        # Round up to whole pages: the runtime pins pages anyway, and a batch a
        # little longer next time then needs no re-registration.
        length = min(self._slot_bytes, -(-nbytes // (1 << 20)) << 20)
        err = self._runtime.host_register(address, length)
        if err is not None:
            self._fail(f"cudaHostRegister of {length} bytes of the ring failed: {err}")
            return
        self._registered[slot] = length

    def _fail(self, why: str) -> None:
        self.failed = why
        log.warning("fastload: %s; batches will be copied into pinned memory instead "
                    "(one copy per batch, as DataLoader's pin_memory thread makes)", why)
        # Slots already registered stay so while their views live; close()
        # unregisters them.

    def pin(self, data: Any) -> Any:
        """The batch with every tensor pinned: views of registered slots as
        they are, anything else copied (overflow batches, copied-out ones)."""
        return self._runtime.pin(data)

    def registered_bytes(self) -> int:
        return sum(self._registered.values())

    def close(self) -> None:
        """Wait for pending copies, then unregister every slot."""
        self.gate.drain()
        for slot in list(self._registered):
            err = self._runtime.host_unregister(self._base + slot * self._slot_bytes)
            if err is not None:
                log.warning("fastload: cudaHostUnregister of slot %d failed: %s", slot, err)
        self._registered.clear()

    def __del__(self) -> None:
        if getattr(self, "_owner_pid", None) != os.getpid():
            return
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass
