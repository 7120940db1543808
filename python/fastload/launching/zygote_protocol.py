"""The messages between the main process and a zygote, on its control socket.

The zygote (:mod:`fastload.launching.zygote_main`, which serves) and
:class:`fastload.launching.zygote.Zygote` (its handle in the main
process, which asks) talk over a ``SOCK_SEQPACKET`` pair, one message per
request or answer, the fds a request hands over travelling with it by
``SCM_RIGHTS``. Both sides take the message formats and limits below from
here:

* **Fork** (main → zygote): the worker's header (a pickle, so it starts
  with ``b"\x80"``) with, by ``SCM_RIGHTS``, its death note's write end and
  then its parcel's fds (at most :data:`MAX_FDS` in all). The zygote forks;
  the child runs :func:`fastload.launching.entry.run`; the zygote answers
  :data:`STARTED` ``(b"S", pid)``.
* **Preload** (main → zygote): :data:`PRELOAD_REQ` and a pickle of
  ``{token, sys_path, sys_argv, authkey}``, with the session parcel's memfd
  and then the fds it refers to. The zygote answers :data:`UNPICKLING`
  ``(b"p", token, 0)`` as it starts unpickling (the main side's time limit
  starts then), then :data:`PRELOAD` ``(b"P", token, outcome)`` followed by
  why, as text of at most :data:`WHY_MAX` bytes.
* **Zygote** (main → fork server): :data:`ZYGOTE_REQ` with, by
  ``SCM_RIGHTS``, one end of a new control socket, a death-note write end
  and, where the training process has them open, its stdout and stderr
  (the server was started earlier, maybe before the script redirected
  them). The server forks; the child takes those as its stdout and stderr
  (its workers write where the training process does, as DataLoader's
  do), drops the server's sockets and serves
  the new socket as a zygote of its own (it shares everything the server
  imported, and holds no session); the server answers :data:`STARTED`
  with its pid, and reports its exit like a worker's.
* **Import** (main → zygote): :data:`IMPORT_REQ` and a pickle of
  ``{sys_path, modules}``: the zygote imports those modules (the ones that
  define a loader's dataset, ``collate_fn``, sampler and
  ``worker_init_fn``), so that neither the session it preloads later nor
  the workers it forks pay for them. No answer; an import that fails is
  left for the session to meet and report. An import that leaves threads,
  a GPU context or open files in the zygote makes it unsafe to fork from:
  its next preload answers :data:`TAINTED`.
  After a preload that imported modules without harm (PRELOADED), the
  zygote first sends :data:`MODULES` and a pickle of the names unpickling
  imported, in order: the main side has the fork server import them too
  (**Import**), so that the zygotes of later pools have them already.
* **Forget** (main → zygote): :data:`FORGET_REQ`. The pool's workers are
  retired: the zygote drops the session it holds (the next session sends
  one anew). No answer.
* **Exit report** (zygote → main, at any time): :data:`EXITED` ``(b"X",
  pid, exit code)`` when a worker it forked has exited and been reaped.
* The main process closing the socket (it stopped the zygote, or died):
  the zygote kills and reaps its workers and exits. Zygotes it forked are
  left alone: each ends when its own control socket closes.
"""

from __future__ import annotations

import struct

__all__ = ["STARTED", "EXITED", "MAX_FDS", "PRELOAD_REQ", "PRELOAD", "UNPICKLING", "FORGET_REQ",
           "ZYGOTE_REQ", "IMPORT_REQ", "WHY_MAX", "PRELOADED", "DECLINED", "TAINTED", "LOST",
           "MODULES", "MODULES_MAX"]

# The messages (see above).
STARTED = struct.Struct("<ci")  # b"S", pid
EXITED = struct.Struct("<cii")  # b"X", pid, exit code (negative: signal)
MAX_FDS = 250  # SCM_RIGHTS carries at most 253 fds per message
PRELOAD_REQ = b"P"  # a preload request; fork requests are pickles (b"\x80...")
PRELOAD = struct.Struct("<cIB")  # b"P", token, outcome; then why, as text
UNPICKLING = b"p"  # PRELOAD's shape: the zygote has begun unpickling session token
FORGET_REQ = b"F"  # drop the session held
ZYGOTE_REQ = b"Z"  # fork a zygote serving a control socket of its own
IMPORT_REQ = b"I"  # import modules a loader's session will need
WHY_MAX = 1000

# Outcomes of a preload (fastload.launching.zygote.Zygote.preload).
PRELOADED = 0  # the zygote holds the session: workers forked now inherit it
DECLINED = 1  # it could not or should not hold it: workers unpickle their own
TAINTED = 2  # as DECLINED, and unpickling left threads (or a GPU context) in
#              the zygote: it is no longer safe to fork from
LOST = 3  # the zygote died, or gave no answer in time (main side only)

# zygote -> main, before a PRELOADED answer: a pickle of the modules the
# preload's unpickling imported, in the order it imported them, for the
# fork server to import too.
MODULES = b"M"
MODULES_MAX = 1 << 20  # the largest message on the control socket
