"""Running the fault-injection suite's scenarios (``tests/test_faults.py``).

:func:`run_scenario` runs the epochs of a
:class:`~support.fault_scenarios.Scenario` through a FastLoader, has
:class:`~support.fault_injection.Injector` inject each epoch's fault (SIGKILL
or SIGSTOP a worker, make the dataset raise or run slow), and checks each
epoch (:mod:`support.fault_checks`) against what
``torch.utils.data.DataLoader`` gives for the same generator seed
(:class:`_Reference`). :func:`run_chain` runs one mode's seeded chain of
epochs (what CI runs); :func:`find_leaks` says what a scenario left behind.
The figures go to :data:`support.fault_scenarios.STATS`.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader

from fastload import FastLoader
from fastload.debug import debug_view
from fastload.loader import STATE_ATTR

from . import NW
from .fault_checks import (Epoch, NotInjected, Outcome, check_complete_epoch,
                           check_error_repeats, check_fatal_epoch, check_no_restart,
                           check_raise_epoch, check_restart_epoch, check_slow_epoch, indices,
                           restarts_logged)
from .fault_injection import Injector, Rescue, touch
from .fault_scenarios import (DELAY_S, HT, SCENARIO_LIMIT_S, SEED, STATS, Scenario, draw_chain,
                              fault_str)
from .faults import Pattern
from .processes import fds_left, open_fds, shm_entries, wait_no_children


class _LogRecords(logging.Handler):
    """fastload's log records with the monotonic time they were emitted at."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.items: List[Tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.items.append((time.monotonic(), record.getMessage()))


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
    touch(marker)
    try:
        dl = DataLoader(Pattern(n, ctl=str(ctl)), batch_sampler=batches, num_workers=NW,
                        multiprocessing_context="fork")
        return _consume(iter(dl), lambda k: None, (), 0.0)[0]
    finally:
        marker.unlink()
        (ctl / "raised.log").unlink(missing_ok=True)
        gc.collect()


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
    inj = Injector(sc, ctl)
    logs = _LogRecords()
    fl_log = logging.getLogger("fastload")
    fl_log.addHandler(logs)
    rescue = Rescue(inj)
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
                raise_index = indices(bad_batch)[min(fault.raise_pos, len(bad_batch) - 1)]
                ref = reference_with_raise(sc.n, [indices(r[1]) for r in ref], ctl, raise_index)
            raise_marker = ctl / f"raise-{raise_index}"
            if raise_index is not None:
                touch(raise_marker)
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
            ep = Epoch(sc, e, fault, got, waits, ref, inj, logs.items[log_mark:], ctl,
                        raise_index)
            restarts_used += len(restarts_logged(ep.logs))
            ended = False
            try:
                if fault is None:
                    check_complete_epoch(ep)
                    check_no_restart(ep)
                elif fault.kind == "raise":
                    check_raise_epoch(ep, "restart" if sc.restarts else "default")
                elif fault.kind == "slow":
                    check_slow_epoch(ep)
                elif mode == "restart":
                    check_restart_epoch(ep)
                else:
                    ended = sc.persistent  # a persistent loader that lost a worker is done for
                    check_fatal_epoch(ep, it)
                    if sc.persistent:
                        check_error_repeats(ep, lambda: iter(loader),
                                            "a later epoch of the failed persistent loader")
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
            if state is not None and state.pools.idle_pool is not None:
                state.pools.idle_pool.shutdown()
        it = None
        loader = None
        gc.collect()


def find_leaks(sc: Scenario, fds_before: set, shm_before: set) -> List[str]:
    """What the scenario left behind: processes, fds, /dev/shm entries."""
    out = []
    kids = wait_no_children()
    if kids:
        out.append(f"{sc}: processes left: {[(k.pid, k.cmdline()) for k in kids]}")
    targets = fds_left(fds_before)
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


