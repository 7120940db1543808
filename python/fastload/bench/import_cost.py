"""What starting the fork server at ``import fastload`` costs a script that never makes a loader.

    python -m fastload.bench.import_cost [--rounds 5] [--setup-s 0,1.5]

Each run is a fresh interpreter running a script that imports torch, then
fastload, spends ``setup_s`` seconds of single-threaded work (a model
build) and exits without making a loader: once as fastload starts it (its
fork server starts at the import, imports torch in the background, and is
stopped at exit) and once with ``FASTLOAD_SERVER_AT_IMPORT=0`` (no server),
alternating. Reported: medians of ``import fastload``'s time in the
script, of the script's wall time (from the interpreter's start to its
exit, as its parent sees it), of the CPU time of the script and every
process it started (``RUSAGE_CHILDREN``), and of the CPU time the server
used before the script's exit stopped it, for each set-up time. The server
imports torch on another core; where no core is free (a machine loaded by
other work) it takes its CPU time from the script and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from .fresh import print_and_save

SCRIPT = """\
import json, os, sys, time
import torch
t0 = time.perf_counter()
import fastload
from fastload.launching.fork_server import fork_server_pid
t1 = time.perf_counter()

t = time.perf_counter()
x = 0
while time.perf_counter() - t < float(sys.argv[1]):
    x += 1
pid = fork_server_pid(True)
cpu = 0.0
if pid is not None:  # what the server used until now; it is stopped at exit
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print(json.dumps({"import_s": t1 - t0, "server_cpu_s": cpu}), flush=True)
"""

MODES = ("server", "none")  # started at import; FASTLOAD_SERVER_AT_IMPORT=0


def _run(script: str, mode: str, setup_s: float) -> Dict[str, float]:
    env = dict(os.environ)
    env.pop("FASTLOAD_INSTALL", None)
    env["FASTLOAD_SERVER_AT_IMPORT"] = "1" if mode == "server" else "0"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, script, str(setup_s)], check=True, env=env,
                         cwd=os.path.dirname(script), timeout=300, capture_output=True,
                         text=True).stdout
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(out.strip().splitlines()[-1])}


def measure_import_cost(rounds: int = 5, setups: List[float] = [0.0, 1.5]) -> Dict[str, Any]:
    """Interleaved runs of both modes for each set-up time; medians in seconds."""
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {
        f"{s:g}": {m: [] for m in MODES} for s in setups}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "never_a_loader.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        for r in range(rounds):
            for s in setups:
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    runs[f"{s:g}"][mode].append(_run(script, mode, s))
    keys = ("wall_s", "cpu_s", "import_s", "server_cpu_s")
    median = {s: {m: {k: statistics.median(x[k] for x in runs[s][m]) for k in keys}
                  for m in MODES} for s in runs}
    return {"rounds": rounds, "runs": runs, "median": median}


def report_lines(res: Dict[str, Any]) -> str:
    lines = [f"\nA script that imports fastload and never makes a loader: medians of "
             f"{res['rounds']} rounds, seconds ('server': started at the import; 'none': "
             "FASTLOAD_SERVER_AT_IMPORT=0)",
             f"{'set-up s':>9}{'import fastload':>17}{'wall of the script':>20}"
             f"{'CPU, all processes':>20}{'server CPU':>12}",
             f"{'':>9}{'server':>9}{'none':>8}{'server':>10}{'none':>10}{'server':>10}{'none':>10}"
             f"{'by exit':>12}"]
    for s, m in res["median"].items():
        a, b = m["server"], m["none"]
        lines.append(f"{s:>9}{a['import_s']:>9.3f}{b['import_s']:>8.3f}{a['wall_s']:>10.3f}"
                     f"{b['wall_s']:>10.3f}{a['cpu_s']:>10.3f}{b['cpu_s']:>10.3f}"
                     f"{a['server_cpu_s']:>12.2f}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--setup-s", default="0,1.5", help="comma-separated set-up times (default 0,1.5)")
    p.add_argument("--json", default=None, help="write the runs and medians as JSON")
    a = p.parse_args(argv)
    res = measure_import_cost(a.rounds, [float(x) for x in a.setup_s.split(",")])
    print_and_save(report_lines(res), res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
