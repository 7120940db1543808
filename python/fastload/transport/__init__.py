"""A batch's way from a worker to the training loop's tensors.

A worker makes a batch and writes it into the ring slot its task came in;
the main process rebuilds it as tensors that view the slot. This package
is that way, both ends side by side, as SPDL's arena keeps its writer and
reader: the format both agree on, the worker's writer, the main process's
reader. Which task a slot holds, when it is done and when it is freed is
not its business: the ring's states and the ledger (:mod:`fastload.pool.ledger`)
decide that; the task and result protocol is :mod:`fastload.common.protocol`.

How a batch travels: the worker's :class:`~fastload.transport.writer.SlotWriter`
has the default collate stack tensors straight into the slot, then pickles
the batch, describing those tensors where they lie and copying anything
else into the slot's arena, and appends its resume capture (the trailer);
it commits the slot with ``Kind.DATA``. The main process's ledger sees the
slot READY and reads its result into the batch's record, once;
:class:`~fastload.transport.reader.SlotReader` then leases the slot and
unpickles the meta into tensors that view it (or copies them out, when
the loop holds too many batches). A batch bigger than its slot goes partly
into an overflow segment, a memfd whose fd the worker sends on its channel
before committing; :class:`~fastload.transport.overflow.OverflowSegments`
holds such fds on the main side until the reader maps one or the ledger
frees its batch unread.

The modules, in dependency order: each imports only modules listed before
it, at the top of the file (tests/test_imports.py checks it, and that
what they import from the rest of fastload never leads back here). This
file imports none of them. Where each runs: *worker*, *main* or both.

1. ``format`` (both): how a result lies in its slot, the trailer, and what
   writer and reader must agree on (alignment, dtype codes, the meta's tag).
2. ``overflow`` (both): the part of a batch that does not fit its slot:
   the worker's segment (:func:`~fastload.transport.overflow.write`,
   :func:`~fastload.transport.overflow.send`), and
   :class:`~fastload.transport.overflow.OverflowSegments`, the one owner of
   such segments in the main process.
3. ``writer`` (worker): :class:`~fastload.transport.writer.SlotWriter`, a
   batch or an error written into a slot.
4. ``reader`` (main): :class:`~fastload.transport.reader.SlotReader` and
   :func:`~fastload.transport.reader.read_batch`.
"""
