"""The benchmark's extra tables: copy-on-read memory, the first epoch and host
to device (the last runs on a GPU only: ``tests/test_pinning.py``), and the
short-epoch benchmark's harness (its figures need a GPU).

Structure and bounded ratios only, never time: one small round of each."""

from __future__ import annotations

import io
from typing import Any, Dict

import pytest

from fastload.bench import (copy_on_read, first_epoch, first_minutes, h2d, held_data, import_cost,
                            short_epochs)

pytestmark = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create .* worker processes in total")


@pytest.mark.slow  # DataLoader spawn workers: fresh interpreters
def test_copy_on_read_measures_every_loader_and_fastload_shares_the_dataset():
    res = copy_on_read.measure_copy_on_read(n=300_000, workers=2, rounds=1)
    assert set(res["median"]) == {"fork", "spawn", "fastload_epoch1", "fastload_epoch2"}
    for name, m in res["median"].items():
        assert m["pss_mb"] > 0 and m["uss_mb"] > 0, (name, m)
    for run in res["runs"]["fastload"]:
        assert run["epoch1"]["workers"] == run["epoch2"]["workers"] == 2
    # Shared, as with fork: far below spawn, whose workers each unpickle a
    # copy and import torch (the test of the bound itself is in test_memory).
    text = copy_on_read.report_lines(res)
    for name in ("fastload_epoch1", "fastload_epoch2"):
        assert res["median"][name]["pss_mb"] < 0.8 * res["median"]["spawn"]["pss_mb"], text
        assert name in text


@pytest.mark.slow  # fresh interpreters, DataLoader spawn among them
def test_held_data_measures_every_loader_and_the_data_crosses_by_reference():
    res = held_data.measure_held_data(data_gib=0.25, rounds=1, workers=2,
                                      kinds=["array", "memmap"])
    assert set(res["median"]) == {"array", "memmap"}
    text = held_data.report_lines(res)
    for kind, by_loader in res["median"].items():
        assert set(by_loader) == set(held_data.LOADERS)
        for m in by_loader.values():
            assert m["peak_mb"] > 0 and 0 < m["first1_s"] and 0 < m["first2_s"] <= m["total_s"]
        # DataLoader(spawn) pickles the data into each worker; by reference
        # fastload stays far below it (the bound against fork is the
        # benchmark's: at this size the fork server's torch is most of it).
        assert by_loader["fastload"]["peak_mb"] < 0.8 * by_loader["spawn"]["peak_mb"], text
        assert kind in text


@pytest.mark.slow
def test_first_epoch_times_every_loader():
    res = first_epoch.measure_first_epoch(rounds=1, build_s=0.1, workers=1)
    assert set(res["median"]) == set(first_epoch.MODES)
    for mode, m in res["median"].items():
        assert 0 < m["epoch_s"] <= m["script_s"], (mode, m)
        assert res["vs_fork"][mode] > 0
    text = first_epoch.report_lines(res)
    assert all(mode in text for mode in first_epoch.MODES)


def test_extras_are_in_a_full_run_and_not_in_a_quick_one():
    from fastload.bench.options import EXTRAS, settings

    gpu = h2d.cuda_present()
    assert settings([]).extras == [e for e in EXTRAS if e != "h2d" or gpu]
    assert settings(["--extras", "h2d"]).extras == ["h2d"]
    assert settings(["--quick"]).extras == []
    assert settings(["--dataset", "m:f"]).extras == []
    assert settings(["--quick", "--extras", "memory"]).extras == ["memory"]
    with pytest.raises(SystemExit):
        settings(["--extras", "speed"])


def test_host_to_device_without_a_device_says_so_and_measures_nothing():
    from fastload.bench.cli import _Bench, _extras
    from fastload.bench.options import settings

    if h2d.cuda_present():
        pytest.skip("a device is present: tests/test_pinning.py runs the measure")
    a = settings(["--quick", "--extras", "h2d", "--workloads", "tiny"])
    b = _Bench(a, io.StringIO())
    assert _extras(a, b) == {}
    assert b.skipped["h2d"] == "needs a CUDA or ROCm device"
    assert h2d.main([]) == 2


@pytest.mark.slow
def test_first_minutes_times_every_loader_and_a_second_loader_starts_warm():
    """Every measure for every loader; a second loader's first batch comes
    from the running fork server, far sooner than spawn's fresh interpreters
    (a ratio in one run, not a time)."""
    res = first_minutes.measure_first_minutes(rounds=1, workers=2, build_s=0.1)
    assert res["measures"] == list(first_minutes.MEASURES)
    for what in first_minutes.MEASURES:
        assert set(res["median"][what]) == set(first_minutes.MODES)
        assert all(v > 0 for v in res["median"][what].values()), (what, res["median"][what])
    second = res["median"]["second"]
    assert second["fastload"] < 0.5 * second["spawn"], second
    later = res["median"]["later"]  # the first loader is gone; the fork server is not
    assert later["fastload"] < 0.5 * later["spawn"], later
    text = first_minutes.report_lines(res)
    assert all(first_minutes.LABELS[w] in text for w in first_minutes.MEASURES)


@pytest.mark.slow
def test_import_cost_runs_a_script_with_and_without_the_server_started_at_import():
    """The server starts at the script's import of fastload, and not with
    FASTLOAD_SERVER_AT_IMPORT=0; the table names both."""
    res = import_cost.measure_import_cost(rounds=1, setups=[0.5])
    (run,), (none,) = res["runs"]["0.5"]["server"], res["runs"]["0.5"]["none"]
    assert run["server_cpu_s"] > 0 and none["server_cpu_s"] == 0
    assert "FASTLOAD_SERVER_AT_IMPORT=0" in import_cost.report_lines(res)


@pytest.mark.slow
def test_short_epochs_runs_both_loaders_and_delivers_every_image():
    """The short-epoch benchmark's harness, on the CPU (its figures need a
    GPU): both loaders, every epoch's batches, every image, and fastload's
    own slot registrations timed (none without pinning)."""
    pytest.importorskip("PIL")
    res = short_epochs.measure(rounds=1, workers=2, epoch_batches=[3], epochs=2, batch_size=4,
                               device="cpu")
    assert res["correct"]
    by_mode = res["median"]["3"]
    assert set(by_mode) == set(short_epochs.MODES)
    assert all(m["batches"] == 3 for m in by_mode.values()), by_mode
    assert by_mode["fastload"]["register_calls"] == 0 and "register_s" not in by_mode["DataLoader"]
    assert "3 b" in short_epochs.report_lines(res)


def test_auto_workers_table_judges_against_the_best_fixed_count() -> None:
    from fastload.bench.auto_workers import report_lines

    def m(rate: float, workers: float, step: Any = None) -> Dict[str, Any]:
        return {"rate": rate, "workers": workers, "step_ms": step}

    res = {"rounds": 2, "seconds": 6.0, "tables": {
        "io": {"median": {"1": m(190, 1), "2": m(380, 2), "16": m(2900, 16), "32": m(5500, 32),
                          "auto": m(5200, 31)}},
        "cpu": {"median": {"1": m(900, 1, 5.0), "2": m(1000, 2, 5.4), "auto": m(850, 1, 5.1)}},
    }}
    text = report_lines(res)
    assert "0.95x the best fixed count (32) (>= 0.9x ok)" in text
    assert "13.7x num_workers=2 (>= 3x ok)" in text
    assert "0.85x the best fixed count (2) (>= 0.9x MISS)" in text
    assert "-5.6% against the best count's (<= +5% ok)" in text
