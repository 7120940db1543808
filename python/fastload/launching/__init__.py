"""Starting fastload's processes: spawned workers, zygotes, the fork server.

Everything that starts a process for fastload, or runs first in one it
started, lives in this package. The pool that owns a loader's workers
(:mod:`fastload.pool.worker_pool`, stopped by :mod:`fastload.pool.teardown`) and the worker
loop (:mod:`fastload.worker.loop`) use it from outside; nothing here imports
them. From the rest of fastload the package imports only
:mod:`fastload.common` (the pickler, the errors, the protocol's constants).
docs/design.md, "Starting workers", tells the story these modules implement.

The modules, in dependency order: each imports only modules listed before
it, at the top of the file, so the package has no import cycle
(tests/test_imports.py checks both). This file imports none of them: a
caller imports the module it needs. Where each runs: *main* is the
training process, *child* a process fastload started (the fork server, a
zygote, a worker).

1. ``start_methods`` (main): which launcher a loader's
   ``multiprocessing_context`` stands for: the zygote (the default, and
   ``'forkserver'``), spawn, or ``multiprocessing`` forking this process.
2. ``zygote_protocol`` (both): the messages on a zygote's control socket
   and the outcomes of a preload, shared by its two ends.
3. ``child`` (main): :class:`~fastload.launching.child.Child`, the handle
   on a worker fastload started; it quacks like ``multiprocessing.Process``
   and quotes the worker's death note.
4. ``memfds`` (both): making memfds, passing the fds this process keeps,
   comparing bytes, and moving a tensor's storage into a memfd in place.
5. ``buffer_copies`` (both): the loader's copies of the big buffers its
   sessions carry, reused while unchanged, mapped copy-on-write elsewhere.
6. ``share`` (both): ``fastload.share`` and ``SharedSequence``, shared
   memory made once for every loader and worker.
7. ``references`` (both): what fork would share, sent by reference: big
   tensors moved once into a memfd, memory-mapped arrays mapped again from
   their files, other big buffers as the loader's copies, what
   ``fastload.share`` made as its memfd.
8. ``parcels`` (both): a parcel is an object pickled for another process
   together with the fds of what stays shared (DataLoader's sharing
   semantics); a session's bytes in a memfd; packing a loader's session
   for its start method.
9. ``entry`` (child): what every child runs first: set up as its parent
   asked, call its entry point, leave a death note if that fails.
10. ``zygote_main`` (child): the zygote process (the fork server is one): its
   serve loop, forking workers and zygotes, preloading a session, importing
   a loader's modules ahead.
11. ``boot`` (child): the ``python -c`` entry of a fresh interpreter: read
   the header from a pipe, then become a zygote or run a worker.
12. ``spawn`` (main): starting a fresh interpreter that never runs
   ``__main__`` (real spawn), and what every such start shares: the
   header, the environment, a process group of the child's own.
13. ``zygote`` (main): :class:`~fastload.launching.zygote.Zygote`,
   a zygote as the main process sees it: started as a fresh interpreter,
   asked to fork workers and zygotes, to preload a session, to stop.
14. ``fork_server`` (main): the training process's fork servers (started at
    ``import fastload`` or by the first loader, ending with the process or
    ``fastload.shutdown()``) and the loaders' leases on them, and
    :class:`~fastload.launching.fork_server.Lineage`, the zygotes one pool
    forks its workers from and the session the current one holds.
"""
