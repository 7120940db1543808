"""A dataset whose module is slow to import (as one importing a big library
would be), and that leaves a mark of every process that imports it.

On import it sleeps :data:`IMPORT_S` and creates ``imported-<pid>`` in the
directory named by ``FASTLOAD_TEST_IMPORT_MARKS`` (if set). Module level so
that workers and zygotes import it by name.
"""

from __future__ import annotations

import os
import time

from .datasets import Plain

IMPORT_S = 1.0

_marks = os.environ.get("FASTLOAD_TEST_IMPORT_MARKS")
if _marks:
    open(os.path.join(_marks, f"imported-{os.getpid()}"), "w").close()
time.sleep(IMPORT_S)


class SlowToImport(Plain):
    """:class:`support.datasets.Plain` (``dataset[i] == torch.tensor(i)``),
    defined here: unpickling it imports this module."""


def marks(directory: str) -> set:
    """The pids that imported this module, as marked in ``directory``."""
    return {int(name.split("-")[1]) for name in os.listdir(directory) if name.startswith("imported-")}
