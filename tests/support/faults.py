"""Datasets, collate functions and worker_init_fns that misbehave on purpose.

* :class:`Misbehave` -- one dataset for "at index i, raise / kill the worker /
  exit / hang / return something odd".
* :class:`Pattern` -- the fault-injection suite's dataset: faults switched
  on and off by marker files, so a test decides when they land.
* :class:`Gate` -- samples from an index on wait until the test opens a gate
  (a stuck worker the test can release), and say who started each sample.
* :class:`Holds`, :class:`OddSample`, :class:`NoLoad`, :class:`NoDump` --
  what cannot be pickled to a worker, or back.
* :class:`UnpicklesWith` -- a dataset whose unpickling starts a thread,
  opens a file, sleeps or raises (in the zygote that preloads a session).
* collate functions that fail, a worker_init_fn that fails, a worker that
  floods stdout.

Destructive behaviours (killing, exiting, huge allocations) only happen in
a worker process (``get_worker_info() is not None``), so an accidental
``num_workers=0`` run can never take the test process down. Module level so
that workers unpickle them by reference (see ``support/__init__``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from .datasets import Plain

ABSURD_NUMEL = 1 << 50
"""Elements of an allocation no machine has (8 PiB of int64)."""


def in_worker() -> bool:
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
    """What ``Misbehave`` raises for sample ``i``: kind ``value``, ``key``,
    ``index`` or ``weird``."""
    if kind == "value":
        return ValueError(f"bad sample {i}")
    if kind == "key":
        return KeyError(f"missing key for sample {i}")
    if kind == "weird":
        return Weird(f"weird-a-{i}", i)
    if kind == "index":
        return IndexError(f"index trouble at sample {i}")
    raise AssertionError(kind)


class InjectedFault(ValueError):
    """What ``Pattern`` raises for an index the test marked."""


# ---------------------------------------------------------------------------
# Misbehave

# Anywhere (DataLoader without workers misbehaves the same way).
_ANYWHERE = {"raise", "raise-value", "raise-key", "raise-index", "raise-weird", "generator",
             "ragged"}
# In a worker only.
_IN_WORKER = {"kill", "exit", "sys-exit", "sleep", "huge"}


class Misbehave(Plain):
    """:class:`Plain` (``torch.tensor(i)``, or rows with ``width``), except
    that ``dataset[i]`` for ``i`` in ``on`` does ``on[i]``:

    In any process:

    * ``"raise"`` (or ``"raise-value"``): ValueError ``bad sample <i>``;
      ``"raise-key"``, ``"raise-index"``, ``"raise-weird"``: KeyError,
      IndexError, :class:`Weird` (see :func:`make_error`).
    * ``"generator"``: returns a generator (use a collate_fn that keeps it).
    * ``"ragged"``: a row one element wider than the others (needs ``width``).

    In a worker process only:

    * ``"kill"``: the worker sends itself ``sig`` (default SIGKILL).
    * ``"exit"``: ``os._exit(code)``; ``"sys-exit"``: ``sys.exit(code)``.
    * ``"sleep"``: sleeps ``seconds`` (a hang, by default), then returns the sample.
    * ``"huge"``: asks torch for :data:`ABSURD_NUMEL` int64 elements.

    ``once``: a marker file; it misbehaves only the first time any process
    gets there, so a restarted worker gets through. ``on`` is a plain
    attribute: a test removes the cause with ``dataset.on = {}`` (the
    dataset is pickled anew for every iterator).
    """

    def __init__(self, n: int, on: Mapping[int, str], *, sig: int = signal.SIGKILL,
                 code: int = 0, seconds: float = 60.0, once: Optional[str] = None,
                 delay: float = 0.0, width: Optional[int] = None,
                 dtype: torch.dtype = torch.int64) -> None:
        super().__init__(n, delay=delay, width=width, dtype=dtype)
        unknown = set(on.values()) - _ANYWHERE - _IN_WORKER
        assert not unknown, f"unknown misbehaviour {unknown}"
        self.on = dict(on)
        self.sig = sig
        self.code = code
        self.seconds = seconds
        self.once = once

    def _first_time(self) -> bool:
        if self.once is None:
            return True
        try:
            fd = os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def __getitem__(self, i: int) -> Any:
        if self.delay:
            time.sleep(self.delay)
        what = self.on.get(i)
        if what is None or (what in _IN_WORKER and not in_worker()) or not self._first_time():
            return self.row(i)
        if what.startswith("raise"):
            kind = what.partition("-")[2] or "value"
            raise make_error(kind, i)
        if what == "generator":
            return (x for x in range(3))
        if what == "ragged":
            assert self.width is not None, "ragged needs rows (width)"
            return self.row(i, self.width + 1)
        if what == "kill":
            os.kill(os.getpid(), self.sig)
            time.sleep(30)  # never reached for SIGKILL
        elif what == "exit":
            os._exit(self.code)
        elif what == "sys-exit":
            sys.exit(self.code)
        elif what == "sleep":
            time.sleep(self.seconds)
        elif what == "huge":
            return torch.empty(ABSURD_NUMEL, dtype=torch.int64)
        return self.row(i)


# ---------------------------------------------------------------------------
# Pattern: the fault-injection suite's dataset (test_faults.py)

WIDTH = 6
"""Elements of a :class:`Pattern` sample."""


def sample(i: int) -> torch.Tensor:
    """``Pattern()[i]``: int64 row ``[i, 7i+1, 7i+2, ...]`` (index first, easy to read back)."""
    row = torch.arange(WIDTH, dtype=torch.int64) + 7 * i
    row[0] = i
    return row


class Pattern(Dataset):
    """Deterministic map-style dataset with faults switched by marker files.

    ``dataset[i]`` is :func:`sample` ``(i)``, so every delivered batch can be
    checked for content and the indices it came from read back. In a worker,
    while these files exist in the control directory ``ctl``:

    * ``raise-<i>``: ``dataset[i]`` raises :class:`InjectedFault`; every
      raise appends ``"<i> <time.monotonic()>"`` to ``raised.log`` (one line
      per call, so a retried index would show up twice).
    * ``slow-<w>``: worker ``w`` sleeps ``slow_s`` before every sample (a
      very slow, but never hung, worker); every slowed sample appends a line
      to ``slowed.log``.
    """

    def __init__(self, n: int, ctl: Optional[str] = None, delay: float = 0.0,
                 slow_s: float = 0.0) -> None:
        self.n = n
        self.ctl = ctl
        self.delay = delay
        self.slow_s = slow_s

    def __len__(self) -> int:
        return self.n

    def _log(self, name: str, line: str) -> None:
        assert self.ctl is not None
        with open(os.path.join(self.ctl, name), "a") as f:
            f.write(line + "\n")

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        info = get_worker_info()
        if self.ctl is not None and info is not None:
            if self.slow_s and os.path.exists(os.path.join(self.ctl, f"slow-{info.id}")):
                self._log("slowed.log", f"{i} {info.id} {os.getpid()}")
                time.sleep(self.slow_s)
            if os.path.exists(os.path.join(self.ctl, f"raise-{i}")):
                self._log("raised.log", f"{i} {time.monotonic()!r}")
                raise InjectedFault(f"injected fault at index {i}")
        return sample(i)


class Gate(Plain):
    """``dataset[i] == torch.tensor(i)``; in a worker, every ``dataset[i]``
    first leaves a file ``enter-<i>-<pid>`` in the directory ``ctl``, and
    for ``i >= from_index`` it then waits until the file ``ctl/open`` exists
    (a sample stuck for as long as the test wants: a dataset on a file
    system that stopped answering)."""

    def __init__(self, n: int, ctl: str, from_index: int) -> None:
        super().__init__(n)
        self.ctl = ctl
        self.from_index = from_index

    def __getitem__(self, i: int) -> Any:
        if in_worker():
            open(os.path.join(self.ctl, f"enter-{i}-{os.getpid()}"), "w").close()
            while i >= self.from_index and not os.path.exists(os.path.join(self.ctl, "open")):
                time.sleep(0.01)
        return self.row(i)

    def entered(self) -> Dict[int, List[int]]:
        """Index -> pids of the workers that started making it."""
        out: Dict[int, List[int]] = {}
        for name in os.listdir(self.ctl):
            if name.startswith("enter-"):
                _, i, pid = name.split("-")
                out.setdefault(int(i), []).append(int(pid))
        return out

    def open(self) -> None:
        open(os.path.join(self.ctl, "open"), "w").close()


# ---------------------------------------------------------------------------
# what cannot be pickled to a worker, or back


class Holds(Plain):
    """``dataset[i] == torch.tensor(i)``; holds one unpicklable (or, for a
    socket, specially pickled) attribute under a distinctive name:
    ``row_lock``, ``log_handle`` (a file opened on ``path``), ``row_source``
    (a generator) or ``row_socket``."""

    ATTR = {"lock": "row_lock", "file": "log_handle", "generator": "row_source",
            "socket": "row_socket"}

    def __init__(self, n: int, kind: str, path: Optional[str] = None) -> None:
        super().__init__(n)
        self.kind = kind
        self.plain_setting = "harmless"
        if kind == "lock":
            self.row_lock: Any = threading.Lock()
        elif kind == "file":
            assert path is not None
            self.log_handle: Any = open(path, "w")
        elif kind == "generator":
            self.row_source: Any = (x for x in range(3))
        elif kind == "socket":
            self.row_socket: Any = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            raise AssertionError(kind)

    @property
    def attr(self) -> str:
        return self.ATTR[self.kind]

    def drop_cause(self) -> None:
        """Close (file, socket) and drop the attribute: the dataset pickles then."""
        value = getattr(self, self.attr)
        if self.kind in ("file", "socket") and value is not None:
            value.close()
        setattr(self, self.attr, None)


def _refuse_to_load(i: int) -> Any:
    raise ValueError(f"NoLoad({i}) cannot be rebuilt in this process")


class NoLoad:
    """Pickles fine; unpickling raises (in the main process: the worker never unpickles it)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> Any:
        return (_refuse_to_load, (self.i,))


class NoDump:
    """``pickle.dumps`` raises a ValueError (not the usual TypeError)."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> Any:
        raise ValueError(f"NoDump({self.i}) refuses to be pickled")


class OddSample(Dataset):
    """``{"t": tensor(i), "extra": ...}``: for the index in ``kinds`` the extra
    is a lambda (``"lambda"``), a NoDump (``"nodump"``) or a NoLoad (``"noload"``).
    Use with ``support.datasets.keep_collate``."""

    def __init__(self, n: int, kinds: Dict[int, str]) -> None:
        self.n = n
        self.kinds = dict(kinds)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        kind = self.kinds.get(i)
        extra: Any = None
        if kind == "lambda":
            extra = lambda: i  # noqa: E731 - the point of the test
        elif kind == "nodump":
            extra = NoDump(i)
        elif kind == "noload":
            extra = NoLoad(i)
        return {"t": torch.tensor(i), "extra": extra}


# ---------------------------------------------------------------------------
# collate functions and worker_init_fn


class RaisingCollate:
    """Default collate, except that a batch containing ``bad`` raises."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[torch.Tensor]) -> torch.Tensor:
        if any(int(x) == self.bad for x in batch):
            raise ValueError(f"collate refuses batch with {self.bad}")
        return torch.stack(batch)


class HugeCollate:
    """Default collate, except a batch containing ``bad`` (as its rows' first
    element) asks for an absurd allocation, in a worker; ``bad = -1``: never."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[torch.Tensor]) -> torch.Tensor:
        if any(int(x[0]) == self.bad for x in batch) and in_worker():
            return torch.zeros(ABSURD_NUMEL, dtype=torch.uint8)
        return default_collate(batch)


class LockInBatch:
    """A collate_fn that keeps the samples in a list; a batch containing ``bad`` also gets a lock."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, batch: List[Any]) -> Dict[str, Any]:
        out: Dict[str, Any] = {"data": list(batch)}
        if any(isinstance(x, torch.Tensor) and int(x) == self.bad for x in batch):
            out["lock"] = threading.Lock()
        return out


def failing_worker_init(worker_id: int) -> None:
    raise RuntimeError(f"worker_init_fn failed in worker {worker_id}")


# ---------------------------------------------------------------------------
# workers that write a lot to stdout / stderr


class Chatty(Dataset):
    """Every sample (in a worker) writes ``nbytes`` to stdout and to stderr."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n = n
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if in_worker():
            line = (f"chatty-{i:04d} " + "x" * 1000 + "\n").encode()
            reps = max(1, self.nbytes // len(line))
            blob = line * reps
            for fd in (1, 2):
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view):]
            # The newline inside the text: print()'s own end="\n" is a second
            # write(2) when stdio is unbuffered (PYTHONUNBUFFERED=1), and the
            # other worker's writes can land between the two.
            print(f"chatty-print-{i}\n", end="", flush=True)
            print(f"chatty-stderr-{i}\n", end="", file=sys.stderr, flush=True)
        return torch.full((64,), i, dtype=torch.int64)


# ---------------------------------------------------------------------------
# datasets whose unpickling does something (in the zygote that preloads them)


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class UnpicklesWith(Dataset):
    """``dataset[i] == tensor([i, u])``, ``u`` 1 when this process unpickled
    the dataset itself, 0 when it inherited it (from a zygote that did).

    Unpickling does ``how`` in the zygote, i.e. in a process whose parent
    or grandparent is the one that pickled it (a zygote is forked from the
    fork server, a child of the training process; a spawned worker is the
    training process's child; a worker forked from a zygote is neither)
    (``everywhere``: in every worker too): ``"thread"``
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
        if not self.everywhere and self.owner not in (os.getppid(), _parent_of(os.getppid())):
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
