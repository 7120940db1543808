"""A dataset whose module starts a thread when it is imported (a library
that starts a background thread at import). Module level so that workers
and zygotes import it by name."""

from __future__ import annotations

import threading
import time

import torch
from torch.utils.data import Dataset

_THREAD = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
_THREAD.start()


class StartsAThread(Dataset):
    """``dataset[i] == torch.tensor(i)``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)
