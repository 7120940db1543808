"""fastload: a drop-in replacement for torch.utils.data.DataLoader.

``from fastload import FastLoader as DataLoader`` — same arguments, same
batches; workers are spawn-started, never touch a GPU, and write batches
into a shared-memory ring that the main process reads without copying.

For loaders that libraries build, ``fastload.install()`` (or
``python -m fastload run script.py``, or ``FASTLOAD_INSTALL=1`` in the
environment) runs every DataLoader with workers on fastload.
"""

from .errors import WorkerHangError
from .install import install, installed, uninstall
from .launching.references import SharedSequence, share
from .loader import FastLoader, stats
from .loader_stats import LoaderStats, Percentiles, SlowBatch

__all__ = ["FastLoader", "LoaderStats", "Percentiles", "SharedSequence", "SlowBatch",
           "WorkerHangError", "install", "installed", "share", "stats", "uninstall", "__version__"]
# The one place the version is written: pyproject.toml reads it from here
# ([tool.scikit-build.metadata.version]) for the wheel's metadata.
__version__ = "0.1.0"
