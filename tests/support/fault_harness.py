"""Running the fault-injection suite's scenarios (``tests/test_faults.py``).

:func:`run_scenario` runs the epochs of a
:class:`~support.fault_scenarios.Scenario` through a FastLoader, injects
each epoch's fault (:class:`_Injector`: SIGKILL or SIGSTOP a worker, make
the dataset raise or run slow), and checks each epoch against what
``torch.utils.data.DataLoader`` gives for the same generator seed
(:class:`_Reference`) with the ``_check_*`` functions, one per kind of
epoch. :func:`run_chain` runs one mode's seeded chain of epochs (what CI
runs); :func:`find_leaks` says what a scenario left behind. The figures go
to :data:`support.fault_scenarios.STATS`.

A fault that goes undetected cannot hang the suite: a rescue thread
(:class:`_Rescue`) SIGCONTs a stopped worker ``RESCUE_AFTER_S`` after the
stop (the epoch then fails, saying so), and SIGKILLs the loader's workers
after ``SCENARIO_LIMIT_S``.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import psutil
import torch
from torch.utils.data import DataLoader

from fastload import FastLoader, WorkerHangError
from fastload.debug import debug_view
from fastload.loader import STATE_ATTR

from . import NW
from .fault_scenarios import (DELAY_S, HANG_BOUND_S, HT, KILL_BOUND_S, RAISE_BOUND_S,
                              RESCUE_AFTER_S, SCENARIO_LIMIT_S, SEED, STATS, Fault, Scenario,
                              draw_chain, fault_str)
from .faults import WIDTH, InjectedFault, Pattern, sample
from .processes import children, open_fds, shm_entries, wait_no_children, wait_pids_gone


Outcome = Tuple[Any, ...]  # ("ok", tensor) | ("err", type, message, monotonic time)


def _touch(path: Path) -> None:
    path.write_text("")


def _our_child(pid: int) -> bool:
    """``pid`` is a process this test started (directly, or through a helper
    process that starts workers): safe to signal, not a recycled pid."""
    try:
        return any(c.pid == pid for c in psutil.Process().children(recursive=True))
    except psutil.NoSuchProcess:
        return False


def _indices(batch: torch.Tensor) -> List[int]:
    return [int(x) for x in batch[:, 0]]


def _expected_content(idx: List[int]) -> torch.Tensor:
    return torch.stack([sample(i) for i in idx])


class _LogRecords(logging.Handler):
    """fastload's log records with the monotonic time they were emitted at."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.items: List[Tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.items.append((time.monotonic(), record.getMessage()))


def _restarts(items: List[Tuple[float, str]]) -> List[Tuple[float, str]]:
    return [(t, m) for t, m in items if "restarting worker" in m]


class _Injector:
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
        assert _our_child(pid), f"{self.sc} worker {f.victim} (pid {pid}) is not ours"
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
            _touch(self.slow_marker)
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
            if pid in self.stopped and _our_child(pid):
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
                if _our_child(pid):
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


class _Rescue(threading.Thread):
    """Turns a fault that nobody notices into a failed check, not a hung suite."""

    def __init__(self, inj: _Injector) -> None:
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


def _consume(it: Any, on_batch: Callable[[int], None], fatal_kinds: Tuple[type, ...],
             pace: float, limit: int = 1000) -> Tuple[List[Outcome], List[float]]:
    """Run one epoch like a training loop that survives dataset errors.

    Returns the outcomes and how long each ``next()`` took. Stops at the
    first exception of ``fatal_kinds`` (a dead or hung worker ends the epoch),
    and after ``limit`` outcomes (an iterator that fails for good raises at
    every ``next()``). Exceptions are not kept: their tracebacks would keep
    the iterator alive.
    """
    out: List[Outcome] = []
    waits: List[float] = []
    k = 0
    while len(out) < limit:
        t = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            return out, waits
        except fatal_kinds as exc:
            out.append(("err", type(exc), str(exc), time.monotonic()))
            return out, waits
        except Exception as exc:  # noqa: BLE001 - the dataset's exception; the epoch goes on
            out.append(("err", type(exc), str(exc), time.monotonic()))
            waits.append(time.monotonic() - t)
            continue
        waits.append(time.monotonic() - t)
        out.append(("ok", batch.clone()))
        del batch
        if pace:
            time.sleep(pace)
        on_batch(k)
        k += 1
    out.append(("err", AssertionError, f"no StopIteration after {limit} outcomes", time.monotonic()))
    return out, waits


class _Reference:
    """What torch's DataLoader gives, epoch by epoch, for the same generator seed.

    num_workers=0 draws from the generator exactly as a non-persistent
    multi-worker loader does over a whole epoch; a persistent one draws its
    workers' base seed once, so it needs real (forked, cheap) workers. An
    epoch that a dead or hung worker cut short is replayed by :meth:`cut`.
    """

    def __init__(self, sc: Scenario, ctl: Path) -> None:
        self.sc = sc
        self.ds = Pattern(sc.n, ctl=str(ctl))
        self.gen = torch.Generator().manual_seed(sc.gen_seed)
        kw: Dict[str, Any] = {}
        if sc.persistent:
            kw = dict(num_workers=NW, persistent_workers=True, multiprocessing_context="fork")
        self.dl: Any = DataLoader(self.ds, batch_size=sc.batch_size, shuffle=True,
                                  generator=self.gen, **kw)
        self.state: Optional[torch.Tensor] = None

    def epoch(self) -> List[Outcome]:
        self.state = self.gen.get_state()
        return _consume(iter(self.dl), lambda k: None, (), 0.0)[0]

    def cut(self, received: int) -> None:
        """The last epoch ended, as an error ends it, after ``received``
        batches: redo it so with DataLoader (whose workers prefetch as
        FastLoader's do): the sampler draws from the generator at its start
        and again when exhausted, so where an epoch stops matters to the next."""
        assert not self.sc.persistent and self.state is not None
        self.gen.set_state(self.state)
        dl = DataLoader(self.ds, batch_size=self.sc.batch_size, shuffle=True, generator=self.gen,
                        num_workers=NW, multiprocessing_context="fork")
        it = iter(dl)
        for _ in range(received):
            next(it)
        del it, dl
        gc.collect()

    def close(self) -> None:
        self.dl = None
        gc.collect()


def reference_with_raise(n: int, batches: List[List[int]], ctl: Path,
                         raise_index: int) -> List[Outcome]:
    """DataLoader's outcomes, with NW workers, for these batches while
    ``dataset[raise_index]`` raises (from a worker, its exception comes
    wrapped, naming the worker). A batch_sampler replays the epoch's order:
    a persistent DataLoader whose worker raised takes 10 s to shut down."""
    marker = ctl / f"raise-{raise_index}"
    _touch(marker)
    try:
        dl = DataLoader(Pattern(n, ctl=str(ctl)), batch_sampler=batches, num_workers=NW,
                        multiprocessing_context="fork")
        return _consume(iter(dl), lambda k: None, (), 0.0)[0]
    finally:
        marker.unlink()
        (ctl / "raised.log").unlink(missing_ok=True)
        gc.collect()


def _raised_log(ctl: Path) -> List[Tuple[int, float]]:
    path = ctl / "raised.log"
    if not path.exists():
        return []
    return [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines())]


# ---------------------------------------------------------------------------
# checks of one epoch


class _Epoch:
    """What one epoch of the scenario produced, for the checks."""

    def __init__(self, sc: Scenario, e: int, fault: Optional[Fault], got: List[Outcome],
                 waits: List[float], ref: List[Outcome], inj: _Injector,
                 logs: List[Tuple[float, str]], ctl: Path, raise_index: Optional[int]) -> None:
        self.sc, self.e, self.fault, self.got, self.waits, self.ref = sc, e, fault, got, waits, ref
        self.inj, self.logs, self.ctl, self.raise_index = inj, logs, ctl, raise_index
        what = fault_str(fault) if fault else "no fault"
        if fault is not None and inj.victim_pid is not None:
            what += f", pid {inj.victim_pid}, injected after batch {inj.inject_batch}"
        self.where = f"{sc} epoch {e} ({what})"

    def fail(self, msg: str) -> AssertionError:
        return AssertionError(f"{self.where}: {msg}")


class NotInjected(AssertionError):
    """The test could not inject its fault in this epoch."""


def _check_ok_batches(ep: _Epoch, got: List[Outcome], ref: List[Outcome]) -> None:
    """Every "ok" outcome: DataLoader's batch at the same position, content checked."""
    for j, (g, r) in enumerate(zip(got, ref)):
        if g[0] != r[0]:
            raise ep.fail(f"outcome {j} is {g[0]!r} ({g[1] if g[0] == 'err' else ''}), "
                          f"DataLoader gives {r[0]!r}")
        if g[0] != "ok":
            continue
        b, rb = g[1], r[1]
        if b.dtype != torch.int64 or tuple(b.shape[1:]) != (WIDTH,):
            raise ep.fail(f"batch {j} has dtype {b.dtype} shape {tuple(b.shape)}")
        if not torch.equal(b, _expected_content(_indices(b))):
            raise ep.fail(f"batch {j} has wrong content: {b.tolist()}")
        if not torch.equal(b, rb):
            raise ep.fail(f"batch {j} is indices {_indices(b)}, DataLoader gives {_indices(rb)}")
        STATS.batches += 1
        STATS.indices += len(b)


def _check_complete_epoch(ep: _Epoch, missing: Tuple[int, ...] = ()) -> None:
    got, ref = ep.got, ep.ref
    if not any(r[0] == "err" for r in ref):
        errs = [(g[1].__name__, g[2][:500]) for g in got if g[0] == "err"]
        if errs:
            raise ep.fail(f"unexpected error(s): {errs}")
    if len(got) != len(ref):
        raise ep.fail(f"{len(got)} outcomes, DataLoader gives {len(ref)}: "
                      f"{[_indices(g[1]) if g[0] == 'ok' else g[1].__name__ for g in got]}")
    _check_ok_batches(ep, got, ref)
    seen = sorted(i for g in got if g[0] == "ok" for i in _indices(g[1]))
    want = sorted(set(range(ep.sc.n)) - set(missing))
    if seen != want:
        raise ep.fail(f"indices not delivered exactly once: missing {sorted(set(want) - set(seen))}, "
                      f"duplicated {sorted(i for i, c in Counter(seen).items() if c > 1)}")


def _check_no_restart(ep: _Epoch) -> None:
    if _restarts(ep.logs):
        raise ep.fail(f"unexpected worker restart: {_restarts(ep.logs)}")


def _check_rescue(ep: _Epoch) -> None:
    """A stopped worker that the test had to resume: the hang went unnoticed."""
    inj = ep.inj
    if inj.rescued_after is None:
        return
    later = "the epoch then ended without an error"
    if ep.got and ep.got[-1][0] == "err":
        later = (f"then came {ep.got[-1][1].__name__} {ep.got[-1][3] - inj.t_inject:.1f} s after "
                 f"the stop: {ep.got[-1][2][:300]!r}")
    raise ep.fail(
        f"the SIGSTOPped worker was noticed neither by a WorkerHangError (no restarts left) nor "
        f"by a restart within {RESCUE_AFTER_S:.1f} s (hang_timeout={HT}); the test resumed it "
        f"(SIGCONT) after {inj.rescued_after:.1f} s; {later}. fastload's log: "
        f"{[m[:200] for _, m in ep.logs]}")


def _check_raise_epoch(ep: _Epoch, mode: str) -> None:
    assert ep.fault is not None and ep.raise_index is not None
    got, ref, i = ep.got, ep.ref, ep.raise_index
    errs = [(j, g) for j, g in enumerate(got) if g[0] == "err"]
    ref_errs = [(j, r) for j, r in enumerate(ref) if r[0] == "err"]
    assert len(ref_errs) == 1 and ref_errs[0][0] == ep.fault.batch, f"{ep.where} DataLoader: {ref_errs}"
    if [j for j, _ in errs] != [ep.fault.batch]:
        raise ep.fail(f"errors at outcomes {[(j, g[1].__name__, g[2][:300]) for j, g in errs]}; "
                      f"DataLoader raises at batch {ep.fault.batch} only")
    _, (_, typ, msg, t_err) = errs[0]
    _, (_, rtyp, rmsg, _) = ref_errs[0]
    if not typ is rtyp is InjectedFault:
        raise ep.fail(f"{typ.__name__} raised, DataLoader raises {rtyp.__name__}: {msg}")
    pat = r"Caught InjectedFault in DataLoader worker process (\d+)"
    wno, rwno = re.search(pat, msg), re.search(pat, rmsg)
    if not (wno and rwno and wno.group(1) == rwno.group(1)):
        raise ep.fail(f"message {msg!r}; DataLoader's: {rmsg!r}")
    if f"injected fault at index {i}" not in msg or "Original Traceback" not in msg \
            or "support/faults.py" not in msg:
        raise ep.fail(f"the message lacks the index or the worker's traceback: {msg}")
    missing = tuple(sorted(set(range(ep.sc.n))
                           - {j for r in ref if r[0] == "ok" for j in _indices(r[1])}))
    _check_complete_epoch(ep, missing=missing)
    _check_no_restart(ep)
    raised = _raised_log(ep.ctl)
    (ep.ctl / "raised.log").unlink(missing_ok=True)
    if [j for j, _ in raised] != [i]:
        raise ep.fail(f"dataset[{i}] ran {len(raised)} times (raised.log {raised}); a dataset "
                      f"exception must not be retried")
    took = t_err - raised[0][1]
    STATS.detect[f"raise/{mode}"].append(took)
    if took >= RAISE_BOUND_S:
        raise ep.fail(f"the exception reached the loop {took:.2f} s after dataset[{i}] raised "
                      f"(bound {RAISE_BOUND_S} s)")


def _check_slow_epoch(ep: _Epoch) -> None:
    f, inj = ep.fault, ep.inj
    assert f is not None
    if inj.t_inject is None:
        raise NotInjected(f"{ep.where}: the fault was never injected")
    _check_complete_epoch(ep)
    _check_no_restart(ep)
    if f.slow_how == "sleep":
        log = ep.ctl / "slowed.log"
        slowed = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        if not any(line.split()[1] == str(f.victim) for line in slowed):
            raise ep.fail(f"the worker never ran slow (slowed.log: {slowed})")
    elif inj.resumed_after is None or inj.resumed_after < HT / 2 - 0.05:
        raise ep.fail(f"the pause did not happen as planned (resumed after {inj.resumed_after})")
    assert inj.inject_batch is not None
    # (not the first batch of the epoch: it may wait for new workers)
    STATS.slow_max_wait.append(max(ep.waits[max(1, inj.inject_batch + 1):], default=0.0))


def _check_restart_epoch(ep: _Epoch) -> None:
    f, inj = ep.fault, ep.inj
    assert f is not None
    if inj.t_inject is None:
        raise NotInjected(f"{ep.where}: the fault was never injected")
    _check_rescue(ep)
    _check_complete_epoch(ep)
    restarts = _restarts(ep.logs)
    if len(restarts) != 1 or f"restarting worker {f.victim} " not in restarts[0][1]:
        raise ep.fail(f"restarts logged: {restarts} (want one, of worker {f.victim})")
    took = restarts[0][0] - inj.t_inject
    STATS.detect[f"{f.kind}/restart"].append(took)
    bound = KILL_BOUND_S if f.kind == "kill" else HANG_BOUND_S
    if took >= bound:
        raise ep.fail(f"the restart came {took:.2f} s after the fault (bound {bound} s)")
    if f.kind == "stop":
        hung = [m for _, m in ep.logs if "hung on" in m]
        if not hung or f"(pid {inj.victim_pid})" not in hung[0]:
            raise ep.fail(f"no 'hung on' warning naming pid {inj.victim_pid}: {ep.logs}")
    assert inj.victim_pid is not None
    if wait_pids_gone([inj.victim_pid], 5.0):
        raise ep.fail(f"the replaced worker (pid {inj.victim_pid}) still runs")


def _check_fatal_epoch(ep: _Epoch, it: Any) -> None:
    f, inj, got, ref = ep.fault, ep.inj, ep.got, ep.ref
    assert f is not None
    if inj.t_inject is None:
        raise NotInjected(f"{ep.where}: the fault was never injected")
    _check_rescue(ep)
    if not got or got[-1][0] != "err":
        raise ep.fail(f"the epoch ended without an error ({len(got)} batches, "
                      f"DataLoader {len(ref)})")
    *oks, (_, typ, msg, t_err) = got
    if len(oks) >= len(ref):
        raise ep.fail(f"{len(oks)} batches, then the error: {msg[:300]}")
    _check_ok_batches(ep, oks, ref)  # what came before the error: in order, whole
    _check_no_restart(ep)
    took = t_err - inj.t_inject
    STATS.detect[f"{f.kind}/default"].append(took)
    if f.kind == "kill":
        if typ is not RuntimeError or not re.search(
                rf"DataLoader worker \(pid {inj.victim_pid}\) is killed by signal: Killed", msg):
            raise ep.fail(f"{typ.__name__}: {msg}")
        bound = KILL_BOUND_S
    else:
        if typ is not WorkerHangError or not issubclass(typ, RuntimeError):
            raise ep.fail(f"{typ.__name__}: {msg}")
        if f"DataLoader worker {f.victim} (pid {inj.victim_pid}) made no progress" not in msg \
                or f"hang_timeout={HT}" not in msg:
            raise ep.fail(f"the message does not name the worker, its pid, hang_timeout: {msg}")
        m = re.search(r"on batch (\d+) of this epoch \(indices \[([^\]]*)\]\)", msg)
        if m:
            b = int(m.group(1))
            named = [int(x) for x in m.group(2).split(",")]
            if b % NW != f.victim or b >= len(ref) or named != _indices(ref[b][1]):
                raise ep.fail(f"the message names batch {b} {named}; DataLoader's batch {b} is "
                              f"{_indices(ref[b][1]) if b < len(ref) else None}, by worker {b % NW}")
        elif "its session set-up" not in msg:
            raise ep.fail(f"the message names no batch: {msg}")
        # The stack section: faulthandler's dump, or the note that the worker
        # did not answer (a stopped process cannot run its signal handler).
        if "Its Python stack:" not in msg:
            raise ep.fail(f"no stack section: {msg}")
        bound = HANG_BOUND_S
    if took >= bound:
        raise ep.fail(f"{typ.__name__} came {took:.2f} s after the fault (bound {bound} s): "
                      f"{msg[:300]}")
    # The epoch is over: its workers are gone and later next() calls repeat the error.
    left = wait_pids_gone(inj.pool_pids, 5.0)
    if left:
        raise ep.fail(f"workers {left} still run after the error")
    t = time.monotonic()
    try:
        next(it)
    except RuntimeError as again:
        if str(inj.victim_pid) not in str(again) or time.monotonic() - t > 1.0:
            raise ep.fail(f"next() after the error: {again}")
    else:
        raise ep.fail("next() after the error gave a batch")


# ---------------------------------------------------------------------------
# one scenario


def run_scenario(sc: Scenario, ctl: Path, soft: bool = False) -> Dict[str, List[str]]:
    """Run ``sc``; return the failed checks by fault kind ("clean": epochs
    without a fault). Not ``soft``: raise at the first failed check."""
    print(f"scenario {sc}")
    ctl.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    failures: Dict[str, List[str]] = defaultdict(list)
    try:
        _run_scenario(sc, ctl, failures, soft)
    except BaseException as exc:
        STATS.failed.append(str(exc)[:2000])
        raise
    finally:
        print(f"  took {time.monotonic() - t_start:.1f} s")
    return failures


def _run_scenario(sc: Scenario, ctl: Path, failures: Dict[str, List[str]], soft: bool) -> None:
    STATS.scenarios += 1
    reference = _Reference(sc, ctl)
    slow_s = HT / 2 / sc.batch_size  # a slowed batch takes ~HT/2: slow, never hung
    loader: Any = FastLoader(
        Pattern(sc.n, ctl=str(ctl), delay=DELAY_S, slow_s=slow_s), batch_size=sc.batch_size,
        shuffle=True, generator=torch.Generator().manual_seed(sc.gen_seed), num_workers=NW,
        persistent_workers=sc.persistent, reuse_workers=sc.reuse_workers,
        hang_timeout=HT, max_worker_restarts=sc.restarts, multiprocessing_context=sc.ctx,
    )
    inj = _Injector(sc, ctl)
    logs = _LogRecords()
    fl_log = logging.getLogger("fastload")
    fl_log.addHandler(logs)
    rescue = _Rescue(inj)
    rescue.start()
    it: Any = None
    restarts_used = 0  # by the current iterator, as fastload logged them
    finished = False
    try:
        for e, fault in enumerate(sc.faults):
            inj.start_epoch(fault)
            ref = reference.epoch()
            raise_index = None
            if fault is not None and fault.kind == "raise":
                bad_batch = ref[fault.batch][1]
                raise_index = _indices(bad_batch)[min(fault.raise_pos, len(bad_batch) - 1)]
                ref = reference_with_raise(sc.n, [_indices(r[1]) for r in ref], ctl, raise_index)
            raise_marker = ctl / f"raise-{raise_index}"
            if raise_index is not None:
                _touch(raise_marker)
            if not sc.persistent:
                restarts_used = 0  # the budget is per iterator
            mode = "default"
            if fault is not None and fault.kind in ("kill", "stop") and restarts_used < sc.restarts:
                mode = "restart"
            dies = fault is not None and fault.kind in ("kill", "stop")
            fatal = (RuntimeError,) if dies and mode == "default" else ()
            log_mark = len(logs.items)
            if fault is not None and fault.before_session:
                idle = debug_view(loader).idle_pool
                assert fault.batch == -1 and idle is not None, sc
                inj.hold(idle.pids[fault.victim])
            it = iter(loader)

            def on_batch(k: int) -> None:
                if fault is None or fault.kind == "raise" or k < fault.batch:
                    return
                if k == fault.batch and fault.settle:
                    time.sleep(fault.settle)
                inj.inject(it, k)
                if k >= fault.batch + 3 and inj.victim_slowed():
                    inj.end_slow()

            on_batch(-1)
            t_epoch = time.monotonic()
            try:
                got, waits = _consume(it, on_batch, fatal, sc.pace, limit=sc.num_batches + 3)
            finally:
                inj.end_slow()
                raise_marker.unlink(missing_ok=True)
            print(f"  epoch {e} ({fault_str(fault) if fault else 'clean'}, {mode}): "
                  f"{len(got)} outcomes in {time.monotonic() - t_epoch:.2f} s"
                  f"{', injected after batch %s' % inj.inject_batch if inj.t_inject else ''}")
            STATS.epochs += 1
            if fault is not None:
                STATS.faults[fault.kind] += 1
            if rescue.killed:
                raise AssertionError(f"{sc} epoch {e}: still running after {SCENARIO_LIMIT_S} s; "
                                     f"the test killed the workers")
            ep = _Epoch(sc, e, fault, got, waits, ref, inj, logs.items[log_mark:], ctl,
                        raise_index)
            restarts_used += len(_restarts(ep.logs))
            ended = False
            try:
                if fault is None:
                    _check_complete_epoch(ep)
                    _check_no_restart(ep)
                elif fault.kind == "raise":
                    _check_raise_epoch(ep, "restart" if sc.restarts else "default")
                elif fault.kind == "slow":
                    _check_slow_epoch(ep)
                elif mode == "restart":
                    _check_restart_epoch(ep)
                else:
                    ended = sc.persistent  # a persistent loader that lost a worker is done for
                    _check_fatal_epoch(ep, it)
                    if sc.persistent:
                        t = time.monotonic()
                        try:
                            iter(loader)
                        except RuntimeError as exc:
                            if str(inj.victim_pid) not in str(exc) or time.monotonic() - t > 1.0:
                                raise ep.fail(f"a later epoch: {exc}")
                        else:
                            raise ep.fail("a later epoch of the failed persistent loader starts")
            except NotInjected as exc:
                if not soft:
                    raise
                # The harness missed its moment (a stop "in_hand" needs the
                # victim caught holding a task): not a fault of fastload's.
                STATS.not_injected.append(str(exc)[:500])
            except AssertionError as exc:
                if not soft:
                    raise
                STATS.failed.append(str(exc)[:2000])
                failures[fault.kind if fault else "clean"].append(str(exc))
            if ended:
                break
            inj.resume_all()  # a failed stop check may leave one stopped
            if got and got[-1][0] == "err" and fatal:
                reference.cut(sum(1 for g in got if g[0] == "ok"))
        finished = True
    finally:
        reference.close()
        rescue.stop()
        inj.cleanup()
        fl_log.removeHandler(logs)
        if not finished:
            # The traceback of what went wrong keeps frames (and so the
            # iterator) alive: stop the workers here, so that one failure does
            # not spill into the leak check of the next test. (Otherwise the
            # loader's own clean-up, when it is dropped, is what is checked.)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
            # The warm pool too (stopping, not looking: past the debug view).
            state = getattr(loader, STATE_ATTR, None)
            if state is not None and state.idle_pool is not None:
                state.idle_pool.shutdown()
        it = None
        loader = None
        gc.collect()


def find_leaks(sc: Scenario, fds_before: set, shm_before: set) -> List[str]:
    """What the scenario left behind: processes, fds, /dev/shm entries."""
    out = []
    kids = wait_no_children()
    if kids:
        out.append(f"{sc}: processes left: {[(k.pid, k.cmdline()) for k in kids]}")
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        fds = {fd for fd in open_fds() - fds_before if os.path.exists(f"/proc/self/fd/{fd}")}
        if not fds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if fds:
        targets = {}
        for fd in fds:
            try:
                targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        if targets:
            out.append(f"{sc}: fds left open: {targets}")
    shm = shm_entries() - shm_before
    if shm:
        out.append(f"{sc}: /dev/shm entries left: {shm}")
    return out


# ---------------------------------------------------------------------------
# CI: one chain of epochs per mode, reported per fault kind


def run_chain(mode: str, ctl: Path) -> Dict[str, List[str]]:
    sc = draw_chain(random.Random(f"{SEED}-chain-{mode}"), mode)
    fds_before, shm_before = open_fds(), shm_entries()
    failures = run_scenario(sc, ctl, soft=True)
    failures["leaks"] = find_leaks(sc, fds_before, shm_before)
    STATS.failed.extend(failures["leaks"])
    return failures

