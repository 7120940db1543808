"""The fault-injection suite's scenarios (``tests/test_faults.py``): which
fault each epoch gets, drawn from a seeded ``random.Random``, the timings
the checks hold fastload to, and the figures the suite reports
(``FASTLOAD_FAULT_REPORT``).

Every draw depends only on ``FASTLOAD_FAULT_SEED`` and the name the test
seeds its generator with, so the scenario printed at the start of every
failed check (``str(Scenario)``) can be drawn again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
from collections import Counter, defaultdict
from typing import Any, Dict, List, Optional

from . import NW

SEED = int(os.environ.get("FASTLOAD_FAULT_SEED", "20240611"))

HT = 1.5  # hang_timeout of every scenario
DELAY_S = 0.01  # per sample: workers stay busy while the test consumes at full speed
# Bounds from injection to the exception (or the restart), generous for a
# noisy 2-core machine: liveness is polled every 0.1 s, a hang must last HT.
KILL_BOUND_S = 2.0
HANG_BOUND_S = HT + 2.0
RAISE_BOUND_S = 2.0
RESCUE_AFTER_S = HT + 4.5  # a stopped worker still unnoticed then is resumed by the test
SCENARIO_LIMIT_S = 180.0  # last resort against a hang: the workers are SIGKILLed

KINDS = ("kill", "stop", "raise", "slow")


# ---------------------------------------------------------------------------
# statistics for FASTLOAD_FAULT_REPORT


class _Stats:
    def __init__(self) -> None:
        self.faults: Counter = Counter()
        self.scenarios = 0
        self.epochs = 0
        self.batches = 0
        self.indices = 0
        self.detect: Dict[str, List[float]] = defaultdict(list)
        self.slow_max_wait: List[float] = []
        self.failed: List[str] = []
        self.not_injected: List[str] = []  # soak: epochs whose fault the harness missed

    def as_json(self) -> Dict[str, Any]:
        def summary(xs: List[float]) -> Dict[str, Any]:
            return {"n": len(xs), "min": round(min(xs), 3),
                    "median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}

        return {
            "seed": SEED,
            "hang_timeout_s": HT,
            "num_workers": NW,
            "scenarios": self.scenarios,
            "faults_injected": dict(sorted(self.faults.items())),
            "epochs_run": self.epochs,
            "batches_checked": self.batches,
            "indices_checked": self.indices,
            "detection_s": {k: summary(v) for k, v in sorted(self.detect.items()) if v},
            "detection_note": "<kind>/default: injection -> exception in the training loop "
                              "(raise: from the dataset's raise); <kind>/restart: injection -> "
                              "'restarting worker' warning",
            "slow_longest_batch_wait_s": summary(self.slow_max_wait) if self.slow_max_wait else None,
            "failures": self.failed,
            "not_injected": self.not_injected,
        }


STATS = _Stats()


def write_report(path: str) -> None:
    """Write the figures gathered so far to ``path``, as JSON."""
    with open(path, "w") as f:
        json.dump(STATS.as_json(), f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------
# scenarios


@dataclasses.dataclass
class Fault:
    kind: str  # kill | stop | raise | slow
    # kill/stop/slow: injected right after batch ``batch`` of the epoch arrives
    # (-1: right after iter()); raise: the batch that holds the bad index.
    batch: int
    victim: int  # kill/stop/slow: the worker id
    raise_pos: int = 0  # raise: position of the bad index in its batch
    slow_how: str = "sleep"  # slow: "sleep" (the dataset sleeps) or "pause" (SIGSTOP for HT/2)
    # stop: "in_hand" stops the worker at a moment it holds a task (retrying
    # at later batches if need be); "anywhere" as it is, maybe between tasks.
    stop_at: str = "in_hand"
    settle: float = 0.0  # seconds the loop waits just before injecting (workers go idle)
    # kill at batch -1 of a pool that keeps its workers (explicit spawn): SIGSTOP
    # the victim before iter(), so that it dies without having read the
    # session iter() sends it.
    before_session: bool = False


@dataclasses.dataclass
class Scenario:
    tag: str  # which test / soak round drew it
    restarts: int  # max_worker_restarts
    n: int
    batch_size: int
    persistent: bool
    reuse_workers: bool
    gen_seed: int
    pace: float  # seconds the training loop spends per batch
    faults: List[Optional[Fault]]  # one entry per epoch
    ctx: Optional[str] = None  # multiprocessing_context

    @property
    def epochs(self) -> int:
        return len(self.faults)

    @property
    def num_batches(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def __str__(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if f.name not in ("tag", "faults"))
        faults = "; ".join(f"epoch {e}: {fault_str(f)}" for e, f in enumerate(self.faults) if f)
        return f"[FASTLOAD_FAULT_SEED={SEED} {self.tag}: {fields}; {faults}]"


def fault_str(f: Fault) -> str:
    s = f"{f.kind} after batch {f.batch} worker {f.victim}"
    if f.kind == "raise":
        s = f"raise in batch {f.batch} position {f.raise_pos}"
    elif f.kind == "slow":
        s += f" ({f.slow_how})"
    elif f.kind == "stop":
        s += f" ({f.stop_at})"
    if f.before_session:
        s += " (stopped before iter())"
    return s + (f" settle {f.settle}" if f.settle else "")


def draw_fault(rng: random.Random, kind: str, num_batches: int, batch_size: int,
               soak: bool = False) -> Fault:
    if kind == "raise":
        batch = rng.randrange(num_batches)
    else:
        # Injected after batch k, the loop still sends the victim new tasks
        # (batches k+5 and k+6 go out as k+1 and k+2 are taken; k+6 is the
        # last one that must exist): the epoch cannot end without it. The
        # soak also injects right after iter(), while the workers start
        # their session.
        batch = rng.randrange(-1 if soak else 0, num_batches - 2 * NW - 2)
    return Fault(
        kind=kind,
        batch=batch,
        victim=rng.randrange(NW),
        raise_pos=rng.randrange(batch_size),
        slow_how=rng.choice(["sleep", "pause"]),
        stop_at=rng.choice(["in_hand", "in_hand", "anywhere"]) if soak else "in_hand",
        settle=rng.choice([0.0, 0.0, 0.0, 0.5]) if soak else 0.0,
    )


def draw_chain(rng: random.Random, mode: str) -> Scenario:
    """CI: every kind once, in a seeded order, between a clean first and last epoch."""
    batch_size = rng.choice([3, 4, 5])
    n = rng.randrange(32, 49)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    if mode == "default":
        # A dead or hung worker ends the loader's pool: put those faults last,
        # so that new workers are spawned only once, for the second of them
        # (its epoch's first batches show that the loader recovers).
        kinds.sort(key=lambda k: k in ("kill", "stop"))
    nb = math.ceil(n / batch_size)
    faults: List[Optional[Fault]] = [None]
    faults += [draw_fault(rng, k, nb, batch_size) for k in kinds]
    if mode == "restart":
        faults.append(None)  # a last, clean epoch
    return Scenario(
        tag=f"chain[{mode}]",
        restarts=2 if mode == "restart" else 0,  # a kill and a stop per iterator at most
        n=n,
        batch_size=batch_size,
        # Default mode: after a dead or hung worker a persistent loader is done
        # for, a non-persistent one starts new workers at the next epoch.
        persistent=rng.random() < 0.5 if mode == "restart" else False,
        reuse_workers=True,
        gen_seed=rng.randrange(2**31),
        pace=0.0,
        faults=faults,
    )


def draw_soak(rng: random.Random, tag: str) -> Scenario:
    batch_size = rng.choice([2, 3, 4, 5])
    n = rng.randrange(7 * batch_size + 1, 12 * batch_size + 1)
    nb = math.ceil(n / batch_size)
    epochs = rng.randint(2, 5)
    faults: List[Optional[Fault]] = [None] * epochs
    for e in rng.sample(range(epochs), rng.randint(1, min(3, epochs))):
        faults[e] = draw_fault(rng, rng.choice(KINDS), nb, batch_size, soak=True)
    return Scenario(
        tag=tag,
        restarts=rng.choice([0, 1, 2]),
        n=n,
        batch_size=batch_size,
        persistent=rng.random() < 0.5,
        reuse_workers=rng.random() < 0.8,
        gen_seed=rng.randrange(2**31),
        pace=rng.choice([0.0, 0.0, 0.0, 0.01, 0.05]),
        faults=faults,
    )

