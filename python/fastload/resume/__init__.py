"""Mid-epoch resume: where an epoch stands, saved and put back.

:mod:`.book` is the training process's side (NOTE [ Resume ]): the resume
book of what each worker made and what the loop took, and how an iterator
draws an epoch's order again. :mod:`.capture` runs in workers (and in the
training process for ``num_workers=0``): a worker's random generators and
dataset state captured after each batch and put back on resume.
:mod:`.format` is a saved state as data: its format, its checks, and
torchdata's ``StatefulDataLoader`` states read as fastload's.
"""
