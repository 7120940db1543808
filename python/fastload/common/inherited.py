"""The training process's settings that workers take on with each session.

A worker forked by DataLoader from the training process inherits its
environment, torch's global modes and the ``warnings`` filters as they are at
``iter()``; a spawned one gets those the script's top level sets, which it
re-runs. A worker forked from the zygote would have the zygote's instead:
the environment as it was when the loader was constructed, torch's defaults
and Python's default filters. It would make float32 tensors in a float64
script, track gradients where the script turned them off, miss an
environment variable set after the loader was built, and print warnings the
script silenced.

So each session carries a :class:`InheritedSettings` captured at ``iter()``, at
the head of the session's pickle. Unpickling it applies the environment and
torch's modes before the dataset that follows it is unpickled (its
``__setstate__`` may read them): in the zygote that preloads the session,
whose workers then inherit them, or in a worker that unpickles the session
itself. The ``warnings`` filters are applied by the worker once it has the
dataset (:meth:`InheritedSettings.apply_filters`), and only those whose warning
class is already imported there: a filter naming a class of a package the
worker never imported (Lightning's and SciPy's install some) cannot match
anything it raises, and importing that package just to hold the filter would
cost every worker the import, and the zygote its safety (such imports start
threads).

Left as they are: the accelerator variables (hidden or not by the loader,
see ``fastload.launching.spawn``), the ``logging`` configuration (handlers
hold streams and files, which a spawned DataLoader worker does not get
either) and module globals the script changed at run time.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

from .protocol import ACCELERATOR_ENV

# An entry of warnings.filters, its category as (module, qualified name).
_Filter = Tuple[str, Any, Tuple[str, str], Any, int]


class InheritedSettings:
    """The environment, torch's global modes (default dtype, grad mode,
    deterministic algorithms, float32 matmul precision) and the ``warnings``
    filters of a process, taken by :meth:`capture` (see the module's
    docstring). Unpickling one applies all but the filters."""

    def __init__(self, environ: Dict[str, str], torch_modes: Dict[str, Any],
                 warning_filters: List[_Filter]) -> None:
        self.environ = environ
        self.torch_modes = torch_modes
        self.warning_filters = warning_filters

    @classmethod
    def capture(cls) -> "InheritedSettings":
        """This process's state now."""
        import torch

        modes = {
            "default_dtype": torch.get_default_dtype(),
            "grad_enabled": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
        filters = [(action, message, (category.__module__, category.__qualname__), module, lineno)
                   for action, message, category, module, lineno in warnings.filters]
        return cls(dict(os.environ), modes, filters)

    def __reduce__(self) -> Any:
        return _apply, (self.environ, self.torch_modes, self.warning_filters)

    def apply(self) -> None:
        """Make this process's environment and torch's modes the captured ones."""
        import torch

        for key in [k for k in os.environ if k not in self.environ and k not in ACCELERATOR_ENV]:
            del os.environ[key]
        for key, value in self.environ.items():
            if key not in ACCELERATOR_ENV and os.environ.get(key) != value:
                os.environ[key] = value
        # Each set only where it differs (a setter may cost more than it
        # looks; see set_deterministic).
        modes = self.torch_modes
        if torch.get_default_dtype() != modes["default_dtype"]:
            torch.set_default_dtype(modes["default_dtype"])
        if torch.is_grad_enabled() != modes["grad_enabled"]:
            torch.set_grad_enabled(modes["grad_enabled"])  # this thread's: the one that fetches
        if (torch.are_deterministic_algorithms_enabled() != modes["deterministic"]
                or torch.is_deterministic_algorithms_warn_only_enabled()
                != modes["deterministic_warn_only"]):
            set_deterministic(modes["deterministic"], modes["deterministic_warn_only"])
        if torch.get_float32_matmul_precision() != modes["float32_matmul_precision"]:
            torch.set_float32_matmul_precision(modes["float32_matmul_precision"])

    def apply_filters(self) -> None:
        """Make this process's ``warnings`` filters the captured ones whose
        warning class is imported here (see the module's docstring)."""
        filters = []
        for action, message, (module_name, qualname), module, lineno in self.warning_filters:
            category = _imported(module_name, qualname)
            if category is not None:
                filters.append((action, message, category, module, lineno))
        # resetwarnings() also voids every module's record of the warnings
        # it has shown, so the filters set next decide from the next warning.
        warnings.resetwarnings()
        warnings.filters[:] = filters


def set_deterministic(mode: bool, warn_only: bool) -> None:
    """What ``torch.use_deterministic_algorithms(mode, warn_only=warn_only)``
    does, without importing ``torch._inductor`` where nothing has.

    The public function sets two things: the flag every operator reads, and
    the ``deterministic`` setting of inductor's config, read only when
    ``torch.compile`` builds kernels. To set the second it imports
    ``torch._inductor`` (dynamo and sympy with it): 1-1.5 s and ~70 MB on
    first call, paid by the zygote that preloads a session or by each spawned
    worker, and with it the first batch of every loader of a script that
    asked for deterministic algorithms (Ultralytics does by default,
    Lightning and Hugging Face on request). A worker that never compiles
    never reads that config, so the flag is set directly, and the config
    only where inductor is already loaded. A worker that imports inductor
    later starts from its own default (``TORCHINDUCTOR_DETERMINISTIC``), not
    the training process's setting.

    ``torch._C._set_deterministic_algorithms`` is private; the public
    function is the fallback where it is missing, and
    tests/test_inherited.py pins that both leave the same state."""
    import torch

    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        return
    setter(mode, warn_only=warn_only)
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.deterministic = mode  # type: ignore[attr-defined]


def _apply(environ: Dict[str, str], torch_modes: Dict[str, Any],
           warning_filters: List[_Filter]) -> InheritedSettings:
    state = InheritedSettings(environ, torch_modes, warning_filters)
    state.apply()
    return state


def _imported(module_name: str, qualname: str) -> Optional[type]:
    """The class ``module_name.qualname`` if its module is imported here."""
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else None
