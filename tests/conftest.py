"""Shared fixtures: every test is checked for leaked processes, fds and /dev/shm entries.

The helpers the tests themselves use live in ``tests/support/`` (see its
``__init__``). ``--quick`` leaves out the tests marked ``heavy`` (the
default group in about 4 minutes on 2 cores). Nothing here catches
KeyboardInterrupt: the first Ctrl-C stops the run, and the leak check of
the interrupted test is skipped rather than waited for.
"""

from __future__ import annotations

import signal

import pytest

# The fault-injection harness checks epochs with plain asserts, as a test
# module does: have pytest rewrite them the same way (it must know before
# the modules are imported).
pytest.register_assert_rewrite("support.fault_harness", "support.fault_checks",
                               "support.fault_injection")

from support.processes import fds_left, open_fds, shm_entries, wait_no_children  # noqa: E402


_interrupted = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="leave out the tests marked heavy (fastload: the default group in "
                          "about 4 minutes on 2 cores)")


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`pytest &` in a script) with SIGINT
    # ignored, and a process that ignores a signal passes that on to every
    # program it runs. The tests that press Ctrl-C on a training script
    # need it delivered as in a terminal, so the run takes Python's default.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not config.getoption("quick"):
        return
    heavy = [item for item in items if item.get_closest_marker("heavy")]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [item for item in items if not item.get_closest_marker("heavy")]


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo) -> None:
    global _interrupted
    _interrupted = True


@pytest.fixture(scope="session", autouse=True)
def _resource_tracker_running():
    """The first spawn starts multiprocessing's resource tracker, whose pipe
    stays open in this process for good: start it before any fd snapshot."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def _start_the_gpu_runtime() -> None:
    """The CUDA/ROCm runtime opens its device files, eventfds and pipes as it
    creates its context, its pinned host pool and its first events, and keeps
    them for the life of the process: do all three before a GPU test's fd
    snapshot, or the first GPU test is blamed for them."""
    import torch

    if torch.cuda.is_available():
        torch.zeros(1, device="cuda").add_(torch.ones(1).pin_memory().cuda(non_blocking=True))
        torch.cuda.Event(blocking=True).record()
        torch.cuda.synchronize()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """Fail a test that leaves a worker process, an fd or a /dev/shm entry
    behind (the fork server, which lives as long as this process, and its
    fds are not counted: see support.processes)."""
    if request.node.get_closest_marker("gpu"):
        _start_the_gpu_runtime()
    fds_before = open_fds()
    shm_before = shm_entries()
    yield
    if _interrupted:  # Ctrl-C: stop now, do not wait for the workers to go
        return
    kids = wait_no_children()
    assert not kids, f"worker processes left behind: {[(k.pid, k.cmdline()) for k in kids]}"
    targets = fds_left(fds_before)
    assert not targets, f"file descriptors left open: {targets}"
    shm_left = shm_entries() - shm_before
    assert shm_left == set(), f"/dev/shm entries left: {shm_left}"
