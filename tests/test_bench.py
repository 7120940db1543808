"""``python -m fastload.bench`` on a tiny config: structure and the correctness
column only, never speed (figures on a shared CI machine mean nothing)."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest
import torch
from torch.utils.data import Dataset, default_collate

from fastload.bench import main
from fastload.bench.evaluate import check_run as _check
from fastload.bench.checks import checksum, slice_sample
from fastload.bench.measure import reference
from fastload.bench.workloads import WORKLOADS


class Noisy(Dataset):
    """Content drawn from the worker's torch RNG: the reference must replay
    DataLoader's worker seeding to match it."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return {"v": torch.rand(3) + i, "k": 2 * i, "name": f"s{i % 7}"}


def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"v": torch.stack([s["v"] for s in samples]), "k": [s["k"] for s in samples],
            "name": [s["name"] for s in samples]}


def make_dataset() -> Dict[str, Any]:
    """The ``--dataset test_bench:make_dataset`` callable."""
    return {"dataset": Noisy(), "batch_size": 8, "collate_fn": collate}


@pytest.mark.slow  # the benchmark starts fresh processes for each run
def test_bench_runs_and_checks_a_user_dataset(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # One workload, one worker, one round: two runs, about 15 s (process starts).
    rc = main(["--dataset", "test_bench:make_dataset", "--workers", "1",
               "--rounds", "1", "--seconds", "0.3", "--warmup", "0.1", "--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert rc == 0, printed
    assert set(res["workloads"]) == {"test_bench:make_dataset"}
    assert "correct" in printed and "machine:" in printed and "memcpy" in printed
    assert res["limits"]["memcpy_bytes_per_s"] > 0
    assert {"cpus", "torch", "python", "decoder", "kernel"} <= set(res["machine"])
    for name, w in res["workloads"].items():
        assert w["correct"] == {"fastload": "yes", "DataLoader": "yes"}, w["problems"]
        assert w["checked_batches"]["epoch1"] == 2 and w["checked_batches"]["epoch2"] > 2
        assert res["limits"]["raw_samples_per_s"][name] > 0
        for kind in ("fastload", "DataLoader"):
            (run,) = w["runs"][kind]
            assert "error" not in run, run
            assert run["epoch1"]["samples"] == w["epoch1_samples"] == 2 * w["batch_size"]
            assert run["epoch1"]["order_error"] is None and run["epoch2"]["order_error"] is None
            assert run["steady"]["batches"] > 0 and run["samples_per_s"] > 0
            assert run["ttfb_cold_s"] > 0 and run["ttfb_warm_s"] > 0
            assert run["peak_mem_mb"] > 0 and run["mem_kind"] in ("PSS", "RSS")
            assert run["sampler_cpu_s"] > 0
        whats = [t["what"] for t in w["targets"]]
        assert whats == ["samples/s", "cold 1st batch", "warm 1st batch", "peak memory"]
    assert res["workloads"]["test_bench:make_dataset"]["batch_size"] == 8


def test_memory_sampler_peak_stays_pss_for_a_window_between_pss_samples():
    """A run shorter than the PSS interval still gets a PSS figure (from the
    samples nearest to it), so that both loaders are compared in the same
    unit; the sampler reports the CPU it used."""
    import os
    import time

    from fastload.bench.memory import MemSampler

    m = MemSampler(os.getpid())
    mb = 2**20
    m.samples = [(0.0, 50 * mb, 40 * mb, 1), (1.0, 60 * mb, None, 1), (1.2, 70 * mb, None, 1),
                 (2.0, 65 * mb, 45 * mb, 1), (9.0, 90 * mb, 80 * mb, 1)]
    inside = m.peak(0.9, 1.3)  # RSS samples only: the PSS ones at 0.0 and 2.0 stand in
    assert (inside["mem_kind"], inside["peak_mem_mb"], inside["peak_rss_sum_mb"]) == ("PSS", 45, 70)
    assert m.peak(-1.0, 2.5)["peak_mem_mb"] == 45

    live = MemSampler(os.getpid(), every=0.01, pss_every=0.01)
    live.start()
    deadline = time.monotonic() + 10
    while sum(s[2] is not None for s in live.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    live.stop()
    assert live.cpu_s > 0 and live.peak(0, time.time() + 1)["mem_kind"] in ("PSS", "RSS")


def test_checks_catch_wrong_deliveries():
    w = WORKLOADS["tiny"]
    ref = reference(w, "", 5, 2, 4, 16, 4)
    good = {"base_seed_1": 5, "base_seed_2": 6,
            "epoch1": {"samples": 16, "order_error": None, "checksums": list(ref)},
            "epoch2": {"samples": 16, "order_error": None, "checksums": list(ref)}}
    assert _check(good, 16, [5, 6], ref, ref) == []
    swapped = json.loads(json.dumps(good))
    swapped["epoch2"]["checksums"][1:3] = ref[2:0:-1]
    assert _check(swapped, 16, [5, 6], ref, ref) == [
        "epoch 2: batch 1 content differs from the in-process reference"]
    short = json.loads(json.dumps(good))
    short["epoch1"]["samples"] = 12
    assert "epoch 1: 12 of 16 samples delivered" in _check(short, 16, [5, 6], ref, ref)


def test_checksum_reads_content_and_slicing_agrees():
    samples = [{"x": torch.rand(3, 40, 41), "h": torch.rand(5).half(), "b": torch.rand(4) > 0.5,
                "c": torch.randn(2, dtype=torch.complex64), "i": i, "f": i / 3, "s": f"n{i}"} for i in range(5)]
    full = checksum(default_collate(samples))
    assert checksum(default_collate([slice_sample(s) for s in samples]), sliced=True) == full
    samples[2]["x"][0, 0, 0] += 1  # an element the checksum reads
    assert checksum(default_collate(samples)) != full
    swapped = samples[:]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert checksum(default_collate(swapped)) != checksum(default_collate(samples))


@pytest.mark.slow
def test_parallel_script_measures_one_and_two_processes():
    """bench/parallel.py (the machine's bound quoted in the README) runs and
    reports both rates; figures themselves are not checked."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "parallel.py"
    out = subprocess.run([sys.executable, str(script), "--workloads", "tiny", "--rounds", "1",
                          "--seconds", "0.2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = re.search(r"tiny: 1 process ([\d,]+) samples/s; 2 together ([\d,]+) samples/s", out.stdout)
    assert m, out.stdout
    assert all(int(g.replace(",", "")) > 0 for g in m.groups())


@pytest.mark.slow
def test_share_script_reads_both_loaders_cpu_beside_a_neighbour():
    """bench/share.py (the scheduler figures bench/README.md quotes) runs
    both loaders beside a busy neighbour and finds their processes: CPU on
    the main process and on the workers, and a share of the machine."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "share.py"
    out = subprocess.run([sys.executable, str(script), "--workload", "tiny", "--neighbours", "1",
                          "--rounds", "1", "--seconds", "0.3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"round 1 (fastload|DataLoader) +([\d.]+) batches/s .* main +(\d+)/\d+ .*"
                      r"workers +(\d+)/\d+ .* cores ([\d.]+)", out.stdout)
    assert [r[0] for r in rows] == ["fastload", "DataLoader"], out.stdout
    for _kind, rate, main_us, workers_us, cores in rows:
        assert float(rate) > 0 and int(main_us) > 0 and int(workers_us) > 0 and float(cores) > 0


@pytest.mark.slow
def test_worker_steps_script_times_each_step():
    """bench/worker_steps.py (what a worker adds per batch, quoted in
    bench/README.md) runs a worker's steps and prints each one's time."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "worker_steps.py"
    out = subprocess.run([sys.executable, str(script), "--workload", "tiny", "--batches", "20",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps = dict(re.findall(r"^  (task|collate|collate into slot|worker in all) +([\d.]+)$",
                            out.stdout, re.M))
    assert set(steps) == {"task", "collate", "collate into slot", "worker in all"}, out.stdout
    assert all(float(v) > 0 for v in steps.values())
    assert "a worker adds" in out.stdout


def _busy_loops_alive(pids: List[int]) -> List[int]:
    """Those of ``pids`` that are still a running bench neighbour (a reused
    pid running something else does not count)."""
    alive = []
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"getppid" in cmd:
            alive.append(p)
    return alive


@pytest.mark.slow
def test_bench_runs_under_load_and_leaves_no_neighbour(tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--dataset", "test_bench:make_dataset", "--workers", "1", "--rounds", "1",
               "--seconds", "0.3", "--warmup", "0.1", "--quick",
               "--under-load", "oversubscribed,neighbour", "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0
    cores = res["machine"]["cpus_usable"]
    loaded = res["under_load"]
    assert set(loaded) == {"oversubscribed", "neighbour"}
    assert (loaded["oversubscribed"]["workers"], loaded["oversubscribed"]["neighbours"]) == (2 * cores, 0)
    assert (loaded["neighbour"]["workers"], loaded["neighbour"]["neighbours"]) == (1, cores)
    pids: List[int] = []
    for state, cfg in loaded.items():
        wr = cfg["workloads"]["test_bench:make_dataset"]
        assert wr["correct"] == {"fastload": "yes", "DataLoader": "yes"}, (state, wr["problems"])
        assert wr["workers"] == cfg["workers"]
        (t,) = wr["targets"]
        assert t["what"] == "samples/s" and t["value"] > 0 and t["need"] == 1.0
        for kind in ("fastload", "DataLoader"):
            (run,) = wr["runs"][kind]
            assert run["samples_per_s"] > 0 and run["workers_cpu_ms_per_batch"] >= 0
            pids += run.get("neighbour_pids", [])
    assert len(pids) == 2 * cores  # one per core, for each of the two neighbour runs
    assert _busy_loops_alive(pids) == []


def test_neighbours_are_killed_and_exit_without_their_parent():
    import subprocess
    import sys
    import time

    from fastload.bench.runner import Neighbours

    with pytest.raises(RuntimeError):
        with Neighbours(2) as busy:
            deadline = time.monotonic() + 30  # until both have exec'd their loop
            while len(_busy_loops_alive(busy.pids)) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(_busy_loops_alive(busy.pids)) == 2
            raise RuntimeError("the run failed")
    assert _busy_loops_alive(busy.pids) == []
    # A benchmark killed outright (no __exit__): its neighbours leave by themselves.
    code = ("from fastload.bench.runner import Neighbours; import os, time\n"
            "n = Neighbours(2).__enter__(); print(*n.pids, flush=True); time.sleep(0.5); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    orphans = [int(p) for p in out.stdout.split()]
    assert len(orphans) == 2, out.stderr
    deadline = time.monotonic() + 10
    while _busy_loops_alive(orphans) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy_loops_alive(orphans) == []


def test_ab_pairs_rounds_and_reports_the_ratio_s_spread(capsys):
    """``fastload.bench.ab``'s figures from made-up runs: medians per side,
    ratios paired by round (a failed run leaves its round out), and the
    errors and wrong batches named in the table."""
    from fastload.bench import ab

    def run(sps: float, main_ms: float, workers_ms: float) -> Dict[str, Any]:
        return {"samples_per_s": sps, "main_cpu_ms_per_batch": main_ms,
                "workers_cpu_ms_per_batch": workers_ms, "epoch2": {"order_error": None}}

    a = [run(100, 1.0, 2.0), run(120, 1.0, 2.0), run(90, 2.0, 4.0)]
    b = [run(100, 1.0, 1.0), {"error": "Traceback...\nRuntimeError: boom"}, run(60, 1.0, 2.0)]
    summary = ab.summarise({"w": [a, b]})
    sps = summary["w"]["samples_per_s"]
    assert sps["median"] == [100, 80]
    assert sps["ratio"] == {"ratios": [1.0, 1.5], "median": 1.25, "min": 1.0, "max": 1.5}
    assert summary["w"]["workers_cpu_ms_per_batch"]["ratio"]["ratios"] == [2.0, 2.0]
    ab.report(summary, [ab.Side("A side", "python", []), ab.Side("B side", "python", [])],
              __import__("sys").stdout)
    text = capsys.readouterr().out
    assert "1.250x (1.000-1.500, 2 rounds)" in text
    assert "B ERROR: RuntimeError: boom" in text


def test_a_report_with_a_miss_says_a_miss_is_not_a_failure(capsys):
    """A target marked MISS is a finding about this machine: the benchmark
    says so under any report that has one, and only there."""
    from fastload.bench import report
    from fastload.bench.fresh import MISS_NOTE, miss_note, print_and_save

    assert report._mark(False) == "MISS" and miss_note("x 0.61x (<=0.5x) MISS\n") == MISS_NOTE
    assert "not a failure" in MISS_NOTE and "exit status is 1 only if" in MISS_NOTE
    assert miss_note("x 0.41x (<=0.5x) ok\n") == ""
    print_and_save("a (>= 0.9x MISS)\n", {}, None)
    assert capsys.readouterr().out == "a (>= 0.9x MISS)\n" + MISS_NOTE
