"""Device prefetch: the loader copies batch ``k+1`` to the device on a side
stream while the loop computes on batch ``k``.

The stream calls go through :class:`StreamOps` (real: :class:`CudaStreamOps`,
CUDA or HIP; fakes in ``tests/test_pinning.py``), so the pipeline's logic is
tested without a GPU.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["StreamOps", "CudaStreamOps", "DevicePrefetcher", "move_to", "resolve_device"]


class StreamOps(Protocol):
    """The stream operations device prefetch needs."""

    def copy_to_device(self, fetch: Callable[[], Any]) -> Any:
        """Get the next host batch from ``fetch()`` and, on the side stream,
        return it with every tensor copied to the device (``non_blocking``)."""
        ...

    def hand_over(self, data: Any) -> Any:
        """Make the current stream wait for the side stream's copies and mark the
        batch's tensors as used by the current stream (``record_stream``)."""
        ...


class CudaStreamOps:
    """CUDA/HIP streams (``torch.cuda`` is HIP on ROCm builds)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def copy_to_device(self, fetch: Callable[[], Any]) -> Any:
        with torch.cuda.stream(self.stream):
            # The host batch is a temporary that dies inside the side stream's
            # context: a pinned ring slot then records its release event on
            # the stream that copies from it.
            return move_to(fetch(), lambda t: t.to(self.device, non_blocking=True))

    def hand_over(self, data: Any) -> Any:
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)

        def mark(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == self.device.type:
                t.record_stream(current)
            return t

        return move_to(data, mark)


class DevicePrefetcher:
    """Keeps one batch in flight to the device ahead of the one handed out.

    An error raised while fetching the batch ahead (a dataset exception, the
    end of the epoch) is raised when the loop asks for that batch, not
    earlier, so errors and ``StopIteration`` arrive where DataLoader gives
    them. ``KeyboardInterrupt`` and the like are never deferred.
    """

    def __init__(self, ops: StreamOps) -> None:
        self._ops = ops
        self._ahead: Optional[Any] = None
        self._has_ahead = False
        self._deferred: Optional[Exception] = None

    def reset(self) -> None:
        """Forget the batch ahead (a new epoch of a persistent iterator)."""
        self._ahead = None
        self._has_ahead = False
        self._deferred = None

    def next(self, fetch: Callable[[], Any]) -> Any:
        if not self._has_ahead:
            if self._deferred is not None:
                err, self._deferred = self._deferred, None
                raise err
            self._ahead = self._ops.copy_to_device(fetch)
            self._has_ahead = True
        batch, self._ahead, self._has_ahead = self._ahead, None, False
        try:
            self._ahead = self._ops.copy_to_device(fetch)
            self._has_ahead = True
        except Exception as err:  # raised when the loop asks for that batch
            self._deferred = err
        return self._ops.hand_over(batch)


def resolve_device(device: Any) -> Optional[torch.device]:
    """Check the ``device`` option; None means no device prefetch."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device option should be a torch.device or a device string, "
                         f"but got {device!r}") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device option is {device!r}, but torch.cuda.is_available() is "
                         "False (no CUDA or ROCm device is visible to this process)")
    return dev


def move_to(data: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``data`` with ``fn`` applied to every tensor, structure kept the way
    DataLoader's ``pin_memory`` keeps it."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: move_to(v, fn) for k, v in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                import copy

                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(move_to(v, fn) for v in data))
    if isinstance(data, tuple):
        return tuple(move_to(v, fn) for v in data)
    if isinstance(data, collections.abc.Sequence):
        moved = [move_to(v, fn) for v in data]
        try:
            return type(data)(moved)  # type: ignore[call-arg]
        except TypeError:
            return moved
    return data


class BlockingOps:
    """Devices without CUDA-style streams (xpu, mps, ...): a plain ``.to()``;
    correct, but the copy does not overlap the loop's work."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy_to_device(self, fetch: Callable[[], Any]) -> Any:
        return move_to(fetch(), lambda t: t.to(self.device))

    def hand_over(self, data: Any) -> Any:
        return data
