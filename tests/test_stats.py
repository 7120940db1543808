"""``FastLoader.stats()`` / ``fastload.stats()``: the loader's figures against
ground truth the test measures itself (never against wall-clock limits).

The loops here time each ``next()`` themselves; the loader's ``wait_share``
must agree with theirs within 0.05, for a data-bound loop (workers busy all
the time, the loop waiting) and for a loop-bound one (the loop's own work
dominating). Counts (batches, samples, copies, overflows, restarts) are
exact.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Tuple

import pytest
import torch
from torch.utils.data import DataLoader

import fastload
from fastload import FastLoader, LoaderStats
from fastload.stats.meter import EpochMeter, _bucket, _bucket_middle, _quantiles
from fastload.stats import loader_stats
from fastload.stats.loader_stats import SlowBatch, advice
from fastload.run_report import ReportHandler, format_report
from support.datasets import BigSample, Plain, Straggler
from support.faults import Misbehave


def _timed_epoch(loader: Any, step_s: float = 0.0) -> Tuple[float, float, int]:
    """One epoch as a training loop would time it: (time inside next(),
    wall time from the end of iter() to the last batch, batches). Batches
    are dropped as a training loop drops them."""
    it = iter(loader)
    t_start = time.perf_counter()
    waited = 0.0
    batches = 0
    while True:
        t0 = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t0
        del b
        batches += 1
        if step_s:
            time.sleep(step_s)  # the training step
    t_last = time.perf_counter()
    return waited, t_last - t_start, batches


# ---- the histogram ---------------------------------------------------------------------
def test_histogram_buckets_hold_each_value_within_a_32nd() -> None:
    for ns in [0, 1, 7, 15, 16, 17, 31, 32, 1000, 12345, 999_999, 10**9, 3 * 10**12]:
        mid = _bucket_middle(_bucket(ns))
        assert abs(mid - ns) <= max(0.5, ns / 32), (ns, mid)  # half a bucket: 1/32
    assert sorted(range(0, 5000, 7), key=_bucket) == list(range(0, 5000, 7))  # monotonic


def test_quantiles_are_nearest_rank() -> None:
    hist = [0] * 1024
    values = [i * 1_000_000 for i in range(1, 101)]  # 1..100 ms
    for v in values:
        hist[_bucket(v)] += 1
    p50, p95, p99 = _quantiles(hist, len(values), (0.5, 0.95, 0.99))
    assert p50 == pytest.approx(50, rel=0.03)
    assert p95 == pytest.approx(95, rel=0.03)
    assert p99 == pytest.approx(99, rel=0.03)
    assert _quantiles([0] * 1024, 0, (0.5,)) == [0.0]


# ---- ground truth ------------------------------------------------------------------------
def test_a_data_bound_loop_waits_as_the_loader_says(caplog: pytest.LogCaptureFixture) -> None:
    # Samples take 2 ms each in one of 2 workers: the loop (no step) waits
    # for nearly every batch and both workers are busy all the time.
    dl = FastLoader(Plain(192, delay=0.002), batch_size=8, num_workers=2)
    assert dl.stats() is None  # before the first iter()
    with caplog.at_level(logging.INFO, logger="fastload"):
        waited, wall, batches = _timed_epoch(dl)
    s = dl.stats()
    assert isinstance(s, LoaderStats) and s.finished and s.epoch == 0
    assert s.batches == batches == 24 and s.samples == 192
    assert abs(s.wait_share - waited / wall) <= 0.05, (s.wait_share, waited / wall)
    assert s.wait_share > 0.8
    assert s.workers == 2 and len(s.worker_busy_share) == 2
    assert min(s.worker_busy_share) > 0.8, s.worker_busy_share
    # each batch sleeps 8 x 2 ms in its worker: its make time is at least that
    assert s.make_ms.p50 >= 16.0 and s.make_ms.p50 <= s.make_ms.p95 <= s.make_ms.p99
    assert s.slowest is not None and s.slowest.make_ms >= s.make_ms.p99 * 0.97
    assert s.wait_ms.p50 <= s.wait_ms.p99
    assert s.copied_batches == s.overflow_batches == s.restarts == 0
    assert s.bytes_per_batch > 0
    # ... and the loader says so, once, at INFO
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload"]
    assert len(lines) == 1 and "data-bound" in lines[0] and "epoch 0" in lines[0], lines


def test_a_loop_bound_loop_hardly_waits_and_the_loader_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    # Samples are instant, the loop's step takes 10 ms: workers mostly idle.
    dl = FastLoader(Plain(96), batch_size=8, num_workers=2, persistent_workers=True)
    _timed_epoch(dl)  # the first epoch pays the workers' start
    with caplog.at_level(logging.INFO, logger="fastload"):
        waited, wall, _ = _timed_epoch(dl, step_s=0.010)
    s = fastload.stats(dl)
    assert s is not None and s.epoch == 1 and s.finished
    assert abs(s.wait_share - waited / wall) <= 0.05, (s.wait_share, waited / wall)
    assert s.wait_share < 0.10
    assert max(s.worker_busy_share) < 0.5
    assert s.start_s >= 0
    assert not [r for r in caplog.records if "waited" in r.getMessage()]


def test_an_epoch_in_progress_between_epochs_and_at_len() -> None:
    dl = FastLoader(Plain(10), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(dl)
    next(it)
    s = dl.stats()
    assert s is not None and not s.finished and s.batches == 1 and s.samples == 4
    # Lightning's loop stops after len(loader) batches and never asks for
    # the StopIteration: the epoch's figures are final at its last batch.
    for _ in range(len(dl) - 1):
        next(it)
    done = dl.stats()
    assert done is not None and done.finished and done.batches == 3
    assert done.samples == 10  # the short last batch counts its own
    time.sleep(0.05)
    assert dl.stats() == done  # frozen once ended
    d = done.as_dict()
    assert all(isinstance(v, float) for v in d.values())
    for key in ("epoch", "batches", "samples", "wall_s", "samples_per_s", "wait_s", "wait_share",
                "wait_ms_p50", "wait_ms_p95", "wait_ms_p99", "make_ms_p99", "workers",
                "worker_busy_share/0", "worker_busy_share/1", "copied_batches",
                "overflow_batches", "restarts", "bytes_per_batch"):
        assert key in d, key
    iter(dl)
    assert dl.stats().epoch == 1  # type: ignore[union-attr]
    unbatched = FastLoader(Plain(6), batch_size=None, num_workers=2)
    list(unbatched)
    assert unbatched.stats().samples == 6  # type: ignore[union-attr]


def test_copied_and_overflow_batches_are_counted() -> None:
    # held_batches=2 and every batch kept: batches past the second held one are copied.
    dl = FastLoader(Plain(32, width=4), batch_size=4, num_workers=2, held_batches=2)
    kept = list(dl)
    s = dl.stats()
    assert s is not None and s.batches == 8
    assert s.copied_batches == 8 - 2, s.copied_batches
    del kept
    # A batch bigger than its slot goes through an overflow segment.
    big = FastLoader(BigSample(8, numel=1 << 19), batch_size=2, num_workers=2,
                     slot_bytes=1 << 20)
    list(big)
    assert big.stats().overflow_batches == 4  # type: ignore[union-attr]


@pytest.mark.heavy
def test_restarts_are_counted(tmp_path: Any) -> None:
    ds = Misbehave(24, {9: "kill"}, once=os.fspath(tmp_path / "killed"))
    dl = FastLoader(ds, batch_size=2, num_workers=2, max_worker_restarts=1)
    got = [i for b in dl for i in b.tolist()]
    assert got == list(range(24))
    assert dl.stats().restarts == 1  # type: ignore[union-attr]


def test_single_process_loader_measures_its_own_making() -> None:
    dl = FastLoader(Plain(12, delay=0.001), batch_size=4, num_workers=0)
    waited, wall, _ = _timed_epoch(dl)
    s = dl.stats()
    assert s is not None and s.finished and s.workers == 0 and s.batches == 3
    assert s.samples == 12 and s.worker_busy_share == ()
    assert s.make_ms.p50 >= 4.0
    assert abs(s.wait_share - waited / wall) <= 0.05


def test_stats_of_loaders_under_install_and_of_plain_dataloaders() -> None:
    plain = DataLoader(Plain(8), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="does not run on fastload"):
        fastload.stats(plain)
    fastload.install()
    try:
        assert list(plain)
        s = fastload.stats(plain)
        assert s is not None and s.batches == 4 and s.samples == 8
    finally:
        fastload.uninstall()


# ---- what the loader says ----------------------------------------------------------------
@pytest.mark.heavy
def test_a_straggler_is_named_with_its_slowest_batch(caplog: pytest.LogCaptureFixture) -> None:
    dl = FastLoader(Straggler(64, delay=0.0, slow=0.02), batch_size=2, num_workers=2)
    with caplog.at_level(logging.INFO, logger="fastload"):
        _timed_epoch(dl)
    s = dl.stats()
    assert s is not None and s.slowest is not None and s.slowest.worker == 1
    p99 = s.worker_make_p99_ms
    assert p99[1] > 3 * p99[0]
    # batch n is made by worker n % 2: the slowest is one of worker 1's
    assert s.slowest.batch % 2 == 1
    assert s.slowest.indices == [2 * s.slowest.batch, 2 * s.slowest.batch + 1]
    lines = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert lines and "worker 1 is a straggler" in lines[0]
    assert f"batch {s.slowest.batch}" in lines[0]


def _stats(**kw: Any) -> LoaderStats:
    base = dict(epoch=0, finished=True, batches=100, samples=800, wall_s=10.0, samples_per_s=80.0,
                start_s=0.1, wait_s=5.0, wait_share=0.5,
                wait_ms=fastload.Percentiles(40.0, 60.0, 70.0),
                make_ms=fastload.Percentiles(90.0, 95.0, 99.0), read_s=0.1, workers=2,
                worker_busy_share=(0.95, 0.97), worker_make_p99_ms=(99.0, 98.0), slowest=None,
                copied_batches=0, pin_copied_batches=0, overflow_batches=0, restarts=0,
                bytes_per_batch=1e6)
    base.update(kw)
    return LoaderStats(**base)  # type: ignore[arg-type]


def test_advice_names_the_one_cause_of_each_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verdict of advice(), from made-up figures: the cause the figures
    point to, and what to try (num_workers="auto" where more workers help)."""
    monkeypatch.setattr(loader_stats, "cores_available", lambda: 4)
    # workers busy all the time, fewer than the cores: more workers, "auto"
    few = advice(_stats())
    assert "data-bound, the workers are the bound" in few
    assert "more workers would make batches faster (4 cores" in few
    assert 'num_workers="auto" picks the count' in few
    # ... as many as the cores: "auto" adds workers only if they wait on I/O
    full = advice(_stats(workers=4, worker_busy_share=(0.9,) * 4, worker_make_p99_ms=(99.0,) * 4))
    assert "already match the 4 cores" in full and 'num_workers="auto" measures' in full
    assert "more workers would" not in full
    # ... with num_workers="auto" already: the samples themselves
    auto = advice(_stats(), auto=True)
    assert 'num_workers="auto" had 2 workers at the epoch\'s end, on 4 cores' in auto
    assert "cheaper samples" in auto and "more workers would" not in auto
    # workers idle, the main process reading: what it copied, else unpickling
    idle = dict(worker_busy_share=(0.3, 0.2), read_s=3.0)
    copied = advice(_stats(copied_batches=7, pin_copied_batches=3, **idle))
    assert "main process is the bound" in copied and "3.00 s of the 5.00 s waited" in copied
    assert "7 of 100 batches were copied out of the ring" in copied and "held_batches" in copied
    assert "pinned" not in copied  # one cause: the first the figures show
    pinned = advice(_stats(pin_copied_batches=3, **idle))
    assert "3 batches were copied into pinned memory" in pinned
    overflow = advice(_stats(overflow_batches=5, **idle))
    assert "5 batches were bigger than a ring slot" in overflow and "slot_bytes" in overflow
    unpickle = advice(_stats(**idle))
    assert "main process is the bound" in unpickle and "unpickling" in unpickle
    # workers idle, the main process not reading: the workers had no tasks
    starved = advice(_stats(worker_busy_share=(0.3, 0.2), read_s=0.1))
    assert "ran out of tasks" in starved and "prefetch_factor" in starved
    assert "main process is the bound" not in starved and "num_workers" not in starved
    # a straggler, named with its slowest batch
    slow = SlowBatch(worker=1, make_ms=400.0, batch=9, indices=[18, 19])
    lag = advice(_stats(worker_make_p99_ms=(20.0, 390.0, 22.0), worker_busy_share=(0.5, 1, 0.5),
                        workers=3, slowest=slow))
    assert "worker 1 is a straggler" in lag and "samples [18, 19]" in lag
    # workers "auto" added near the epoch's end made no batch: neither
    # stragglers' peers nor idle workers
    grown = advice(_stats(workers=4, worker_busy_share=(0.95, 0.9, 0.0, 0.0),
                          worker_make_p99_ms=(99.0, 98.0, 0.0, 0.0)), auto=True)
    assert "straggler" not in grown and "had 4 workers at the epoch's end" in grown
    # ... and an epoch in which "auto" changed the count is not judged on its totals
    changed = advice(_stats(workers=4, worker_busy_share=(0.5, 0.4, 0.1, 0.1),
                            worker_make_p99_ms=(99.0, 98.0, 97.0, 99.0)), auto=True, started_with=2)
    assert "from 2 to 4 workers" in changed and "next epoch starts with 4" in changed
    assert "ran out of tasks" not in changed
    assert "too few batches" in advice(_stats(batches=3))
    none = advice(_stats(workers=0, worker_busy_share=()))
    assert "num_workers=0" in none and 'num_workers="auto"' in none


def test_printed_stats_are_a_few_lines_and_keep_every_figure() -> None:
    indices = list(range(1000, 1256))
    s = _stats(slowest=SlowBatch(worker=1, make_ms=400.0, batch=9, indices=indices))
    text = str(s)
    assert text == repr(s) and len(text.splitlines()) <= 6 and len(text) < 800, text
    assert text.startswith("LoaderStats(epoch 0: 100 batches, 800 samples in 10.00 s")
    assert "samples [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, ... 256 in all]" in text
    assert "1255" not in text
    assert s.slowest is not None and s.slowest.indices == indices  # the data stays whole
    assert "256 in all" in repr(s.slowest)
    assert dataclasses.is_dataclass(s) and s == _stats(slowest=s.slowest)
    many = str(_stats(workers=16, worker_busy_share=tuple(i / 16 for i in range(16)),
                      worker_make_p99_ms=(50.0,) * 16))
    assert "busy 0% to 94% (median 50%)" in many and len(many.splitlines()) <= 6


# ---- the report ----------------------------------------------------------------------------
def test_report_tables_every_loader_including_an_unfinished_epoch() -> None:
    handler = ReportHandler()
    handler.attach()
    try:
        a = FastLoader(Plain(16), batch_size=4, num_workers=2)
        list(a)
        list(a)
        b = FastLoader(Plain(16), batch_size=2, num_workers=2)
        it = iter(b)
        next(it)
    finally:
        handler.detach()
    text = format_report(list(handler.meters.values()))
    assert "loader 1: FastLoader(Plain, num_workers=2, batch_size=4)" in text
    assert "loader 2: FastLoader(Plain, num_workers=2, batch_size=2)" in text
    assert "0 (unfinished)" in text
    del it
    assert format_report([]).startswith("fastload report: no loader")
    assert isinstance(EpochMeter().stats(), LoaderStats)


@pytest.mark.slow
def test_run_report_prints_a_table_when_the_script_ends(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "dl = DataLoader(TensorDataset(torch.arange(64)), batch_size=8, num_workers=2)\n"
        "for epoch in range(2):\n"
        "    for batch in dl:\n"
        "        pass\n"
    )
    out = subprocess.run([sys.executable, "-m", "fastload", "run", "--report", str(script)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "fastload report, loader 1: DataLoader(TensorDataset, num_workers=2, batch_size=8)" \
        in out.stderr
    rows = [line for line in out.stderr.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2, out.stderr
    # --num-workers auto: every loader's count is fastload's to choose
    out = subprocess.run([sys.executable, "-m", "fastload", "run", "--report", "--num-workers",
                          "auto", str(script)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "DataLoader(TensorDataset, num_workers='auto', batch_size=8)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "fastload", "run", "--num-workers", "3",
                          str(script)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 2 and "invalid choice" in out.stderr
