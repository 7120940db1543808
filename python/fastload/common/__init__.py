"""What every layer and process of fastload uses: its errors, the protocol.

:mod:`.errors` holds the exceptions fastload raises beyond DataLoader's own;
:mod:`.protocol` the tasks and results between the training process and its
workers, and what a worker gets at start; :mod:`.inherited` the training
process's settings a session carries to workers; :mod:`.pickling` the
pickler sessions go with; :mod:`.ring_handles` the ring handed to a worker
by file descriptor; :mod:`.debug_views` the read-only views of
``fastload.debug.debug_view()``. A leaf: it imports no other part of
fastload but the C++ extension and, for the accelerators a worker hides,
:mod:`fastload.launching.spawn`.
"""
