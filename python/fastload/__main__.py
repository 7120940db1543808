"""``python -m fastload run script.py [args...]``: a script with fastload installed.

The script (or ``-m module``) runs as ``python script.py args...`` would run
it, with ``sys.argv``, ``sys.path[0]`` and ``__main__`` set the same way,
after :func:`fastload.install`: every DataLoader with workers it builds,
itself or through a library, runs on fastload. Its exit status is this
command's. Options before the script set the install options, e.g.
``python -m fastload run --hang-timeout 60 train.py --lr 3e-4``.

``--report`` prints, when the script ends, a table per loader of its
epochs: how long the training loop waited for batches, how long workers
took to make them, how busy they were (see ``FastLoader.stats()``).

Processes the script starts as new interpreters (``torchrun``,
``torch.multiprocessing.spawn``) are not covered: ``FASTLOAD_INSTALL=1`` in
the environment is (see README).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Options of `run` that take a value: the script's own arguments start at
# the first word that is neither one of these (nor its value) nor a flag.
_VALUE_OPTIONS = ("--hang-timeout", "--held-batches", "--slot-bytes", "--max-worker-restarts",
                  "--device", "--num-workers")


def _seconds_or_none(text: str) -> Optional[float]:
    return None if text.lower() == "none" else float(text)


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastload run",
        usage="python -m fastload run [options] (script.py | -m module) [args ...]",
        description="Run a Python script or module with fastload.install() in effect.",
        argument_default=argparse.SUPPRESS,  # only the options given reach install()
    )
    p.add_argument("-m", dest="module", metavar="module",
                   help="run a library module as a script (as python -m does)")
    p.add_argument("--hang-timeout", type=_seconds_or_none, metavar="SECONDS",
                   help="seconds a worker may make no progress ('none': no watchdog)")
    p.add_argument("--held-batches", type=int, metavar="N")
    p.add_argument("--slot-bytes", type=int, metavar="BYTES")
    p.add_argument("--max-worker-restarts", type=int, metavar="N")
    p.add_argument("--device", metavar="DEVICE", help="device prefetch, e.g. cuda")
    p.add_argument("--no-reuse-workers", dest="reuse_workers", action="store_false",
                   help="start new worker processes every epoch")
    p.add_argument("--allow-gpu-in-workers", action="store_true")
    p.add_argument("--num-workers", choices=["auto"],
                   help="'auto': fastload chooses every loader's worker count as it runs")
    p.add_argument("--report", action="store_true",
                   help="when the script ends, print a table per loader (to stderr): how long "
                        "the loop waited for batches and what bounded it")
    return p


def _split(args: Sequence[str]) -> Tuple[List[str], Optional[str], List[str]]:
    """Our options, the script path (None with -m) and the script's arguments."""
    i = 0
    while i < len(args):
        word = args[i]
        if word == "-m" or (word.startswith("-m") and not word.startswith("--")):
            # as python -m: the module name ends our options, the rest is its
            n = 2 if word == "-m" else 1
            return list(args[: i + n]), None, list(args[i + n:])
        if word == "--":
            rest = args[i + 1:]
            return list(args[:i]), (rest[0] if rest else None), list(rest[1:])
        if not word.startswith("-") or word == "-":
            return list(args[:i]), word, list(args[i + 1:])
        i += 2 if word in _VALUE_OPTIONS else 1
    return list(args), None, []


def run(argv: Sequence[str]) -> None:
    """``run``'s arguments: options, then the script or ``-m module``, then its arguments."""
    parser = _run_parser()
    ours, script, rest = _split(argv)
    options: Dict[str, Any] = vars(parser.parse_args(ours))
    module: Optional[str] = options.pop("module", None)
    if (script is None) == (module is None):
        parser.error("give a script path or -m module (one of them)")

    report: bool = options.pop("report", False)
    import fastload

    try:
        fastload.install(**options)
    except ValueError as err:
        parser.error(str(err))
    if not report:
        _run_script(script, module, rest)
        return
    from .run_report import ReportHandler, format_report

    handler = ReportHandler()
    handler.attach()
    try:
        _run_script(script, module, rest)
    finally:
        handler.detach()
        sys.stderr.write(format_report(list(handler.meters.values())))
        sys.stderr.flush()


def _run_script(script: Optional[str], module: Optional[str], rest: List[str]) -> None:
    """Run ``script`` (or ``-m module``) as ``python`` would, with ``rest`` as its arguments."""
    if module is not None:
        # python -m: sys.path[0] is the current directory (already so for
        # `python -m fastload`); argv[0] becomes the module's file.
        sys.argv = [module, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        assert script is not None
        # python script.py: argv[0] as given, the script's directory first on
        # sys.path where ours (the current directory) was; -P adds neither.
        sys.argv = [script, *rest]
        if not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m fastload``; the script's ``SystemExit`` passes through."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m fastload",
        usage="python -m fastload [-h] run ...",
        description="fastload command line. `run`: a script with fastload.install() in effect "
                    "(python -m fastload run -h).",
    )
    parser.add_argument("command", choices=["run"])
    ns = parser.parse_args(args[:1])  # the rest is run's: its options and the script's
    if ns.command == "run":
        run(args[1:])
    return 0


if __name__ == "__main__":  # spawned processes may import this module: do nothing then
    sys.exit(main())
