"""What a loader measures of itself, and what it concludes from it.

:mod:`.meter` records an epoch as it runs (the loop's waits, each batch's
make time as its worker measured it, copies); :mod:`.loader_stats` is the
figures ``stats()`` returns and the verdict they support; :mod:`.autoscale`
is the rule ``num_workers="auto"`` follows to choose a worker count from
the same figures. A leaf: it imports no other part of fastload's loader;
the run report (:mod:`fastload.run_report`) and the iterators consume it.
"""
