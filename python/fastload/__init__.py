"""fastload: a drop-in replacement for torch.utils.data.DataLoader.

``from fastload import FastLoader as DataLoader`` — same arguments, same
batches; workers are spawn-started, never touch a GPU, and write batches
into a shared-memory ring that the main process reads without copying.
"""

from .errors import WorkerHangError
from .loader import FastLoader

__all__ = ["FastLoader", "WorkerHangError", "__version__"]
__version__ = "0.1.0"
