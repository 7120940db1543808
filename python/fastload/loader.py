"""``FastLoader``: DataLoader's API and semantics, fastload's transport.

``FastLoader`` *is* a ``torch.utils.data.DataLoader`` (a subclass): argument
checking, samplers, ``len()``, attribute rules, warnings and ``num_workers=0``
are DataLoader's own code, so they cannot drift. With workers, its iterator
follows ``_MultiProcessingDataLoaderIter`` step for step (task order,
round-robin over active workers, prefetching, IterableDataset exhaustion,
persistent workers) but batches travel through the shared-memory ring of
:mod:`fastload.pool.worker_pool` instead of pickled queues.
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
import operator
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, Iterable, List, Optional, Tuple,
                    TypeVar, Union)

import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, RandomSampler, Sampler,
                              SequentialSampler)
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .resume import format as resume_format
from .common.debug_views import LoaderView
from .common.errors import add_note
from .device.prefetch import StreamOps
from .iterator.multi_process import FastLoaderIter
from .iterator.single_process import SingleProcessIter
from .stats.autoscale import AUTO, cores_available, initial_workers
from .stats.loader_stats import LoaderStats
from .device.pinning import DeviceRuntime
from .iterator.loader_runtime import LoaderOptions, LoaderRuntime, loader_modules

__all__ = ["FastLoader", "LoaderOptions", "STATE_ATTR", "stats"]

T_co = TypeVar("T_co", covariant=True)
# Where a loader keeps its LoaderRuntime: FastLoader sets it in its constructor,
# fastload.install() on first iteration of a plain DataLoader.
STATE_ATTR = "_fastload_state"


_V = TypeVar("_V")


class _Option(Generic[_V]):
    """A FastLoader attribute backed by its LoaderOptions (read and write,
    checked as in the constructor)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, loader: Any, owner: Optional[type] = None) -> _V:
        if loader is None:
            return self  # type: ignore[return-value]
        return getattr(getattr(loader, STATE_ATTR).options, self._name)

    def __set__(self, loader: Any, value: _V) -> None:
        state = getattr(loader, STATE_ATTR)
        state.options = dataclasses.replace(state.options, **{self._name: value})


class FastLoader(DataLoader[T_co]):
    """Drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Takes exactly the installed torch's DataLoader arguments, with the same
    defaults and errors, plus ``num_workers="auto"`` and keyword-only options.
    They go to that DataLoader as given: one it does not take (``in_order``
    before torch 2.6) fails there with its ``TypeError``, and
    ``inspect.signature(FastLoader)`` shows its parameters, then these:

    Args:
        num_workers: as DataLoader's, or ``"auto"``: fastload chooses the
            count and keeps choosing it between batches (see
            :mod:`fastload.stats.autoscale`): it starts from half the cores (2 to
            8; ``loader.num_workers`` says which), adds workers while the
            loop waits and the workers are busy, as many as the cores the
            loop leaves can run (workers that wait on I/O take little CPU, so
            the count can go well past the cores), and retires idle ones.
            Every index still comes once per epoch in the sampler's order,
            and each new worker is seeded and ``worker_init_fn``-ed as a
            fresh DataLoader worker; which worker makes which batch changes
            with the count, so values drawn from worker RNG differ from a
            fixed-count run. An IterableDataset keeps the count it starts
            with (its replicas shard by it). ``stats().workers`` tells the
            count in use.
        allow_gpu_in_workers: do not hide CUDA/ROCm devices from workers
            (by default ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` and
            ``ROCR_VISIBLE_DEVICES`` are set empty in their environment).
        slot_bytes: bytes per ring slot; by default 64 MiB (memfd pages are
            committed only when written) and learned from the batches seen.
            A batch larger than its slot still arrives whole, through an
            overflow segment.
        held_batches: how many batches the training loop may keep alive
            while still getting zero-copy batches; past that, batches are
            copied out of the ring so the workers never run dry (default 4).
        reuse_workers: with ``persistent_workers=False``, keep the worker
            pool between epochs (its ring and zygote; default True; it ends
            with the loader): each epoch's workers are forked from the warm
            zygote in milliseconds (spawned workers, with an explicit
            ``'spawn'``, are kept and sent the dataset again), seeded as
            fresh DataLoader workers are. False builds everything anew every
            epoch, as DataLoader does.
        hang_timeout: seconds a worker may hold one batch (or take to start
            and join the ring) without progress before
            :class:`fastload.WorkerHangError` (with the worker's Python
            stack) ends the epoch; a warning is logged at half of it.
            ``None`` turns the watchdog off (default 300).
        max_worker_restarts: how many times per iterator a worker that died
            or hung is replaced by a new process, its unfinished batches made
            again, so the epoch goes on with every index delivered once and in
            order (default 0: the error, as DataLoader). Map-style datasets
            only. Exceptions raised by ``dataset[i]`` are never retried.
        device: device prefetch (default None: off). With a CUDA/ROCm device
            the loader copies each batch to it on a side stream one batch
            ahead and yields device tensors, the current stream made to wait
            for the copy; the ring is then pinned as with ``pin_memory=True``.
            ``'cpu'`` yields the batches unchanged.

    Differences from DataLoader, on purpose: when ``multiprocessing_context``
    is None (DataLoader uses the platform default, ``fork`` on Linux) workers
    are forked from a zygote of the pool's own, a spawn-started process that
    imported torch and nothing of the training process (see
    :mod:`fastload.launching`); ``'spawn'`` given explicitly is real spawn. What
    plain pickle cannot send to a spawned worker (``__main__`` classes,
    lambdas, closures) is sent by value with cloudpickle.
    """

    allow_gpu_in_workers: _Option[bool] = _Option()
    slot_bytes: _Option[Optional[int]] = _Option()
    held_batches: _Option[int] = _Option()
    reuse_workers: _Option[bool] = _Option()
    hang_timeout: _Option[Optional[float]] = _Option()
    max_worker_restarts: _Option[int] = _Option()
    device: _Option[Optional[torch.device]] = _Option()

    if TYPE_CHECKING:
        # What type checkers see: DataLoader's arguments as the newest torch
        # has them. At run time the signature is the installed torch's (see
        # _signature below): an argument that torch's DataLoader lacks
        # (``in_order`` before torch 2.6) is not there.
        def __init__(
            self,
            dataset: Dataset[T_co],
            batch_size: Optional[int] = 1,
            shuffle: Optional[bool] = None,
            sampler: Optional[Sampler | Iterable] = None,
            batch_sampler: Optional[Sampler[List] | Iterable[List]] = None,
            num_workers: Union[int, str] = 0,
            collate_fn: Optional[Callable[[List[Any]], Any]] = None,
            pin_memory: bool = False,
            drop_last: bool = False,
            timeout: float = 0,
            worker_init_fn: Optional[Callable[[int], None]] = None,
            multiprocessing_context: Any = None,
            generator: Optional[torch.Generator] = None,
            *,
            prefetch_factor: Optional[int] = None,
            persistent_workers: bool = False,
            pin_memory_device: str = "",
            in_order: bool = True,
            allow_gpu_in_workers: bool = False,
            slot_bytes: Optional[int] = None,
            held_batches: int = 4,
            reuse_workers: bool = True,
            hang_timeout: Optional[float] = 300.0,
            max_worker_restarts: int = 0,
            device: Optional[Any] = None,
        ) -> None: ...
    else:
        def __init__(
            self,
            *args: Any,
            allow_gpu_in_workers: bool = False,
            slot_bytes: Optional[int] = None,
            held_batches: int = 4,
            reuse_workers: bool = True,
            hang_timeout: Optional[float] = 300.0,
            max_worker_restarts: int = 0,
            device: Optional[Any] = None,
            **kwargs: Any,
        ) -> None:
            # DataLoader's arguments go to the installed DataLoader as given,
            # so its defaults apply and one it does not take fails there, in
            # its own words. Only num_workers="auto" is replaced first.
            args, kwargs, auto = _start_count_for_auto(args, kwargs)
            self._fastload_state = LoaderRuntime(LoaderOptions(  # STATE_ATTR
                allow_gpu_in_workers=allow_gpu_in_workers, slot_bytes=slot_bytes,
                held_batches=held_batches, reuse_workers=reuse_workers,
                hang_timeout=hang_timeout, max_worker_restarts=max_worker_restarts,
                device=device, auto_workers=auto,
            ))
            try:
                super().__init__(*args, **kwargs)
            except TypeError as e:
                _note_newer_arguments(e, kwargs)
                raise
            if self.num_workers > 0 and self.multiprocessing_context is None:
                # The fork server runs (and imports torch) while the script goes
                # on, and forks the first pool's zygote, which imports the
                # loader's modules meanwhile. The zygote ends with the loader if
                # no pool takes it; the server when the last loader is gone.
                state = self._fastload_state
                hide = state.options.hide_accelerators
                state.pools.lease_fork_server(hide)
                state.pools.prepare_zygote(hide, loader_modules(
                    self.dataset, self.sampler, self.batch_sampler, self.collate_fn,
                    self.worker_init_fn))
                weakref.finalize(self, state.pools.release)

    def _get_iterator(self) -> _BaseDataLoaderIter:
        state = self._fastload_state
        loaded = state.resume
        try:
            if self.num_workers == 0:
                return SingleProcessIter(self, state, self._stream_ops())
            self.check_worker_number_rationality()
            _fail_as_dataloader_iterator(self)
            return FastLoaderIter(self, state, stream_ops=self._stream_ops(),
                                  device_runtime=self._device_runtime)
        except BaseException:
            # An iter() that failed (Ctrl-C while its workers start, say)
            # leaves a state from load_state_dict() to the next one.
            if state.resume is None:
                state.resume = loaded
            raise

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader's current iterator is, to resume there later.

        Call it between batches; give the result to :meth:`load_state_dict`
        of a new loader made with the same arguments, before its ``iter()``:
        that iterator continues with the next batch the saved one would have
        delivered, with the same values (sampler order, worker randomness,
        IterableDataset replicas), and later epochs are those of the
        uninterrupted run. Plain data, kilobytes in size: it goes through
        ``torch.save`` and ``torch.load(weights_only=True)``. See the README,
        "Resuming mid-epoch", for what is and is not exact.
        """
        facts = resume_format.loader_facts(self)
        ref = self._fastload_state.live_iterator
        it = ref() if ref is not None else None
        if it is None:
            return {**facts, "position": None, "base_seed": None, "workers": None}
        return {**facts, **it.resume_state()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Make the next ``iter()`` continue from ``state_dict`` (see
        :meth:`state_dict`). Raises ValueError if it was saved by another
        fastload version or for a loader with another ``num_workers``,
        ``batch_size``, ``drop_last``, dataset kind or length, or
        ``persistent_workers``.

        Also takes the state dict torchdata's ``StatefulDataLoader`` writes
        for a map-style dataset: its position and sampler order (for a
        shuffled order, give this loader a ``generator``); see the README.
        """
        if resume_format.is_stateful_dataloader_state(state_dict):
            state_dict = resume_format.from_stateful_dataloader(state_dict, self)
        resume_format.check_compatible(state_dict, resume_format.loader_facts(self))
        self._fastload_state.resume = state_dict
        if self._iterator is not None:  # a persistent iterator starts anew from the state
            self._iterator = None

    def stats(self) -> Optional[LoaderStats]:
        """How the epoch in progress is going (or how the last one went,
        between epochs): how long the training loop waited for batches, how
        long workers took to make them, how busy each worker was. None
        before the first ``iter()``. See :class:`fastload.LoaderStats`."""
        return stats(self)

    def _device_runtime(self, device_type: Optional[str]) -> Optional[DeviceRuntime]:
        """The runtime that can register the ring as pinned memory, if any."""
        return self._fastload_state.device_runtime(device_type)

    def _stream_ops(self) -> Optional[StreamOps]:
        """Stream operations for device prefetch; None when there is nothing to do."""
        return self._fastload_state.stream_ops()


def _signature(init: Callable[..., None]) -> inspect.Signature:
    """``FastLoader.__init__``'s signature as callers see it: the installed
    DataLoader's parameters (names, kinds, defaults), then fastload's
    keyword-only options, taken from ``init``."""
    dataloader = inspect.signature(DataLoader.__init__)
    theirs = list(dataloader.parameters.values())
    ours = [p for p in inspect.signature(init).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]
    tail = [p for p in theirs if p.kind is inspect.Parameter.VAR_KEYWORD]
    head = [p.replace(annotation="int | str") if p.name == "num_workers" else p  # or "auto"
            for p in theirs if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature(head + ours + tail, return_annotation=dataloader.return_annotation)


FastLoader.__init__.__signature__ = _signature(FastLoader.__init__)  # type: ignore[attr-defined]


# DataLoader arguments newer than the oldest torch fastload supports, and the
# torch release that brought each.
_NEWER_ARGUMENTS = {"in_order": "2.6"}


def _note_newer_arguments(error: TypeError, kwargs: Dict[str, Any]) -> None:
    """DataLoader refused an argument of a newer torch than the installed
    one: its TypeError (unchanged) gets a note naming the torch it needs."""
    have = inspect.signature(DataLoader.__init__).parameters
    for name, since in _NEWER_ARGUMENTS.items():
        if name in kwargs and name not in have:
            add_note(error, f"fastload: DataLoader takes {name}= from torch {since} on; "
                            f"this is torch {torch.__version__}")


def _start_count_for_auto(args: Tuple[Any, ...], kwargs: Dict[str, Any]
                          ) -> Tuple[Tuple[Any, ...], Dict[str, Any], bool]:
    """DataLoader's arguments as given, with ``num_workers="auto"`` replaced
    by the count to start from; and whether it was "auto"."""
    try:
        bound = inspect.signature(DataLoader.__init__).bind(None, *args, **kwargs)
    except TypeError:
        return args, kwargs, False  # DataLoader refuses them in its own words
    if not _is_auto(bound.arguments.get("num_workers")):
        return args, kwargs, False
    bound.arguments["num_workers"] = initial_workers(cores_available())
    return bound.args[1:], bound.kwargs, True


def stats(loader: DataLoader) -> Optional[LoaderStats]:
    """The figures of ``loader``'s epoch in progress (or its last one): a
    :class:`FastLoader`, or any DataLoader that ran on fastload under
    :func:`fastload.install`. None before its first ``iter()``.

    Raises ValueError for a loader fastload does not run: a DataLoader
    outside ``install()``, or one with ``num_workers=0`` under it (that
    stays DataLoader's own).
    """
    state = vars(loader).get(STATE_ATTR) if hasattr(loader, "__dict__") else None
    if state is None:
        raise ValueError(
            f"{type(loader).__qualname__} does not run on fastload: stats() needs a "
            "FastLoader, or a DataLoader with num_workers > 0 under fastload.install()")
    meter = state.meter
    return None if meter.epoch < 0 else meter.stats()


def loader_view(loader: DataLoader) -> LoaderView:
    """``loader`` as :func:`fastload.debug.debug_view` shows it: its state (a
    FastLoader has one from the start, a DataLoader under fastload.install()
    from its first iterator on) and the iterator it keeps for
    ``persistent_workers`` (DataLoader's ``_iterator``)."""
    it = getattr(loader, "_iterator", None)
    kept = it.debug_view() if isinstance(it, FastLoaderIter) else None
    state = vars(loader).get(STATE_ATTR)
    return state.debug_view(kept) if state is not None else LoaderView(None, None, kept)


def _is_auto(num_workers: Any) -> bool:
    """``num_workers="auto"``; any other string goes to DataLoader, which
    refuses it in its own words."""
    return isinstance(num_workers, str) and num_workers == AUTO


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _draws_len_first(loader: DataLoader) -> bool:
    """Whether the loader's first index comes from ``len(dataset)``: one of
    torch's default samplers over the dataset, batched or not."""
    sampler = loader._index_sampler
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    return type(sampler) in (SequentialSampler, RandomSampler) and sampler.data_source is loader.dataset


def _dataloader_start_method(loader: DataLoader) -> Optional[str]:
    """The start method DataLoader's workers would use (None: not known)."""
    ctx = loader.multiprocessing_context
    if ctx is None:
        # DataLoader's default: torch.multiprocessing's, the platform's first.
        return (torch.multiprocessing.get_start_method(allow_none=True)
                or multiprocessing.get_all_start_methods()[0])
    try:
        return ctx.get_start_method()
    except Exception:  # a user's context object; DataLoader's checks passed it
        return None


def _fail_as_dataloader_iterator(loader: DataLoader) -> None:
    """Raise what DataLoader's multi-process iterator would, where fastload
    would fail elsewhere, before anything is pickled or started.

    DataLoader's constructor lets these through and its iterator fails on
    them; fastload's iterator would fail first on something of its own:

    * a worker count or ``prefetch_factor`` that is not an integer
      (``num_workers=2.0``): DataLoader fails on ``range(num_workers)`` as it
      starts its workers, or on ``range(prefetch_factor * num_workers)`` as it
      primes them (``TypeError: 'float' object cannot be interpreted as an
      integer``); fastload would hand them to its ring's extension.
    * a dataset that is a bare iterator (a generator, ``map(...)``) with a
      default sampler: DataLoader's forked workers get it without pickling,
      and its first index fails on ``len(dataset)``; fastload would fail
      pickling the dataset for its workers.

    DataLoader meets these after its base set-up (pin-memory warnings, the
    sampler's iterator, the seed drawn from ``generator``), its
    ``num_workers > 0`` check (repeated here: a count set after construction
    could be negative) and its ``prefetch_factor > 0`` check (the iterator's
    own, so nothing is done here then). The set-up is repeated here first,
    so the warnings, the generator's state and, with several wrong arguments,
    the error are DataLoader's too.
    """
    num_workers, prefetch_factor = loader.num_workers, loader.prefetch_factor
    if not num_workers > 0:
        _BaseDataLoaderIter(loader)
        raise AssertionError("num_workers must be greater than 0 for multi-process loading")
    try:
        if not prefetch_factor > 0:
            return
    except TypeError:
        return  # the iterator's own check raises DataLoader's error for it
    dataset = loader.dataset
    unsized_iterator = (  # a generator, a map object, an open file...
        hasattr(type(dataset), "__next__") and not isinstance(dataset, Dataset)
        and not hasattr(dataset, "__len__") and _draws_len_first(loader)
        and _dataloader_start_method(loader) == "fork"
    )
    if _is_index(num_workers) and _is_index(prefetch_factor * num_workers) and not unsized_iterator:
        return
    it = _BaseDataLoaderIter(loader)
    range(num_workers)  # DataLoader's worker start
    range(prefetch_factor * num_workers)  # DataLoader's priming, which then draws an index
    it._reset(loader, first_iter=True)
    it._next_index()
