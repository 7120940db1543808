"""Batches on their way to an accelerator: pinned memory and device prefetch.

:mod:`.pinning` registers the ring with the accelerator's runtime as pinned
memory and keeps a slot from the workers until the device copies reading
it have finished; :mod:`.prefetch` copies batch ``k+1`` to the device on a
side stream while the loop computes on batch ``k``. Runs in the training
process only (workers never touch an accelerator).
"""
