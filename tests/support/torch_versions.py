"""What the installed torch's DataLoader has, for tests that run on every torch
fastload supports (2.1 to the newest; ``.ci/torch-matrix``).

The tests compare FastLoader against the installed ``DataLoader``; these
helpers only say which of DataLoader's arguments and behaviours this torch
has, so that a test asks for ``in_order`` only where DataLoader takes it and
expects a warning only where DataLoader gives it.
"""

from __future__ import annotations

import inspect
import os
import pickle
import warnings
import pytest
import torch
from torch.utils.data import DataLoader

#: DataLoader's parameters in this torch (``in_order`` arrived in torch 2.6).
DATALOADER_PARAMS = frozenset(inspect.signature(DataLoader.__init__).parameters)

#: Whether DataLoader takes ``in_order``.
HAS_IN_ORDER = "in_order" in DATALOADER_PARAMS

#: Whether torch has ``torch.accelerator`` (not torch 2.1); DataLoader's
#: pin-memory warnings then name "accelerator".
HAS_ACCELERATOR_API = hasattr(torch, "accelerator")


#: For a test of ``in_order=False``: skipped where DataLoader lacks it.
needs_in_order = pytest.mark.skipif(
    not HAS_IN_ORDER, reason=f"DataLoader has no in_order before torch 2.6 (this is {torch.__version__})")


def _generator_pickles() -> bool:
    try:
        pickle.dumps(torch.Generator())
    except TypeError:
        return False
    return True


#: Whether a ``torch.Generator`` can be pickled or deep-copied (not in torch 2.1).
GENERATOR_PICKLES = _generator_pickles()


def _nested_tensors_pickle() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        try:
            pickle.dumps(torch.nested.nested_tensor([torch.zeros(1)]))
        except RuntimeError:
            return False
    return True


#: Whether nested tensors can be pickled, so sent between processes (not in
#: torch 2.1, where DataLoader's workers then lose the batch and it hangs).
NESTED_TENSORS_PICKLE = _nested_tensors_pickle()

#: For a test of nested tensors in batches: skipped where torch cannot send them.
needs_nested_pickling = pytest.mark.skipif(
    not NESTED_TENSORS_PICKLE,
    reason=f"torch {torch.__version__} cannot pickle nested tensors (DataLoader's workers hang on them)")


def accelerator_available() -> bool:
    """What DataLoader asks before pinning: an accelerator (where torch has the API) or CUDA."""
    if HAS_ACCELERATOR_API:
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def cpu_count() -> int:
    """The CPUs DataLoader's worker-count check counts (this process's affinity)."""
    counter = getattr(torch._utils, "cpu_count", None)  # not in torch 2.1
    if counter is not None:
        return counter() or 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
