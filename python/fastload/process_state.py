"""The training process's settings that workers take on with each session.

A worker forked by DataLoader from the training process inherits its
environment, torch's default dtype and the ``warnings`` filters as they are
at ``iter()``. A worker forked from the zygote inherits the zygote's instead:
the environment as it was when the loader was constructed, float32, and
Python's default filters. Such a worker would make float32 tensors in a
float64 script, miss an environment variable set after the loader was built,
and print warnings the script silenced.

So each session carries a :class:`ProcessState` captured at ``iter()``, at
the head of the session's pickle. Unpickling it applies it, before the
dataset that follows it is unpickled (its ``__setstate__`` may read any of
these): in the zygote that preloads the session, which the workers forked
from it then inherit, or in a worker that unpickles the session itself.

Left as they are: the accelerator variables (hidden or not by the loader,
see ``fastload.wire``), the ``logging`` configuration (handlers hold streams
and files, which a spawned DataLoader worker does not get either) and module
globals the script changed at run time.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Dict, List, Tuple

from . import _pickling
from .wire import ACCELERATOR_ENV

log = logging.getLogger("fastload")

_Filter = Tuple[Any, ...]  # an entry of warnings.filters


class ProcessState:
    """The environment, torch's default dtype and the ``warnings`` filters of
    a process, taken by :meth:`capture` (see the module's docstring).
    Unpickling one applies it to the process that unpickles it."""

    def __init__(self, environ: Dict[str, str], default_dtype: Any,
                 warning_filters: List[_Filter]) -> None:
        self.environ = environ
        self.default_dtype = default_dtype
        self.warning_filters = warning_filters

    @classmethod
    def capture(cls) -> "ProcessState":
        """This process's state now."""
        import torch

        return cls(dict(os.environ), torch.get_default_dtype(), _sendable(warnings.filters))

    def __reduce__(self) -> Any:
        return _apply, (self.environ, self.default_dtype, self.warning_filters)

    def apply(self) -> None:
        """Make this process's state the captured one."""
        import torch

        for key in [k for k in os.environ if k not in self.environ and k not in ACCELERATOR_ENV]:
            del os.environ[key]
        for key, value in self.environ.items():
            if key not in ACCELERATOR_ENV and os.environ.get(key) != value:
                os.environ[key] = value
        torch.set_default_dtype(self.default_dtype)
        # resetwarnings() also voids every module's record of the warnings
        # it has shown, so the filters set next decide from the next warning.
        warnings.resetwarnings()
        warnings.filters[:] = self.warning_filters


def _apply(environ: Dict[str, str], default_dtype: Any,
           warning_filters: List[_Filter]) -> ProcessState:
    state = ProcessState(environ, default_dtype, warning_filters)
    state.apply()
    return state


def _sendable(filters: List[_Filter]) -> List[_Filter]:
    """The filters a worker can be sent. One whose category cannot be
    pickled (a class defined inside a function, say) stays behind, with a
    debug message: a filter is a nicety, never a reason to fail the epoch."""
    out = []
    for entry in filters:
        try:
            _pickling.dumps(entry)
        except Exception as e:  # noqa: BLE001 - pickling errors come as many types
            log.debug("fastload: the warnings filter %r stays in this process: %s", entry, e)
            continue
        out.append(entry)
    return out
