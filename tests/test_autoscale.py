"""``num_workers="auto"``'s rule (:class:`fastload.stats.autoscale.WorkerCountPolicy`)
on made-up windows, and the CPU clock it reads workers with."""

from __future__ import annotations

import os
import time

from fastload.stats.autoscale import (CpuClock, Window, WorkerCountPolicy, initial_workers,
                                worker_cap)


def _window(n: int, *, wait: float, busy: float, worker_cpu: float, main_cpu: float,
            wall: float = 0.3) -> Window:
    """A window of ``wall`` s: the loop waited ``wait`` of it, each of ``n``
    workers was busy ``busy`` of it and used ``worker_cpu`` cores."""
    return Window(wall_s=wall, wait_s=wait * wall, read_s=0.0, busy_s=busy * n * wall,
                  workers_cpu_s=worker_cpu * n * wall, main_cpu_s=main_cpu * wall, workers=n)


def test_io_bound_workers_double_past_the_cores() -> None:
    policy = WorkerCountPolicy(cores=2, cap=32)
    n = 2
    for _ in range(12):
        new = policy.decide(_window(n, wait=0.8, busy=0.97, worker_cpu=0.02, main_cpu=0.05))
        if new != n:
            assert new <= 2 * n
            policy.changed()
        n = new
    assert n == 32  # workers that sleep on I/O cost nothing: up to the cap


def test_cpu_bound_workers_stop_at_the_cores_the_loop_leaves() -> None:
    policy = WorkerCountPolicy(cores=2, cap=32)
    # one worker, a core's worth of CPU; the loop takes 0.1 core while waiting 70%
    assert policy.decide(_window(1, wait=0.7, busy=0.98, worker_cpu=0.97, main_cpu=0.1)) == 2
    policy.changed()
    assert policy.decide(_window(2, wait=0.5, busy=0.98, worker_cpu=0.97, main_cpu=0.1)) == 2  # skipped
    for _ in range(5):  # two workers take both cores: no third
        assert policy.decide(_window(2, wait=0.5, busy=0.98, worker_cpu=0.97,
                                     main_cpu=0.1)) == 2


def test_the_loop_s_own_cores_are_kept_for_it() -> None:
    # 8 cores; the loop computes on 4 of them between waits (2 cores' worth
    # of CPU over a window in which it waits half the time).
    policy = WorkerCountPolicy(cores=8, cap=32)
    n = policy.decide(_window(2, wait=0.5, busy=0.99, worker_cpu=1.0, main_cpu=2.0))
    assert n == 4  # 8 - 4 (the loop) - 2 (the workers) leaves 2 more
    policy.changed()
    policy.decide(_window(4, wait=0.2, busy=0.99, worker_cpu=1.0, main_cpu=3.2))  # skipped
    assert policy.decide(_window(4, wait=0.2, busy=0.99, worker_cpu=1.0, main_cpu=3.2)) == 4


def test_idle_workers_are_retired_one_at_a_time_after_three_windows() -> None:
    policy = WorkerCountPolicy(cores=8, cap=32)
    idle = dict(wait=0.0, busy=0.2, worker_cpu=0.2, main_cpu=1.0)
    assert [policy.decide(_window(4, **idle)) for _ in range(3)] == [4, 4, 3]
    assert policy.decide(_window(3, wait=0.2, busy=0.5, worker_cpu=0.5, main_cpu=1.0)) == 3
    one = WorkerCountPolicy(cores=8, cap=32)
    assert [one.decide(_window(1, **idle)) for _ in range(4)] == [1, 1, 1, 1]  # at least one


def test_a_waiting_loop_with_idle_workers_keeps_its_count() -> None:
    # The main process is the bound (workers idle while the loop waits):
    # more workers would not help.
    policy = WorkerCountPolicy(cores=8, cap=32)
    assert policy.decide(_window(4, wait=0.6, busy=0.3, worker_cpu=0.3, main_cpu=1.0)) == 4


def test_start_and_cap() -> None:
    assert initial_workers(2) == 2 and initial_workers(16) == 8 and initial_workers(64) == 8
    assert worker_cap(2, 1 << 20, 2, 4, 1024, memory_bytes=24 << 30) == 32
    assert worker_cap(64, 1 << 20, 2, 4, 1024, memory_bytes=1 << 40) == 64
    # 64 MiB slots, 3 per worker, a quarter of 8 GiB: 10 workers
    assert worker_cap(16, 64 << 20, 2, 4, 1024, memory_bytes=8 << 30) == 10
    assert worker_cap(16, 1 << 20, 2, 4, 40, memory_bytes=1 << 40) == 12  # the slot limit


def test_cpu_clock_reads_a_busy_process() -> None:
    clock = CpuClock()
    clock.used([os.getpid()])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:
        pass
    used = clock.used([os.getpid(), 2 ** 22 + 1])  # a pid that does not exist counts 0
    assert 0.05 <= used <= 1.0
