"""The iterators a loader hands out, in the training process.

``iter(loader)`` returns one of them, each DataLoader's own step for step:
:mod:`.single_process` for ``num_workers=0`` and :mod:`.multi_process` for
workers, which sends index batches to a pool's workers and hands their
batches out in order. The multi-process iterator is a driver over parts
that each own their state (the schedule of tasks, the resume cursor, the
worker-count controller, the session on the workers); it asks each what
to do and none of them calls back into it. :mod:`.loader_runtime` is what
a loader keeps for its iterators between epochs.

Runs only in the training process. Uses :mod:`fastload.pool`,
:mod:`fastload.stats`, :mod:`fastload.resume` and :mod:`fastload.device`;
nothing below imports it.
"""
