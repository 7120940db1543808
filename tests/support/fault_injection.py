"""Injecting the fault-injection suite's faults into a FastLoader's workers
(``tests/test_faults.py``, run by :mod:`support.fault_harness`).

:class:`Injector` sends an epoch's fault (SIGKILL or SIGSTOP a worker, make
the dataset raise or run slow through a marker file, see
:class:`support.faults.Pattern`), remembers what it did and when, and
undoes what must not outlive the scenario. A fault that goes undetected
cannot hang the suite: :class:`Rescue`, a thread, SIGCONTs a stopped worker
``RESCUE_AFTER_S`` after the stop (the epoch then fails, saying so), and
SIGKILLs the loader's workers after ``SCENARIO_LIMIT_S``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, List, Optional

import psutil

from fastload.debug import debug_view

from .fault_scenarios import HT, RESCUE_AFTER_S, SCENARIO_LIMIT_S, Fault, Scenario
from .processes import children


def touch(path: Path) -> None:
    path.write_text("")


def our_child(pid: int) -> bool:
    """``pid`` is a process this test started (directly, or through a helper
    process that starts workers): safe to signal, not a recycled pid."""
    try:
        return any(c.pid == pid for c in psutil.Process().children(recursive=True))
    except psutil.NoSuchProcess:
        return False


class Injector:
    """Sends an epoch's fault, remembers what it did, and undoes what must
    not outlive the scenario (stopped processes, markers, timers)."""

    def __init__(self, sc: Scenario, ctl: Path) -> None:
        self.sc = sc
        self.ctl = ctl
        self.stopped: List[int] = []  # pids this scenario stopped and nobody resumed yet
        self.timers: List[threading.Timer] = []
        self.lock = threading.Lock()
        self.start_epoch(None)

    def start_epoch(self, fault: Optional[Fault]) -> None:
        self.fault = fault
        self.t_inject: Optional[float] = None
        self.inject_batch: Optional[int] = None  # after which batch it happened
        self.victim_pid: Optional[int] = None
        self.pool_pids: List[int] = []
        self.resumed_after: Optional[float] = None  # pause: when the SIGCONT went out
        self.rescued_after: Optional[float] = None  # stop: when the rescue resumed it
        self.slow_marker: Optional[Path] = None

    def inject(self, it: Any, k: int) -> None:
        """Inject the fault now (after batch ``k`` arrived); a stop "in_hand"
        may wait for a later batch, until the victim holds a task."""
        f = self.fault
        if f is None or self.t_inject is not None:
            return
        pids = list(debug_view(it).worker_pids)
        pid = pids[f.victim]
        assert our_child(pid), f"{self.sc} worker {f.victim} (pid {pid}) is not ours"
        if f.kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif f.kind == "stop":
            with self.lock:
                self.stopped.append(pid)
            if f.stop_at == "in_hand":
                if not self._stop_in_hand(it, pid):
                    return
            else:
                os.kill(pid, signal.SIGSTOP)
        elif f.kind == "slow" and f.slow_how == "sleep":
            self.slow_marker = self.ctl / f"slow-{f.victim}"
            touch(self.slow_marker)
        elif f.kind == "slow":
            with self.lock:
                self.stopped.append(pid)
            os.kill(pid, signal.SIGSTOP)
            timer = threading.Timer(HT / 2, self._resume, args=(pid, time.monotonic()))
            timer.daemon = True
            self.timers.append(timer)
            timer.start()
        else:  # pragma: no cover
            raise AssertionError(f.kind)
        self.t_inject = time.monotonic()
        self.inject_batch = k
        self.pool_pids = pids
        self.victim_pid = pid

    def _stop_in_hand(self, it: Any, pid: int, patience: float = 0.25) -> bool:
        """SIGSTOP the victim at a moment it holds a task: once the process is
        stopped, read the ring's record of the task in its hands; between two
        tasks, resume it and try again a moment later (False: not within
        ``patience`` seconds; the caller tries again after the next batch)."""
        assert self.fault is not None
        give_up = time.monotonic() + patience
        ring = debug_view(it).ring
        while True:
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 2.0
            while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
                assert time.monotonic() < deadline, f"{self.sc}: pid {pid} does not stop"
                time.sleep(0.001)
            if ring.worker_current_seq(self.fault.victim) is not None:
                return True
            os.kill(pid, signal.SIGCONT)
            if time.monotonic() > give_up:
                return False
            time.sleep(0.003)

    def hold(self, pid: int) -> None:
        """SIGSTOP ``pid`` (a worker of an idle pool) until the fault is injected."""
        with self.lock:
            self.stopped.append(pid)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 2.0
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, f"{self.sc}: pid {pid} does not stop"
            time.sleep(0.001)

    def _resume(self, pid: int, t_stop: float) -> None:
        with self.lock:
            if pid in self.stopped and our_child(pid):
                os.kill(pid, signal.SIGCONT)
                self.stopped.remove(pid)
                self.resumed_after = time.monotonic() - t_stop

    def victim_slowed(self) -> bool:
        """The slowed worker has made at least one slow sample."""
        log = self.ctl / "slowed.log"
        assert self.fault is not None
        return log.exists() and any(line.split()[1] == str(self.fault.victim)
                                    for line in log.read_text().splitlines())

    def end_slow(self) -> None:
        if self.slow_marker is not None:
            self.slow_marker.unlink(missing_ok=True)
            self.slow_marker = None

    def resume_all(self) -> List[int]:
        """SIGCONT every worker this scenario stopped that still runs."""
        resumed = []
        with self.lock:
            for pid in self.stopped:
                if our_child(pid):
                    try:
                        os.kill(pid, signal.SIGCONT)
                        resumed.append(pid)
                    except ProcessLookupError:
                        pass
            self.stopped = []
        return resumed

    def cleanup(self) -> None:
        for t in self.timers:
            t.cancel()
            t.join()
        self.end_slow()
        self.resume_all()


class Rescue(threading.Thread):
    """Turns a fault that nobody notices into a failed check, not a hung suite."""

    def __init__(self, inj: Injector) -> None:
        super().__init__(daemon=True)
        self.inj = inj
        self.t0 = time.monotonic()
        self.done = threading.Event()
        self.killed = False  # the scenario ran past SCENARIO_LIMIT_S

    def run(self) -> None:
        inj = self.inj
        while not self.done.wait(0.1):
            now = time.monotonic()
            t, f = inj.t_inject, inj.fault
            if (f is not None and f.kind == "stop" and t is not None and inj.rescued_after is None
                    and now - t > RESCUE_AFTER_S and inj.resume_all()):
                inj.rescued_after = now - t
            if not self.killed and now - self.t0 > SCENARIO_LIMIT_S:
                self.killed = True
                inj.resume_all()
                for kid in children():  # this test's descendants, but multiprocessing's helpers
                    try:
                        kid.kill()
                    except psutil.NoSuchProcess:
                        pass

    def stop(self) -> None:
        self.done.set()
        self.join()
