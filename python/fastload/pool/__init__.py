"""A ring and the worker processes that fill it, kept across iterators.

:mod:`.worker_pool` starts a pool's workers (through
:mod:`fastload.launching`), gives them sessions, replaces, grows, shrinks
and retires them; :mod:`.handles` holds the training process's handle on
each worker (its process, channel and stack file); :mod:`.ledger` says
what each ring slot is doing; :mod:`.supervisor` watches the workers for
deaths and hangs; :mod:`.exits` words what the user is told of a worker
that died or hangs; :mod:`.teardown` stops a pool.

Runs in the training process. An iterator uses a pool; the pool never
imports :mod:`fastload.iterator`.
"""
