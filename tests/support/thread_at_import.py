"""A dataset whose module starts a thread when it is imported (a library
that starts a background thread at import). Module level so that workers
and zygotes import it by name."""

from __future__ import annotations

import threading
import time

from .datasets import Plain

_THREAD = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
_THREAD.start()


class StartsAThread(Plain):
    """:class:`support.datasets.Plain` (``dataset[i] == torch.tensor(i)``),
    defined here: unpickling it imports this module."""
