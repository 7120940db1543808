"""``FASTLOAD_INSTALL=1``: ``fastload.install()`` in every Python process.

The wheel puts ``fastload_autoinstall.pth`` at the root of site-packages;
``site`` runs its one line at every interpreter start-up. That line reads the
environment variable and, only when it is set, imports this module and calls
:func:`activate`. Unset, it costs one dictionary lookup: nothing is imported.

This module is top-level, not ``fastload._autoinstall``: importing any
submodule of ``fastload`` runs ``fastload/__init__``, which imports torch,
and a process that never uses torch must not pay for that. Nor is fastload
imported here: :func:`activate` leaves a finder on ``sys.meta_path`` that
waits for torch's DataLoader module, and installs fastload once torch has
finished importing (torch imports ``torch.utils.data.dataloader`` from its
own ``__init__``; installing in the middle of that would import fastload
against a half-initialised torch), or once fastload has, when importing
fastload is what imported torch. If torch is already imported, it installs
at once.

Values that turn it on: anything but empty, ``0``, ``false``, ``no``, ``off``.
Install options are FastLoader's defaults.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

__all__ = ["ENV_VAR", "enabled", "activate"]

ENV_VAR = "FASTLOAD_INSTALL"
_TORCH = "torch"
_DATALOADER = "torch.utils.data.dataloader"
# Packages whose __init__ must have finished before fastload.install() runs.
_PACKAGES = (_TORCH, "fastload")
_WATCHED = (*_PACKAGES, _DATALOADER)

_finder: Optional["_ImportWatcher"] = None
_executing = {name: 0 for name in _PACKAGES}  # > 0 while that __init__ runs
_done = False


def enabled() -> bool:
    """Whether ``FASTLOAD_INSTALL`` asks for fastload in this process."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def activate() -> None:
    """Install fastload now if torch is imported, else as soon as it is.

    Does nothing unless :func:`enabled`; calling it again does nothing.
    """
    global _finder
    if not enabled() or _done or _finder is not None:
        return
    torch = sys.modules.get(_TORCH)
    if torch is not None and not getattr(getattr(torch, "__spec__", None), "_initializing", False):
        _install()
        return
    _finder = _ImportWatcher()
    sys.meta_path.insert(0, _finder)


def _install() -> None:
    """fastload.install(), once; a failure is reported, never raised into
    the import that triggered it."""
    global _done, _finder
    if _done:
        return
    _done = True
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None
    try:
        from fastload.install import install_for_process_tree

        install_for_process_tree()
    except Exception:
        import logging

        logging.getLogger("fastload").warning(
            "fastload: %s is set but fastload.install() failed", ENV_VAR, exc_info=True)


def _after_import() -> None:
    if _DATALOADER in sys.modules and not any(_executing.values()):
        _install()


class _ImportWatcher:
    """A ``sys.meta_path`` finder that finds nothing itself: for torch, its
    DataLoader module and fastload it takes the spec the other finders give
    and wraps its loader, to act once the module has executed."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Any:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _NotifyingLoader(spec.loader, fullname)
                return spec
        return None


class _NotifyingLoader:
    """Runs the real loader, then :func:`_after_import`. The module sees
    the real loader as its ``__loader__`` and ``__spec__.loader``."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        package = self._name in _executing
        if package:
            _executing[self._name] += 1
        try:
            self._loader.exec_module(module)
        finally:
            if package:
                _executing[self._name] -= 1
        _after_import()

    def __getattr__(self, name: str) -> Any:  # get_code, get_resource_reader, ...
        return getattr(self._loader, name)
