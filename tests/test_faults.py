"""Seeded fault injection with real worker processes.

A scenario runs several epochs of a deterministic map-style dataset
(``support.faults.Pattern``: ``dataset[i]`` is a function of ``i``) through a
FastLoader with two workers, and injects faults into some epochs at points
drawn from a seeded ``random.Random``:

* ``kill``:  the test SIGKILLs a worker (by pid) right after receiving a
  random batch;
* ``stop``:  the test SIGSTOPs a worker there, while it holds a task, and never
  resumes it: it makes no progress for longer than ``hang_timeout``;
* ``raise``: ``dataset[i]`` raises for one random index of the epoch;
* ``slow``:  a worker turns very slow for a few batches (the dataset sleeps,
  or the test SIGSTOPs it for ``hang_timeout / 2`` and resumes it); every
  batch still comes within ``hang_timeout``, so this must NOT be an error.

Every epoch is compared with what ``torch.utils.data.DataLoader`` gives for
the same generator seed. With worker restarts available ("restart" mode) an
epoch with a kill or stop must still deliver every index exactly once, in
order, with the right content, the worker being replaced once. Without
("default" mode) the right error must come, in time: ``kill`` ->
``RuntimeError`` naming the pid and the signal, ``stop`` -> ``WorkerHangError``
naming worker, pid, batch and indices, with its stack section. ``raise`` is
the same in both modes: the dataset's exception, wrapped as DataLoader wraps
it, naming the index, never retried, and the epoch goes on. Detection time is
measured from the injection to the exception (default mode) or to the
"restarting worker" warning (restart mode).

CI runs one seeded chain of epochs per mode (every kind once, in a seeded
order, plus clean epochs; one loader, so workers are spawned as rarely as
possible) and reports per kind, plus a worker stopped between two tasks.

Environment:

* ``FASTLOAD_FAULT_SEED`` (default 20240611): the seed; every assertion
  message starts with it and the scenario's parameters.
* ``FASTLOAD_SOAK_MINUTES=N``: ``test_soak`` runs random scenarios (1-3
  random faults, random mode, persistence, worker reuse, batch size, consumer
  pace, injection point, workers stopped between tasks too) for N minutes,
  checking for leaks after each; skipped when unset.
* ``FASTLOAD_FAULT_REPORT=path.json``: write a JSON summary (faults per kind,
  epochs, batches and indices checked, detection times per kind and mode).

The harness lives in ``tests/support``: ``fault_scenarios.py`` draws the
scenarios and writes the report, ``fault_harness.py`` runs them (injecting
the faults, running DataLoader beside, checking every epoch). A fault that
goes undetected cannot hang the suite (see ``fault_harness.py``).
"""

from __future__ import annotations

import os
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import pytest

from support import NW
from support.fault_harness import find_leaks, run_chain, run_scenario
from support.fault_scenarios import KINDS, SEED, STATS, Fault, Scenario, draw_soak, write_report
from support.processes import open_fds, shm_entries

SOAK_MINUTES = float(os.environ.get("FASTLOAD_SOAK_MINUTES", "0") or 0)
REPORT_PATH = os.environ.get("FASTLOAD_FAULT_REPORT") or None


@pytest.fixture(scope="module", autouse=True)
def _fault_report():
    yield
    if REPORT_PATH:
        write_report(REPORT_PATH)


@pytest.fixture(scope="module")
def restart_chain(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[str]]:
    return run_chain("restart", tmp_path_factory.mktemp("restart_chain"))


@pytest.fixture(scope="module")
def default_chain(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[str]]:
    return run_chain("default", tmp_path_factory.mktemp("default_chain"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.heavy
def test_restart_mode(restart_chain: Dict[str, List[str]], kind: str) -> None:
    """max_worker_restarts=2: the faulty epoch is whole, as DataLoader's."""
    assert not restart_chain[kind], "\n\n".join(restart_chain[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.heavy
def test_default_mode(default_chain: Dict[str, List[str]], kind: str) -> None:
    """max_worker_restarts=0: the right error, in time (slow: none)."""
    assert not default_chain[kind], "\n\n".join(default_chain[kind])


@pytest.mark.parametrize("mode", ["restart", "default"])
def test_chain_clean_epochs_and_no_leaks(request: pytest.FixtureRequest, mode: str) -> None:
    """The epochs around the faults are whole; nothing is left behind."""
    chain = request.getfixturevalue(f"{mode}_chain")
    problems = chain["clean"] + chain["leaks"]
    assert not problems, "\n\n".join(problems)


@pytest.mark.heavy
def test_stop_of_an_idle_worker(tmp_path: Path) -> None:
    """The training loop is slower than the workers, so a worker waits for its
    next task when it is stopped; the tasks the loop then sends it are never
    started. That is a hang too: the epoch cannot go on without them.
    (Default mode only, to save time: restart mode detects hangs the same way;
    the soak stops workers between tasks in both modes.)"""
    rng = random.Random(f"{SEED}-idle")
    sc = Scenario(tag="test_stop_of_an_idle_worker", restarts=0, n=40, batch_size=4,
                  persistent=rng.random() < 0.5, reuse_workers=True,
                  gen_seed=rng.randrange(2**31), pace=0.0, faults=[
                      None,
                      # After batch 0, with every batch in flight made (settle),
                      # both workers wait for tasks; 10 batches: the loop sends
                      # the stopped one more.
                      Fault("stop", batch=0, victim=rng.randrange(NW), stop_at="anywhere",
                            settle=0.5),
                  ])
    run_scenario(sc, tmp_path / "ctl")


@pytest.mark.heavy
def test_kill_before_the_worker_took_its_session(tmp_path: Path) -> None:
    """Restart mode: a worker that dies before it read the session the pool
    sent it at iter() (the dataset's fd) is replaced like any other; nothing
    of its death reaches the training loop. Only a pool that keeps its
    processes between epochs sends a session to a live worker (under an
    explicit 'spawn'; a zygote pool's workers end with the epoch): one of its
    workers is stopped before iter() and SIGKILLed after."""
    rng = random.Random(f"{SEED}-early-kill")
    sc = Scenario(tag="test_kill_before_the_worker_took_its_session", restarts=1, n=40,
                  batch_size=4, persistent=False, reuse_workers=True,
                  gen_seed=rng.randrange(2**31), pace=0.0,
                  faults=[None, Fault("kill", batch=-1, victim=rng.randrange(NW),
                                      before_session=True), None], ctx="spawn")
    run_scenario(sc, tmp_path / "ctl")


@pytest.mark.skipif(not SOAK_MINUTES, reason="set FASTLOAD_SOAK_MINUTES=N to soak for N minutes")
def test_soak(tmp_path: Path) -> None:
    """Random scenarios for FASTLOAD_SOAK_MINUTES; every failed check is kept
    (the soak goes on) and all are reported at the end, grouped by fault kind."""
    deadline = time.monotonic() + SOAK_MINUTES * 60
    fds_before, shm_before = open_fds(), shm_entries()
    failures: Dict[str, List[str]] = defaultdict(list)
    i = 0
    while time.monotonic() < deadline:
        sc = draw_soak(random.Random(f"{SEED}-soak-{i}"), tag=f"test_soak round {i}")
        try:
            for kind, msgs in run_scenario(sc, tmp_path / f"ctl{i}", soft=True).items():
                failures[kind] += msgs
        except AssertionError as exc:  # not a check of one epoch: the scenario went wrong
            failures["scenario"].append(str(exc))
        leaks = find_leaks(sc, fds_before, shm_before)
        if leaks:
            failures["leaks"] += leaks
            STATS.failed.extend(leaks)
            fds_before, shm_before = open_fds(), shm_entries()  # report each leak once
        i += 1
    summary = {k: len(v) for k, v in failures.items() if v}
    print(f"soak: {i} scenarios, {STATS.epochs} epochs, faults {dict(STATS.faults)}, "
          f"failed checks {summary}")
    assert not summary, f"soak: {i} scenarios, failed checks by kind {summary}:\n\n" + "\n\n".join(
        f"[{k}] x{len(v)}, e.g.:\n" + "\n".join(v[:3]) for k, v in failures.items() if v)
