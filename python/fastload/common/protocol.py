"""The protocol between the main process and its workers, both sides in one place.

Two kinds of message go between them (see docs/design.md, "The ring"):

* **Tasks**, written by the main process into the slot they belong to and
  read by the worker that the ring queued them for. On the wire a task is a
  pickled tuple whose first item is its :class:`Op`, made only by
  :func:`encode_session` and :func:`encode_fetch`; :func:`decode_task`
  reads it back as a :class:`SessionTask` or a :class:`FetchTask`:

  - ``(Op.SESSION, base_seed, inherited, resume, preloaded)``: start a
    session. Unless ``inherited``, the pool has just sent the worker, over
    its socket, the memfd of the pickled ``(inherited settings, dataset,
    collate_fn, worker_init_fn, dataset_kind, auto_collation, drop_last)``
    (:mod:`fastload.common.inherited`) followed by
    the fds of what the dataset shares (:func:`send_session` / the worker's
    ``recv_session``). ``inherited``: the same objects came with the fork:
    from the training process (the worker's spec holds them), or, when
    ``preloaded`` is a session number, from the zygote that had unpickled
    that session before forking the worker (``zygote.preloaded``). The worker seeds
    itself as a fresh DataLoader worker, runs ``worker_init_fn``, and then,
    if ``resume`` (``(capture, samples to skip)`` from
    :func:`fastload.resume.book.worker_resume`) is given, puts its
    random generators and dataset replica back where they were.
  - ``(Op.FETCH, epoch, batch_idx, index)``: make one batch. A new
    ``epoch`` within a session is DataLoader's ``_ResumeIteration``.

  The op goes on the wire as a plain int, not as the enum member (which
  would pickle a reference to this module's class: more bytes, slower).

* **Results**, committed by the worker with a :class:`Kind` and the batch's
  layout in the slot (see :mod:`fastload.transport.format`): ``Kind.DATA`` (a batch,
  ``FLAG_OVERFLOW`` set when part of it lies in an overflow segment whose fd
  the worker sent on its socket first, :mod:`fastload.transport.overflow`),
  ``Kind.ERROR`` (a pickled ``ExceptionWrapper``), ``Kind.EXHAUSTED`` (an
  IterableDataset replica ended). The ring carries kinds opaquely, as ints.
  The kind is protocol, not slot format: it is the worker's answer to its
  task, which the ledger and the iterator act on without reading the slot;
  the format says how the bytes of a ``DATA`` or ``ERROR`` answer lie.
"""

from __future__ import annotations

import enum
import pickle
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any, List, Optional, Union

from .ring_handles import FdHandle, RingHandle


class Op(enum.IntEnum):
    """What a task asks of a worker: the first item of a task on the wire."""

    SESSION = 0
    FETCH = 1


class Kind(enum.IntEnum):
    """What a worker committed into a slot: the ``kind`` of its result."""

    DATA = 0
    ERROR = 1
    EXHAUSTED = 2


# A bit OR-ed into a result's kind (only ``Kind.DATA`` has it): part of the
# batch lies in an overflow segment. A plain int, not a member of Kind: a
# kind with it set is no Kind; test it with ``kind & FLAG_OVERFLOW``.
FLAG_OVERFLOW = 0x10

SESSION_HEAD = struct.Struct("<cI")  # b"S", number of fds; then b"F" for each further message
_MAX_FDS_PER_MSG = 250  # under SCM_RIGHTS' per-message limit (253)


@dataclass(frozen=True, slots=True)
class SessionTask:
    """A decoded ``Op.SESSION`` task: start a session (see the module docstring)."""

    base_seed: int
    inherited: bool  # the session's objects came with the fork; none follow on the socket
    resume: Optional[tuple]  # where to put the worker's generators and replica back, or None
    preloaded: Optional[int]  # the session number the forking zygote preloaded, or None


@dataclass(frozen=True, slots=True)
class FetchTask:
    """A decoded ``Op.FETCH`` task: make batch ``batch_idx`` of ``epoch``
    from ``index``, the sampler's output."""

    epoch: int
    batch_idx: int
    index: Any


Task = Union[SessionTask, FetchTask]

# The ops as the plain ints the encoders pickle (see the module docstring).
_SESSION = Op.SESSION.value
_FETCH = Op.FETCH.value


def encode_session(base_seed: int, inherited: bool = False,
                   resume: Optional[tuple] = None, preloaded: Optional[int] = None) -> bytes:
    """The task that starts a session on a worker."""
    return pickle.dumps((_SESSION, base_seed, inherited or preloaded is not None, resume,
                         preloaded), protocol=pickle.HIGHEST_PROTOCOL)


def encode_fetch(epoch: int, batch_idx: int, index: Any) -> bytes:
    """The task that makes batch ``batch_idx`` of ``epoch`` from sampler output ``index``."""
    return pickle.dumps((_FETCH, epoch, batch_idx, index), protocol=pickle.HIGHEST_PROTOCOL)


def decode_task(data: Any) -> Task:
    """The task one of the encoders made (worker side, once per task)."""
    task = pickle.loads(data)
    if task[0] == _FETCH:
        return FetchTask(task[1], task[2], task[3])
    if task[0] == _SESSION:
        return SessionTask(task[1], task[2], task[3], task[4])
    raise ValueError(f"fastload: a task with unknown op {task[0]!r}")


def send_session(sock: socket.socket, fds: List[int]) -> None:
    """The session's fds (the parcel's memfd first), in messages of at most
    SCM_RIGHTS' limit; :func:`recv_session_fds` reassembles them."""
    for k in range(0, len(fds), _MAX_FDS_PER_MSG):
        head = SESSION_HEAD.pack(b"S", len(fds)) if k == 0 else b"F"
        socket.send_fds(sock, [head], fds[k:k + _MAX_FDS_PER_MSG])


def recv_session_fds(sock: socket.socket) -> List[int]:
    """The fds :func:`send_session` sent, in order."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, SESSION_HEAD.size, 253)
    if not msg:
        raise RuntimeError("fastload: the main process closed the worker channel")
    _s, total = SESSION_HEAD.unpack(msg)
    while len(fds) < total:
        more, got, _flags, _addr = socket.recv_fds(sock, 1, 253)
        if not more:
            raise RuntimeError("fastload: the main process closed the worker channel")
        fds += got
    return fds


# Set empty in a worker's environment, so that it never creates a GPU
# context (docs/design.md, "Starting workers").
ACCELERATOR_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

# The signal a worker dumps its Python stack on (faulthandler), for the
# main process's report of a hung worker (fastload.pool.exits).
STACK_SIGNAL = signal.SIGUSR1


@dataclass
class WorkerSpec:
    """What one worker needs at start; small, pickled by the start method."""

    ring: RingHandle
    sock: socket.socket
    worker_id: int
    num_workers: int
    parent_pid: int
    hide_accelerators: bool
    stack_file: FdHandle  # where the worker dumps its Python stack on STACK_SIGNAL
    # (dataset, collate_fn, ...) itself, for workers forked from the main
    # process when only fork can hand it over; else it comes per session.
    session: Any = None
