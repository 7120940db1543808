"""Checking one epoch of the fault-injection suite against DataLoader
(``tests/test_faults.py``, run by :mod:`support.fault_harness`).

An :class:`Epoch` holds what the epoch gave (its outcomes, each ``next()``'s
time, fastload's log, what the injector did) and what DataLoader gives for
the same generator seed; one ``check_*`` function per kind of epoch (clean,
a dataset error, a slow worker, a restart, a fatal death or hang) raises
:class:`AssertionError` naming the scenario, the epoch and what differs.
The times it measures go to :data:`support.fault_scenarios.STATS`.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch

from fastload import WorkerHangError

from . import NW
from .fault_injection import Injector
from .fault_scenarios import (HANG_BOUND_S, HT, KILL_BOUND_S, RAISE_BOUND_S, RESCUE_AFTER_S,
                              STATS, Fault, Scenario, fault_str)
from .faults import WIDTH, InjectedFault, sample
from .processes import wait_pids_gone

Outcome = Tuple[Any, ...]  # ("ok", tensor) | ("err", type, message, monotonic time)


def indices(batch: torch.Tensor) -> List[int]:
    """The sample indices of a ``Pattern`` batch (each row starts with its index)."""
    return [int(x) for x in batch[:, 0]]


def expected_content(idx: List[int]) -> torch.Tensor:
    """The batch ``Pattern`` makes of samples ``idx``."""
    return torch.stack([sample(i) for i in idx])


def restarts_logged(items: List[Tuple[float, str]]) -> List[Tuple[float, str]]:
    """The worker restarts among fastload's log records."""
    return [(t, m) for t, m in items if "restarting worker" in m]


def raised_log(ctl: Path) -> List[Tuple[int, float]]:
    """(index, time) of each ``dataset[index]`` that raised, as ``Pattern`` logs them."""
    path = ctl / "raised.log"
    if not path.exists():
        return []
    return [(int(a), float(b)) for a, b in (line.split() for line in path.read_text().splitlines())]


class Epoch:
    """What one epoch of the scenario produced, for the checks."""

    def __init__(self, sc: Scenario, e: int, fault: Optional[Fault], got: List[Outcome],
                 waits: List[float], ref: List[Outcome], inj: Injector,
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


def _injected(ep: Epoch) -> Fault:
    """The epoch's fault, which must have been injected (else NotInjected)."""
    assert ep.fault is not None
    if ep.inj.t_inject is None:
        raise NotInjected(f"{ep.where}: the fault was never injected")
    return ep.fault


def check_ok_batches(ep: Epoch, got: List[Outcome], ref: List[Outcome]) -> None:
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
        if not torch.equal(b, expected_content(indices(b))):
            raise ep.fail(f"batch {j} has wrong content: {b.tolist()}")
        if not torch.equal(b, rb):
            raise ep.fail(f"batch {j} is indices {indices(b)}, DataLoader gives {indices(rb)}")
        STATS.batches += 1
        STATS.indices += len(b)


def check_complete_epoch(ep: Epoch, missing: Tuple[int, ...] = ()) -> None:
    got, ref = ep.got, ep.ref
    if not any(r[0] == "err" for r in ref):
        errs = [(g[1].__name__, g[2][:500]) for g in got if g[0] == "err"]
        if errs:
            raise ep.fail(f"unexpected error(s): {errs}")
    if len(got) != len(ref):
        raise ep.fail(f"{len(got)} outcomes, DataLoader gives {len(ref)}: "
                      f"{[indices(g[1]) if g[0] == 'ok' else g[1].__name__ for g in got]}")
    check_ok_batches(ep, got, ref)
    seen = sorted(i for g in got if g[0] == "ok" for i in indices(g[1]))
    want = sorted(set(range(ep.sc.n)) - set(missing))
    if seen != want:
        raise ep.fail(f"indices not delivered exactly once: missing {sorted(set(want) - set(seen))}, "
                      f"duplicated {sorted(i for i, c in Counter(seen).items() if c > 1)}")


def check_no_restart(ep: Epoch) -> None:
    if restarts_logged(ep.logs):
        raise ep.fail(f"unexpected worker restart: {restarts_logged(ep.logs)}")


def check_rescue(ep: Epoch) -> None:
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


def check_raise_epoch(ep: Epoch, mode: str) -> None:
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
                           - {j for r in ref if r[0] == "ok" for j in indices(r[1])}))
    check_complete_epoch(ep, missing=missing)
    check_no_restart(ep)
    raised = raised_log(ep.ctl)
    (ep.ctl / "raised.log").unlink(missing_ok=True)
    if [j for j, _ in raised] != [i]:
        raise ep.fail(f"dataset[{i}] ran {len(raised)} times (raised.log {raised}); a dataset "
                      f"exception must not be retried")
    took = t_err - raised[0][1]
    STATS.detect[f"raise/{mode}"].append(took)
    if took >= RAISE_BOUND_S:
        raise ep.fail(f"the exception reached the loop {took:.2f} s after dataset[{i}] raised "
                      f"(bound {RAISE_BOUND_S} s)")


def check_slow_epoch(ep: Epoch) -> None:
    f, inj = _injected(ep), ep.inj
    check_complete_epoch(ep)
    check_no_restart(ep)
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


def check_restart_epoch(ep: Epoch) -> None:
    f, inj = _injected(ep), ep.inj
    check_rescue(ep)
    check_complete_epoch(ep)
    restarts = restarts_logged(ep.logs)
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


def check_fatal_epoch(ep: Epoch, it: Any) -> None:
    f, inj, got, ref = _injected(ep), ep.inj, ep.got, ep.ref
    check_rescue(ep)
    if not got or got[-1][0] != "err":
        raise ep.fail(f"the epoch ended without an error ({len(got)} batches, "
                      f"DataLoader {len(ref)})")
    *oks, (_, typ, msg, t_err) = got
    if len(oks) >= len(ref):
        raise ep.fail(f"{len(oks)} batches, then the error: {msg[:300]}")
    check_ok_batches(ep, oks, ref)  # what came before the error: in order, whole
    check_no_restart(ep)
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
            if b % NW != f.victim or b >= len(ref) or named != indices(ref[b][1]):
                raise ep.fail(f"the message names batch {b} {named}; DataLoader's batch {b} is "
                              f"{indices(ref[b][1]) if b < len(ref) else None}, by worker {b % NW}")
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
    check_error_repeats(ep, lambda: next(it), "next() after the error")


def check_error_repeats(ep: Epoch, call: Callable[[], Any], what: str) -> None:
    """``call`` (a later ``next()``, a persistent loader's next ``iter()``)
    raises the epoch's error again, naming the victim, at once."""
    t = time.monotonic()
    try:
        call()
    except RuntimeError as again:
        if str(ep.inj.victim_pid) not in str(again) or time.monotonic() - t > 1.0:
            raise ep.fail(f"{what}: {again}")
    else:
        raise ep.fail(f"{what} raised nothing")
