"""fastload: a drop-in replacement for torch.utils.data.DataLoader.

``from fastload import FastLoader as DataLoader`` — same arguments, same
batches; workers are spawn-started, never touch a GPU, and write batches
into a shared-memory ring that the main process reads without copying.

For loaders that libraries build, ``fastload.install()`` (or
``python -m fastload run script.py``, or ``FASTLOAD_INSTALL=1`` in the
environment) runs every DataLoader with workers on fastload.

Importing fastload in a script starts its fork server (a fresh interpreter
that imports torch once, from which every loader's workers are forked) in
the background, so that torch's import there overlaps the script's own
set-up; the server lives until the process ends, or :func:`shutdown`
(``FASTLOAD_SERVER_AT_IMPORT=0`` leaves the start to the first loader).
"""

from .common.errors import WorkerHangError
from .install import install, installed, uninstall
from .launching.fork_server import shutdown
from .launching.fork_server import start_at_import as _start_at_import
from .launching.share import SharedSequence, share
from .loader import FastLoader, stats
from .stats.loader_stats import LoaderStats, Percentiles, SlowBatch

__all__ = ["FastLoader", "LoaderStats", "Percentiles", "SharedSequence", "SlowBatch",
           "WorkerHangError", "install", "installed", "share", "shutdown", "stats", "uninstall",
           "__version__"]
# The one place the version is written: pyproject.toml reads it from here
# ([tool.scikit-build.metadata.version]) for the wheel's metadata.
__version__ = "0.1.0"

_start_at_import()
