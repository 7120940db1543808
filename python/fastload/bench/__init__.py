"""fastload against torch.utils.data.DataLoader, interleaved, on this machine.

``python -m fastload.bench`` runs each workload with fastload and with
DataLoader at the same ``num_workers``, batch size and start method, the two
alternating (A B, then B A) for ``--rounds`` rounds, each run in a fresh
process, and prints medians: steady-state samples/s and batches/s, the ratio
fastload/DataLoader against its target, time to first batch (cold: a
fresh process; warm: the second epoch with ``persistent_workers=False``),
main-process CPU time per batch, peak PSS of main + workers, and whether
every index arrived exactly once, in order, with the content of an
in-process reference. It also prints the machine and the limits measured in
the same run: single-thread memcpy bandwidth and each workload's rate in one
process. Each workload is run again under load (``--under-load``):
``num_workers`` = 2 x the cores, and beside one busy-looping process per
core. ``--dataset module:callable`` measures your own dataset.

Modules: :mod:`.workloads` (datasets, cached data, ``--dataset``),
:mod:`.runner` (runs in child processes, busy neighbours), :mod:`.memory`
(memory of a process tree), :mod:`.limits` (memcpy, one-process and
side-by-side rates), :mod:`.measure` (references, the machine),
:mod:`.child` (the code of one run, in its process),
:mod:`.checks` (the per-batch fingerprint), :mod:`.evaluate` (medians,
targets and correctness of a workload's runs),
:mod:`.report` (targets, table, plot), :mod:`.options` (the command
line: options, defaults, the workloads chosen), :mod:`.cli` (the order of
the runs), :mod:`.ab` (``python -m fastload.bench.ab REV``: this tree's
fastload against another commit's, run for run; docs/benchmarking.md).
Nothing heavy is imported here: spawned workers import this package to
unpickle the built-in datasets.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from .cli import main as _main

    return _main(argv)


def run_benchmark(argv: Optional[List[str]] = None, out: Any = None) -> Dict[str, Any]:
    """Run as the command line would and return the JSON document."""
    from .cli import run_benchmark as _run

    return _run(argv, out)
