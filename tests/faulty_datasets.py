"""Datasets, collate functions and init functions that misbehave on purpose.

Module level so that spawned workers can import them by reference (pytest
puts ``tests/`` on ``sys.path`` and spawn hands ``sys.path`` to the child).
Every dataset returns ``torch.tensor(i)`` for a well-behaved index ``i`` so
batches are easy to compare with DataLoader's.

The destructive behaviours (killing, exiting) only fire inside a worker
process (``get_worker_info() is not None``) so that an accidental
``num_workers=0`` run can never take the test process down.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import Dataset, get_worker_info

ACCEL_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
UNSET = "<unset>"


def _in_worker() -> bool:
    return get_worker_info() is not None


# ---------------------------------------------------------------------------
# exceptions


class Weird(Exception):
    """An exception whose constructor cannot be called with a single message."""

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a, b)
        self.a = a
        self.b = b

    def __str__(self) -> str:
        return f"weird failure a={self.a!r} b={self.b!r}"


def make_error(kind: str, i: int) -> BaseException:
    if kind == "value":
        return ValueError(f"bad sample {i}")
    if kind == "key":
        return KeyError(f"missing key for sample {i}")
    if kind == "weird":
        return Weird(f"weird-a-{i}", i)
    if kind == "index":
        return IndexError(f"index trouble at sample {i}")
    raise AssertionError(kind)


class RaiseOn(Dataset):
    """``dataset[i]`` raises ``make_error(errors[i], i)`` for the listed indices."""

    def __init__(self, n: int, errors: Dict[int, str]) -> None:
        self.n = n
        self.errors = dict(errors)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        kind = self.errors.get(i)
        if kind is not None:
            raise make_error(kind, i)
        return torch.tensor(i)


class Plain(Dataset):
    """``dataset[i] == torch.tensor(i)``, optionally slowly."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(i)


class BigRows(Dataset):
    """Rows of ``width`` int64 values, all equal to the index (easy to verify)."""

    def __init__(self, n: int, width: int = 4096) -> None:
        self.n = n
        self.width = width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.width,), i, dtype=torch.int64)


# ---------------------------------------------------------------------------
# collate / worker_init_fn


class RaisingCollate:
    """Default collate, except that a batch containing ``bad`` raises."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[torch.Tensor]) -> torch.Tensor:
        if any(int(x) == self.bad for x in batch):
            raise ValueError(f"collate refuses batch with {self.bad}")
        return torch.stack(batch)


def failing_worker_init(worker_id: int) -> None:
    raise RuntimeError(f"worker_init_fn failed in worker {worker_id}")


class LockInBatch:
    """A collate_fn that keeps the samples in a list; a batch containing ``bad`` also gets a lock."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"data": list(batch)}
        if any(isinstance(x, torch.Tensor) and int(x) == self.bad for x in batch):
            out["lock"] = threading.Lock()
        return out


class GeneratorOn(Dataset):
    """The sample for index ``bad`` is a generator (use a collate_fn that keeps it)."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            return (x for x in range(3))
        return torch.tensor(i)


# ---------------------------------------------------------------------------
# datasets that take their worker down


class KillSelfOn(Dataset):
    """Worker process kills itself with ``sig`` when asked for index ``bad``."""

    def __init__(self, n: int, bad: int, sig: int = signal.SIGKILL, delay: float = 0.0) -> None:
        self.n = n
        self.bad = bad
        self.sig = sig
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        if i == self.bad and _in_worker():
            os.kill(os.getpid(), self.sig)
            time.sleep(30)  # never reached for SIGKILL
        return torch.tensor(i)


class HardExitOn(Dataset):
    """Worker calls ``os._exit(code)`` on index ``bad``."""

    def __init__(self, n: int, bad: int, code: int) -> None:
        self.n = n
        self.bad = bad
        self.code = code

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and _in_worker():
            os._exit(self.code)
        return torch.tensor(i)


class SysExitOn(Dataset):
    """Worker raises SystemExit (``sys.exit(code)``) on index ``bad``."""

    def __init__(self, n: int, bad: int, code: int = 0) -> None:
        self.n = n
        self.bad = bad
        self.code = code

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and _in_worker():
            sys.exit(self.code)
        return torch.tensor(i)


class SleepOn(Dataset):
    """``dataset[bad]`` sleeps ``seconds`` (in a worker) before returning."""

    def __init__(self, n: int, bad: int, seconds: float) -> None:
        self.n = n
        self.bad = bad
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and _in_worker():
            time.sleep(self.seconds)
        return torch.tensor(i)


# ---------------------------------------------------------------------------
# datasets that cannot be sent to a worker


class HoldsLock(Plain):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


class HoldsSocket(Plain):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.sock: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Empty(Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int) -> torch.Tensor:  # pragma: no cover - never called
        raise IndexError(i)


# ---------------------------------------------------------------------------
# probing the worker's environment


class EnvProbe(Dataset):
    """Each sample reports what the worker process sees."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        info = get_worker_info()
        out: Dict[str, Any] = {var: os.environ.get(var, UNSET) for var in ACCEL_VARS}
        out.update(
            index=i,
            pid=os.getpid(),
            threads=torch.get_num_threads(),
            has_info=info is not None,
            worker_id=-1 if info is None else info.id,
            num_workers=-1 if info is None else info.num_workers,
            seed=-1 if info is None else info.seed,
            info_dataset_is_probe=info is not None and isinstance(info.dataset, EnvProbe),
        )
        return out


# ---------------------------------------------------------------------------
# helpers for the tests themselves (main process only)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a running (non-zombie) process."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_pids_gone(pids: Any, timeout: float = 10.0) -> List[int]:
    """Poll until none of ``pids`` runs; returns the survivors (empty on success)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def outcomes(loader: Any, max_steps: int = 100,
             describe: Optional[Callable[[BaseException], Any]] = None) -> List[tuple]:
    """Iterate ``loader`` like a training loop that survives errors.

    Returns ``("ok", batch)`` / ``("err", type, message, detail)`` per
    ``next()`` call until StopIteration; ``detail`` is ``describe(exc)``, by
    default the types of the exception's args. Exceptions are not kept
    (their tracebacks would keep the iterator alive).
    """
    out: List[tuple] = []
    it = iter(loader)
    try:
        for _ in range(max_steps):
            try:
                batch = next(it)
            except StopIteration:
                return out
            except Exception as e:  # noqa: BLE001 - recorded for comparison
                detail = describe(e) if describe else tuple(type(a).__name__ for a in e.args)
                out.append(("err", type(e), str(e), detail))
                del e
                continue
            out.append(("ok", batch.tolist() if isinstance(batch, torch.Tensor) else batch))
            del batch
        raise AssertionError(f"no StopIteration after {max_steps} steps: {out}")
    finally:
        del it


def shape_of(results: List[tuple]) -> List[Any]:
    """The comparable skeleton of ``outcomes()``: batches, and exception types."""
    return [r[1] for r in results]


class FailOnceOn(Dataset):
    """The first time any worker loads index ``bad``, it dies (``how='kill'``:
    SIGKILL) or hangs (``how='hang'``: sleeps a minute). A marker file makes it
    happen once across processes, so a restarted worker gets through."""

    def __init__(self, n: int, bad: int, marker: str, how: str = "kill") -> None:
        self.n = n
        self.bad = bad
        self.marker = marker
        self.how = how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and _in_worker():
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
        return torch.full((3,), float(i))


# ---------------------------------------------------------------------------
# datasets whose unpickling does something (in the zygote that preloads them)


class UnpicklesWith(Dataset):
    """``dataset[i] == tensor([i, u])``, ``u`` 1 when this process unpickled
    the dataset itself, 0 when it inherited it (from a zygote that did).

    Unpickling does ``how`` in the zygote, i.e. in a process whose parent is
    the one that pickled it (``everywhere``: in workers too): ``"thread"``
    starts a thread that lives on, ``"file"`` opens this file and keeps it,
    ``"sleep"`` sleeps ``seconds``, ``"raise"`` raises ValueError, ``""``
    nothing.
    """

    def __init__(self, n: int, how: str = "", everywhere: bool = False,
                 seconds: float = 0.0) -> None:
        self.n = n
        self.how = how
        self.everywhere = everywhere
        self.seconds = seconds
        self.owner = os.getpid()
        self.unpickled_in = os.getpid()
        self.kept: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "kept": None}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.unpickled_in = os.getpid()
        if not self.everywhere and os.getppid() != self.owner:
            return
        if self.how == "thread":
            self.kept = threading.Thread(target=time.sleep, args=(3600,), daemon=True)
            self.kept.start()
        elif self.how == "file":
            self.kept = open(__file__, "rb")
        elif self.how == "sleep":
            time.sleep(self.seconds)
        elif self.how == "raise":
            raise ValueError("this dataset refuses to be unpickled")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(self.unpickled_in == os.getpid())])
