"""Helpers shared by fastload's tests.

* :mod:`support.datasets` -- well-behaved datasets, samplers and collate
  functions (``Plain``: ``dataset[i] == torch.tensor(i)``, rows, images,
  a probe of the worker's environment).
* :mod:`support.equality` -- rich datasets for the DataLoader-equality tests
  (nested samples, every dtype, worker randomness, IterableDatasets).
* :mod:`support.faults` -- things that misbehave on purpose: ``Misbehave``
  (raise, kill, exit, sleep... at chosen indices), ``Pattern`` (faults
  switched on by marker files), unpicklable datasets, failing collates.
* :mod:`support.processes` -- processes, fds and ``/dev/shm`` entries of
  this test process (what the leak check in ``conftest.py`` compares).
* :mod:`support.outcomes` -- iterating a loader like a training loop that
  survives errors, and reading the errors it got.
* :mod:`support.fault_scenarios`, :mod:`support.fault_injection`,
  :mod:`support.fault_checks`, :mod:`support.fault_harness` -- the
  fault-injection suite of ``test_faults.py``: its seeded scenarios and
  report, injecting each epoch's fault into the workers, checking an epoch
  against DataLoader, and running the scenarios.
* :mod:`support.ring_driver` -- a ring's worker side played in the test's
  own process (take a task, commit a batch or an error).
* :mod:`support.fake_pool` -- a worker pool whose workers are played in the
  test's own process, for the iterator and the supervisor with no worker
  process; ``DrivenLoader``, a DataLoader iterated by fastload over it.
* :mod:`support.fake_zygotes` -- fork servers and zygotes that record what
  they are asked, for ``fastload.launching.fork_server``.
* :mod:`support.slow_start` -- spawned workers whose start-up, before they
  join the ring, is busy or blocked for as long as a test says.
* :mod:`support.torch_versions` -- which of DataLoader's arguments and
  behaviours the installed torch has (the suite runs on torch 2.1 to the
  newest).

Datasets are pickled to worker processes by reference, so they must be
importable: pytest puts ``tests/`` on ``sys.path`` (``tests/conftest.py``,
prepend import mode) and fastload's workers, like spawned ones, get the
parent's ``sys.path``. Define a dataset a test sends to workers here, not in
the test module. fastload's internals (worker pids, the ring, the warm pool)
are read through ``fastload.debug.debug_view``.
"""

from __future__ import annotations

import os

NW = 2
"""Workers per loader in most tests: the CI machine has 2 cores."""

HANG_S = 10.0
"""Anything slower than this is a hang, not a slow machine."""

KILLED_RE = r"DataLoader worker \(pid (\d+)\) is killed by signal: Killed"
"""DataLoader's message for a worker killed by SIGKILL (group 1: the pid)."""

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""``tests/``: what a subprocess script puts on ``sys.path`` to import ``support``."""
