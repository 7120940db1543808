"""``python -m fastload.bench``'s command line: its options, their
defaults (a full run's or ``--quick``'s), the workloads they choose, and
the machine states the runs are measured in. :mod:`.cli` runs what they
ask for."""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, TextIO, Tuple

from . import h2d
from .workloads import WORKLOADS, Workload, missing_needs, user_workload

FULL = {"rounds": 3, "seconds": 3.0, "warmup": 1.0, "raw_seconds": 2.0, "short_batches": 4,
        "min_batches": 40}
QUICK = {"rounds": 1, "seconds": 0.75, "warmup": 0.25, "raw_seconds": 0.4, "short_batches": 2,
         "min_batches": 10}
# --quick without --workloads: the two workloads that measure the loader
# itself (each run starts fresh processes that import torch: ~10 s a run on a
# slow 2-core machine, so all five would take over two minutes).
QUICK_WORKLOADS = ("transport_u8", "tiny")
# The runs under load, beside the quiet ones (see bench/README.md): all
# workloads again with num_workers = 2 x cores, and again with one
# busy-looping process per core running beside each run.
UNDER_LOAD = ("oversubscribed", "neighbour")
# The tables after the main one (--extras); 'h2d' by default only with a GPU.
EXTRAS = ("memory", "held-data", "first-epoch", "first-minutes", "auto-workers", "h2d")


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(
        prog="python -m fastload.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(doc or "").split("\n\n")[0],
        epilog="workloads:\n" + "".join(f"  {w.name:<14}{w.desc}\n" for w in WORKLOADS.values()) +
        "\nyour dataset: python -m fastload.bench --dataset mymodule:make_dataset "
        "[--batch-size N] [--workers N]\n"
        "exit status: 1 when a run failed or a loader delivered wrong batches, else 0 "
        "(targets missed included)")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated, default all ({','.join(WORKLOADS)}); only your "
                        "dataset when --dataset is given")
    p.add_argument("--dataset", metavar="MODULE:CALLABLE", default=None,
                   help="measure your own map-style dataset: the callable returns a Dataset or "
                        "{'dataset': ds, 'batch_size': n, 'collate_fn': fn}")
    p.add_argument("--workers", type=int, default=2, help="num_workers of both loaders (default 2)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch size of every workload (default: each workload's own)")
    p.add_argument("--seconds", type=float, default=None,
                   help=f"steady-state seconds per run (default {FULL['seconds']:g}, quick {QUICK['seconds']:g})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"runs of each loader, interleaved (default {FULL['rounds']}, quick {QUICK['rounds']})")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds before the steady state")
    p.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver", "fork"],
                   help="multiprocessing_context of both loaders (default spawn)")
    p.add_argument("--fastload-start-method", default="default",
                   choices=["same", "default", "spawn", "forkserver", "fork"],
                   help="fastload's multiprocessing_context: 'default' (None: what a user gets by "
                        "swapping the import: workers forked from a spawn-started zygote, which "
                        "inherit nothing from the main process, as with spawn) or 'same' as "
                        "--start-method (real spawn for both)")
    p.add_argument("--gap", type=float, default=0.0,
                   help="seconds between constructing each loader and iter() in the cold run, as "
                        "a script builds its model in between; the cold 1st batch is then timed "
                        "from iter() (default 0: from construction)")
    p.add_argument("--under-load", metavar="RUNS", default=None,
                   help="runs under load beside the quiet ones, comma-separated: 'oversubscribed' "
                        "(num_workers = 2 x cores), 'neighbour' (one busy-looping process per core "
                        "during each run), or 'none' (default: both; none with --quick)")
    p.add_argument("--extras", metavar="TABLES", default=None,
                   help="tables after the main one, comma-separated: 'memory' (copy-on-read: the "
                        "workers' memory on a dataset of 1.5M Python strings, 4 workers, against "
                        "DataLoader fork and spawn), 'held-data' (datasets that hold their data: a "
                        "tensor, an array, a memmap, a Hugging Face dataset and path lists of "
                        "--data-gib GiB; the process tree's peak memory and each epoch's first "
                        "batch, against DataLoader fork and spawn), "
                        "'first-epoch' (a training-like script's first "
                        "epoch), 'first-minutes' (the first batch of a loader built just before iter(), "
                        "after a model build, with a slow-to-import dataset module, of a second "
                        "loader, and short epochs; 8 workers, against DataLoader fork and spawn), "
                        "'h2d' (host to device: the pinned ring against DataLoader's "
                        "pin_memory; needs a CUDA or ROCm device) or 'none' (default: all, 'h2d' "
                        "where a device is present; none with --quick or --dataset)")
    p.add_argument("--data-gib", type=float, default=2.0,
                   help="size of each dataset of the held-data table, GiB (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the loaders' generator (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"one short round of {' and '.join(QUICK_WORKLOADS)} (unless --workloads): "
                        "about a minute")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG bar chart of the ratios (needs matplotlib)")
    return p


def settings(argv: Optional[List[str]]) -> argparse.Namespace:
    """The parsed options, with --quick's or the full run's defaults filled in."""
    a = parser().parse_args(argv)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.under_load is None:
        a.under_load = "none" if a.quick else ",".join(UNDER_LOAD)
    a.under_load = [] if a.under_load == "none" else a.under_load.split(",")
    if a.extras is None:
        a.extras = ("none" if a.quick or a.dataset else
                    ",".join(e for e in EXTRAS if e != "h2d" or h2d.cuda_present()))
    a.extras = [] if a.extras == "none" else a.extras.split(",")
    if [n for n in a.extras if n not in EXTRAS]:
        raise SystemExit(f"--extras: unknown {a.extras}; choose from {', '.join(EXTRAS)} or none")
    unknown = [n for n in a.under_load if n not in UNDER_LOAD]
    if unknown:
        raise SystemExit(f"--under-load: unknown run(s) {', '.join(unknown)}; known: "
                         f"{', '.join(UNDER_LOAD)} or none")
    if a.workers < 1:
        raise SystemExit("--workers must be >= 1: with 0 both loaders are the same code")
    if a.rounds < 1 or a.seconds <= 0 or a.warmup < 0:
        raise SystemExit("--rounds must be >= 1, --seconds > 0 and --warmup >= 0")
    return a


def select_workloads(a: argparse.Namespace, out: TextIO) -> Tuple[List[Workload], Dict[str, str]]:
    """The workloads ``a`` chooses that can run here, and those skipped with why
    (a missing package); ``--dataset``'s last."""
    if a.workloads:
        names = a.workloads.split(",")
    elif a.dataset:
        names = []
    elif a.quick:
        names = list(QUICK_WORKLOADS)
        print(f"--quick: {' and '.join(names)} only (loader overhead); without --quick all "
              f"five workloads are measured, or choose with --workloads", file=out)
    else:
        names = list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    chosen: List[Workload] = []
    skipped: Dict[str, str] = {}
    for n in names:
        miss = missing_needs(WORKLOADS[n])
        if miss:
            skipped[n] = f"needs {', '.join(miss)} (pip install {' '.join(miss)})"
            print(f"{n}: skipped, {skipped[n]}", file=out)
        else:
            chosen.append(WORKLOADS[n])
    if a.dataset:
        chosen.append(user_workload(a.dataset, a.batch_size))
    return chosen, skipped


def load_runs(a: argparse.Namespace, cores: int) -> Dict[str, Dict[str, Any]]:
    """The machine states measured: ``quiet`` (the main table) and each run
    under load asked for, with its ``num_workers`` and busy neighbours."""
    out: Dict[str, Dict[str, Any]] = {"quiet": {"workers": a.workers, "neighbours": 0}}
    if "oversubscribed" in a.under_load:
        out["oversubscribed"] = {"workers": 2 * cores, "neighbours": 0,
                                 "what": f"{2 * cores} workers on {cores} cores (2x)"}
    if "neighbour" in a.under_load:
        out["neighbour"] = {"workers": a.workers, "neighbours": cores,
                            "what": f"{a.workers} workers + {cores} busy processes"}
    return out
