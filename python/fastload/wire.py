"""The protocol between the main process and its workers, both sides in one place.

Three channels connect them (see docs/design.md, "The ring"):

* **Tasks**, written by the main process into the slot they belong to and
  read by the worker that the ring queued them for. A task is a pickled
  tuple made only by :func:`encode_session` and :func:`encode_fetch` and read
  only by :func:`decode_task`:

  - ``(OP_SESSION, base_seed, inherited, resume, preloaded)``: start a
    session. Unless ``inherited``, the pool has just sent the worker, over
    its socket, the memfd of the pickled ``(process state, dataset,
    collate_fn, worker_init_fn, dataset_kind, auto_collation, drop_last)``
    (:mod:`fastload.process_state`) followed by
    the fds of what the dataset shares (:func:`send_session` / the worker's
    ``recv_session``). ``inherited``: the same objects came with the fork:
    from the training process (the worker's spec holds them), or, when
    ``preloaded`` is a session number, from the zygote that had unpickled
    that session before forking the worker (``zygote.preloaded``). The worker seeds
    itself as a fresh DataLoader worker, runs ``worker_init_fn``, and then,
    if ``resume`` (bytes from :mod:`fastload.resume`) is given, puts its
    random generators and dataset replica back where they were.
  - ``(OP_FETCH, epoch, batch_idx, index)``: make one batch. A new
    ``epoch`` within a session is DataLoader's ``_ResumeIteration``.

* **Results**, committed by the worker with a *kind* and the batch's
  layout in the slot (see :mod:`fastload.batch_format`): ``KIND_DATA`` (a batch,
  ``FLAG_OVERFLOW`` set when part of it lies in an overflow segment whose fd
  follows on the socket, tagged with ``OVERFLOW_MSG``), ``KIND_ERROR`` (a
  pickled ``ExceptionWrapper``), ``KIND_EXHAUSTED`` (an IterableDataset
  replica ended). The ring carries kinds opaquely.

* **Signals**: ``STACK_SIGNAL`` asks a worker to dump its Python stack
  (the hang watchdog); the accelerator variables in ``ACCELERATOR_ENV`` are
  set empty in a worker's environment so it never creates a GPU context.
"""

from __future__ import annotations

import pickle
import signal
import socket
import struct
from typing import Any, List, Optional, Tuple

ACCELERATOR_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
STACK_SIGNAL = signal.SIGUSR1

OP_SESSION = 0
OP_FETCH = 1

KIND_DATA = 0
KIND_ERROR = 1
KIND_EXHAUSTED = 2
FLAG_OVERFLOW = 0x10

OVERFLOW_MSG = struct.Struct("<Q")  # seq of the batch whose overflow fd follows
SESSION_HEAD = struct.Struct("<cI")  # b"S", number of fds; then b"F" for each further message
_MAX_FDS_PER_MSG = 250  # under SCM_RIGHTS' per-message limit (253)


def encode_session(base_seed: int, inherited: bool = False,
                   resume: Optional[bytes] = None, preloaded: Optional[int] = None) -> bytes:
    """The task that starts a session on a worker."""
    return pickle.dumps((OP_SESSION, base_seed, inherited or preloaded is not None, resume,
                         preloaded), protocol=pickle.HIGHEST_PROTOCOL)


def encode_fetch(epoch: int, batch_idx: int, index: Any) -> bytes:
    """The task that makes batch ``batch_idx`` of ``epoch`` from sampler output ``index``."""
    return pickle.dumps((OP_FETCH, epoch, batch_idx, index), protocol=pickle.HIGHEST_PROTOCOL)


def decode_task(data: Any) -> Tuple[Any, ...]:
    """A task tuple, as one of the encoders made it."""
    return pickle.loads(data)


def hidden_env(hide: bool) -> dict:
    """The environment overlay that hides accelerators from a new interpreter
    (it reads the variables before any of our code runs; forked workers set
    them again first thing)."""
    return {k: "" for k in ACCELERATOR_ENV} if hide else {}


def send_session(sock: socket.socket, fds: List[int]) -> None:
    """The session's fds (the blob's memfd first), in messages of at most
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


def send_overflow(sock: socket.socket, seq: int, fd: int) -> None:
    """Worker side: hand the main process the overflow segment of batch ``seq``."""
    socket.send_fds(sock, [OVERFLOW_MSG.pack(seq)], [fd])


def recv_overflow(sock: socket.socket) -> Tuple[Optional[int], Optional[int]]:
    """Main side: the next (seq, fd) a worker sent; (None, None) when its
    channel is closed."""
    msg, fds, _flags, _addr = socket.recv_fds(sock, OVERFLOW_MSG.size, 1)
    if not fds:
        return None, None
    return OVERFLOW_MSG.unpack(msg)[0], fds[0]
