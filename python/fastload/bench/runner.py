"""Running the measured processes: one child process per run, never two
measuring at once, and the CPU-burning neighbours of the loaded runs.

Runs never overlap: the next run's process is started (interpreter, torch,
dataset) once this run has written its result, but told to go only when this
run's process and all its workers are gone (:func:`run_children`). The
child's code is :mod:`fastload.bench.child`.

A run whose spec asks for ``neighbours`` gets that many busy-looping
processes (:class:`Neighbours`) from just before its "go" until its result is
out: the machine is then as loaded as one shared with other people's test
suites. They are killed and reaped before the next run starts, and each
also exits by itself as soon as the process that started it is gone, so
even a benchmark killed with SIGKILL leaves none behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from .memory import MemSampler, group_running

CHILD = "from fastload.bench.child import child_main; child_main()"

# One busy neighbour: pure-Python spinning, checking about every 20 ms that
# the benchmark that started it is still there.
BUSY_LOOP = ("import os\n"
             "parent = os.getppid()\n"
             "while os.getppid() == parent:\n"
             "    for _ in range(200000):\n"
             "        pass\n")


class Neighbours:
    """``n`` processes that burn a CPU each, for a ``with`` block: started on
    entry, killed and reaped on exit, whatever happened in between."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: List[subprocess.Popen] = []

    @property
    def pids(self) -> List[int]:
        """The neighbours' process ids (for checking they are gone)."""
        return [p.pid for p in self.procs]

    def __enter__(self) -> "Neighbours":
        try:
            for _ in range(self.n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-S", "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill and reap every neighbour started so far."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Child:
    """One run's process, seen from the parent: started ahead (its interpreter
    and imports overlap the previous run's teardown), told to go when the
    previous run's processes are all gone, memory sampled throughout.
    ``python``: the interpreter that runs it (another commit's venv, for
    :mod:`fastload.bench.ab`); ``cwd``: its working directory."""

    def __init__(self, spec: Dict[str, Any], python: str = sys.executable,
                 cwd: Optional[str] = None) -> None:
        self.spec = spec
        fd, self.out = tempfile.mkstemp(prefix="fastload-bench-", suffix=".json")
        os.close(fd)
        os.unlink(self.out)  # the child creates it, whole, when its result is ready
        self.log = tempfile.TemporaryFile()
        self.t_launch = time.time()
        # Its fork server starts with its loader, not at its import of
        # fastload (which every run, DataLoader's too, makes while it
        # waits for its "go"): a server importing torch beside a measured
        # run would load the machine, and the cold first batch is timed
        # from the loader's construction.
        env = dict(os.environ, FASTLOAD_SERVER_AT_IMPORT="0")
        self.p = subprocess.Popen([python, "-c", CHILD, json.dumps(spec), self.out], cwd=cwd,
                                  env=env,
                                  stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.mem = MemSampler(self.p.pid)
        self.mem.start()
        self.err: Optional[str] = None

    def go(self, timeout: float) -> None:
        """Let it measure; return when its result is out (or it died, or ``timeout``)."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(b"go\n")
            self.p.stdin.close()
        except OSError:
            pass  # it died already: finish() says how
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.out) and self.p.poll() is None:
            if time.monotonic() > deadline:
                self.err = f"timed out after {timeout:.0f} s"
                self.kill()
                return
            time.sleep(0.02)

    def kill(self) -> None:
        """Kill the run's whole process group and reap the run's process."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()

    def finish(self, grace: float = 30.0) -> Dict[str, Any]:
        """Wait for the process and everything it started to be gone; the result."""
        try:
            self.p.wait(grace)
        except subprocess.TimeoutExpired:
            self.err = self.err or f"did not exit within {grace:.0f} s of its result"
        deadline = time.monotonic() + 10
        while group_running(self.p.pid):  # its workers share its process group
            if time.monotonic() > deadline:
                self.kill()
                break
            time.sleep(0.05)
        self.p.wait()
        self.mem.stop()
        try:
            with open(self.out) as f:
                res = json.load(f)
            os.unlink(self.out)
        except (OSError, ValueError):
            res = {}
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-3000:]
        self.log.close()
        err = self.err
        if err is None and "error" not in res and self.p.returncode != 0:
            err = f"exit code {self.p.returncode}"
        if err is not None or "error" in res or not res:
            res = {"error": res.get("error") or err or "no result", "log": tail}
        else:
            res.update(self.mem.peak(res["t_start"], res["t_end"]))
            # where the wall time of a run goes, for the curious
            res["wall_s"] = {"start_python_torch": res["t_main"] - self.t_launch,
                             "run": res["t_done"] - res["t_go"], "exit": time.time() - res["t_done"]}
            if tail.strip():
                res["log"] = tail
        res["kind"] = self.spec["kind"]
        return res


def run_children(specs: List[Dict[str, Any]], timeout: float,
                 on_start: Callable[[int], None], on_done: Callable[[int, Dict[str, Any]], None],
                 python_of: Optional[Callable[[int], str]] = None,
                 cwd: Optional[str] = None) -> None:
    """Run ``specs`` one after the other, never two measuring at once: run
    ``i + 1`` is started (imports) once run ``i`` has its result, and told to
    go once run ``i`` and all its processes are gone. ``python_of(i)``: the
    interpreter of run ``i`` (default: this one)."""

    def start(i: int) -> Child:
        return Child(specs[i], python_of(i) if python_of is not None else sys.executable, cwd)

    nxt: Optional[Child] = start(0) if specs else None
    cur: Optional[Child] = None
    try:
        for i in range(len(specs)):
            cur, nxt = nxt, None
            assert cur is not None
            on_start(i)
            with Neighbours(specs[i].get("neighbours", 0)) as busy:
                cur.go(timeout)
            neighbour_pids = busy.pids
            if i + 1 < len(specs):
                nxt = start(i + 1)
            res = cur.finish()
            cur = None
            if neighbour_pids:
                res["neighbour_pids"] = neighbour_pids
            on_done(i, res)
    finally:
        for c in (cur, nxt):
            if c is not None:
                c.kill()
                c.mem.stop()
