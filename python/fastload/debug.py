"""A read-only look inside a loader or its iterator, for tests and diagnostics.

``debug_view(obj)`` returns a snapshot of fastload's state behind a loader
or an iterator: worker pids, the zygote, the ring, the warm pool kept
between epochs, the options the iterator runs with. It is what fastload's
own tests check, and what to print when a loader misbehaves::

    from fastload.debug import debug_view
    it = iter(loader)
    print(debug_view(it))          # IteratorView(num_workers=2, pool=PoolView(...), ...)
    debug_view(loader).idle_pool   # the warm pool kept after an epoch, or None

Not part of the DataLoader API: the fields follow fastload's internals and
may change between versions. A view is taken when ``debug_view`` is called
(call it again to see later changes) and holds no reference to the loader,
the iterator or their pool, so keeping one never keeps workers alive. It
changes nothing: nothing in it starts, stops or signals a process.

Each object renders its own view (see :mod:`fastload.common.debug_views`); this
module only picks the one that ``obj`` asks for.
"""

from __future__ import annotations

from typing import Any, overload

from torch.utils.data import DataLoader

from .common.debug_views import IteratorView, LoaderView, PoolView, RingView
from .iterator.multi_process import FastLoaderIter
from .loader import loader_view

__all__ = ["debug_view", "IteratorView", "LoaderView", "PoolView", "RingView"]


@overload
def debug_view(obj: FastLoaderIter) -> IteratorView: ...
@overload
def debug_view(obj: DataLoader) -> LoaderView: ...
def debug_view(obj: Any) -> Any:
    """A snapshot of fastload's state behind ``obj``.

    ``obj`` is a loader (a :class:`~fastload.FastLoader`, or a DataLoader
    under ``fastload.install()``): returns a :class:`LoaderView`. Or an
    iterator of one with workers: returns an :class:`IteratorView`. Raises
    TypeError for anything else (a ``num_workers=0`` iterator, or one of
    torch's own).
    """
    if isinstance(obj, FastLoaderIter):
        return obj.debug_view()
    if isinstance(obj, DataLoader):
        return loader_view(obj)
    raise TypeError(f"debug_view() takes a loader or a fastload iterator with workers, "
                    f"not {type(obj).__name__}")
