"""What runs in a worker process: the task loop and a session's dataset.

:mod:`.loop` is the worker's main: it takes a task from its queue on the
ring and writes the batch into the task's slot; :mod:`.session` holds one
session's dataset replica, seeds and fetcher. Imported only in workers
(and by the pool, which names :func:`.loop.worker_main` as the entry point
of the workers it starts); it never imports :mod:`fastload.pool` or
:mod:`fastload.iterator`, whose objects live in the training process.
"""
