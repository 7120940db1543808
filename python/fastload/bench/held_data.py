"""Datasets that hold their data: memory and epoch start against fork.

A dataset that *is* its data (a preloaded tensor, a numpy array, a
pretokenized corpus opened as ``np.memmap``, a Hugging Face dataset on
disk, a big list of paths) costs DataLoader's forked workers nothing: they
share the training process's pages. fastload sends what fork would share by
reference (docs/design.md, "What crosses to a worker"); this table checks
that it costs what fork costs.

Each run is a fresh interpreter that builds one dataset of ``--data-gib``
GiB (the path list: 1.5M paths; fastload's run imports fastload first, as
a script does at its top, so its fork server starts meanwhile), makes a loader with 4 workers and
``persistent_workers=False`` (the default), and runs 2 epochs of 40 random
batches of 64, while a thread samples the memory of the whole process tree
(this process and every descendant) every 0.25 s: the PSS of its private
and file pages plus every shared-memory object it holds (memfds,
``/dev/shm``) once, at its allocated size, since PSS alone misses shared
memory that no process has touched. It reports the tree's peak, the first
batch of each epoch (from ``iter()``) and the total.
Loaders alternate (fork, spawn, fastload; then reversed; DataLoader(spawn),
which pickles the data for every worker, runs in the first round only);
medians are reported, fastload's as ratios to DataLoader(fork)'s, beside the time one
copy of the data takes at the machine's memcpy rate.

Run alone: ``python -m fastload.bench.held_data [--data-gib 2] [--rounds 3]
[--kinds tensor,array,...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

from .fresh import print_and_save, run_fresh

KINDS = ("tensor", "array", "shared_array", "memmap", "hf_dataset", "paths", "shared_paths")
LOADERS = ("fork", "spawn", "fastload")
GIB = 1 << 30
MB = 1 << 20
PATHS = 1_500_000
BATCHES, BATCH = 40, 64


_SHARED_PREFIXES = ("/memfd:", "/dev/shm/", "/SYSV")


def _tree_pids(root: int, skip: int = -1) -> List[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid == skip:
            continue
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(p) for p in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out


def _tree_memory(root: int, skip: int = -1) -> int:
    """The memory the process tree under ``root`` holds, in bytes: the PSS
    of its private and file-backed pages, plus each shared-memory object
    (memfd, ``/dev/shm``) it maps or holds an fd of, counted once at its
    allocated size. PSS alone would miss shared memory no process has
    touched (a buffer's copy that workers map but read little of) and split
    the rest by who touched it."""
    total, shared = 0, {}
    for pid in _tree_pids(root, skip):
        try:
            with open(f"/proc/{pid}/smaps") as f:
                in_shared, span = False, ""
                for line in f:
                    head = line.split(maxsplit=5)
                    if "-" in head[0] and len(head) >= 5 and ":" in head[3]:
                        path = head[5].strip() if len(head) > 5 else ""
                        in_shared, span = path.startswith(_SHARED_PREFIXES), head[0]
                        if in_shared:
                            try:
                                st = os.stat(f"/proc/{pid}/map_files/{span}")
                                shared[(st.st_dev, st.st_ino)] = st.st_blocks * 512
                            except OSError:
                                pass
                    elif line.startswith("Pss:") and not in_shared:
                        total += int(line.split()[1]) * 1024
                    elif line.startswith("Anonymous:") and in_shared:  # copied on write
                        total += int(line.split()[1]) * 1024
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(_SHARED_PREFIXES):
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        shared[(st.st_dev, st.st_ino)] = st.st_blocks * 512
                except OSError:
                    continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total + sum(shared.values())


class _PeakSampler:
    """Samples the tree's memory every ``period`` s from a process of its
    own (a thread here would be one more Python thread in the measured
    process, which changes how fastload moves a tensor: see
    fastload.launching.memfds.move_to_shared)."""

    def __init__(self, period: float = 0.25) -> None:
        self.peak, self._period = 0, period
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "_PeakSampler":
        code = ("import sys; from fastload.bench.held_data import sample_until_stdin_closes; "
                f"sample_until_stdin_closes({os.getpid()}, {self._period})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate("")
        self.peak = int(out.strip().splitlines()[-1])


def sample_until_stdin_closes(root: int, period: float) -> None:
    """The sampler process: the peak of ``_tree_memory(root)`` (itself left
    out) until its stdin closes, printed."""
    me, peak, done = os.getpid(), 0, threading.Event()

    def wait_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    while True:
        peak = max(peak, _tree_memory(root, skip=me))
        if done.wait(period):
            break
    print(max(peak, _tree_memory(root, skip=me)), flush=True)


class Rows:
    """Sample ``i``: row ``i`` of ``data`` (a tensor, an array or a memmap of
    ``(rows, 1024)``), as a tensor."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        import numpy as np
        import torch
        row = self.data[i]
        return row.clone() if isinstance(row, torch.Tensor) else torch.from_numpy(np.array(row))


class Paths:
    """Sample ``i``: the length of path ``i`` plus label ``i``."""

    def __init__(self, n: int, shared: bool) -> None:
        self.paths: Any = [f"/data/train/{i % 1000:03d}/img_{i:08d}.jpg" for i in range(n)]
        self.labels: Any = [i % 1000 for i in range(n)]
        if shared:
            import fastload
            self.paths, self.labels = fastload.share(self.paths), fastload.share(self.labels)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        return len(self.paths[i]) + self.labels[i]


class HFRows:
    """Sample ``i``: row ``i`` of a Hugging Face dataset loaded from disk
    (memory-mapped Arrow)."""

    def __init__(self, path: str) -> None:
        import datasets
        self.ds = datasets.load_from_disk(path).with_format("numpy")

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        import torch
        return torch.from_numpy(self.ds[int(i)]["x"].astype("int16"))


def _hf_on_disk(nbytes: int, where: str) -> str:
    """A Hugging Face dataset of ``nbytes`` of uint8 rows of 1024, saved
    under ``where`` (made once per measure)."""
    import datasets
    import pyarrow as pa
    path = os.path.join(where, f"hf_{nbytes}")
    if not os.path.exists(path):
        rows = nbytes // 1024
        flat = pa.array(_bytes(rows).reshape(-1))
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(flat, 1024)})
        datasets.Dataset(table).save_to_disk(path)
    return path


def _bytes(rows: int) -> Any:
    """``rows`` x 1024 random-looking bytes, made fast: a 1 MiB random
    block repeated (the data's values do not matter here, its pages do)."""
    import numpy as np
    block = np.random.default_rng(0).integers(0, 255, (1024, 1024), dtype=np.uint8)
    out = np.empty((rows, 1024), dtype=np.uint8)
    for start in range(0, rows, 1024):
        n = min(1024, rows - start)
        out[start:start + n] = block[:n]
    return out


def _dataset(kind: str, nbytes: int, where: str) -> Any:
    import numpy as np
    import torch
    rows = nbytes // 1024
    if kind == "tensor":
        return Rows(torch.from_numpy(_bytes(rows)).clone())  # torch's own memory, as torch.load's
    if kind in ("array", "shared_array"):
        arr = _bytes(rows)
        if kind == "shared_array":
            import fastload
            arr = fastload.share(arr)
        return Rows(arr)
    if kind == "memmap":
        path = os.path.join(where, f"tokens_{nbytes}.bin")
        if not os.path.exists(path):
            _bytes(rows).tofile(path)
        return Rows(np.memmap(path, dtype=np.uint16, mode="r").reshape(rows, 512))
    if kind == "hf_dataset":
        return HFRows(_hf_on_disk(nbytes, where))
    if kind in ("paths", "shared_paths"):
        return Paths(PATHS, kind == "shared_paths")
    raise ValueError(kind)


def _int_collate(batch: List[Any]) -> Any:
    import torch
    return torch.tensor(batch) if isinstance(batch[0], int) else torch.stack(batch)


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One run, in a fresh interpreter."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    ds = _dataset(spec["kind"], spec["nbytes"], spec["where"])
    gen = torch.Generator().manual_seed(0)
    kw: Dict[str, Any] = dict(batch_size=BATCH, num_workers=spec["workers"], collate_fn=_int_collate,
                              sampler=RandomSampler(ds, num_samples=BATCHES * BATCH, generator=gen))
    firsts: List[float] = []
    with _PeakSampler() as sampler:
        t0 = time.perf_counter()
        if spec["loader"] == "fastload":
            from fastload import FastLoader
            loader: Any = FastLoader(ds, **kw)
        else:
            loader = DataLoader(ds, multiprocessing_context=spec["loader"], **kw)
        for _epoch in range(2):
            start = time.perf_counter()
            for k, _batch in enumerate(loader):
                if k == 0:
                    firsts.append(time.perf_counter() - start)
        total = time.perf_counter() - t0
        del loader
    return {"peak_mb": sampler.peak / MB, "first_batch_s": firsts, "total_s": total}


def _available(kind: str) -> Optional[str]:
    """Why ``kind`` cannot run here, or None."""
    if kind == "hf_dataset":
        try:
            import datasets  # noqa: F401
            import pyarrow  # noqa: F401
        except ImportError:
            return "needs Hugging Face datasets (pip install datasets)"
    return None


def measure_held_data(data_gib: float = 2.0, rounds: int = 3, workers: int = 4,
                      kinds: Optional[List[str]] = None) -> Dict[str, Any]:
    """Interleaved fresh runs of every loader on every kind; medians and
    fastload's ratios to DataLoader(fork)'s."""
    from .limits import memcpy_bandwidth
    nbytes = int(data_gib * GIB)
    kinds = list(kinds or KINDS)
    skipped = {k: why for k in kinds if (why := _available(k))}
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="fastload-held-") as where:
        for kind in kinds:
            if kind in skipped:
                continue
            runs[kind] = {m: [] for m in LOADERS}
            for r in range(rounds):
                for loader in (LOADERS if r % 2 == 0 else LOADERS[::-1]):
                    if loader == "spawn" and r > 0:
                        continue  # one run: spawn pickles the data per worker, minutes at 2 GiB
                    spec = {"kind": kind, "loader": loader, "nbytes": nbytes, "where": where,
                            "workers": workers}
                    # fastload's child imports it at its top, as a script would:
                    # the fork server starts then; DataLoader's starts none.
                    runs[kind][loader].append(run_fresh(
                        "fastload.bench.held_data", spec, f"held data {kind}", 1800,
                        server_at_import=loader == "fastload"))
    median = {kind: {m: {"peak_mb": statistics.median(r["peak_mb"] for r in got),
                         "first1_s": statistics.median(r["first_batch_s"][0] for r in got),
                         "first2_s": statistics.median(r["first_batch_s"][1] for r in got),
                         "total_s": statistics.median(r["total_s"] for r in got)}
                     for m, got in by_loader.items()}
              for kind, by_loader in runs.items()}
    copy_s = nbytes / memcpy_bandwidth()
    return {"data_gib": data_gib, "rounds": rounds, "workers": workers, "copy_s": copy_s,
            "runs": runs, "median": median, "skipped": skipped}


# Targets: (memory peak vs fork, epoch 2's first batch over fork's in s); epoch
# 1's first batch: fork's + one copy at the memcpy rate + 0.3 s.
TARGETS = {"tensor": (1.2, 0.1), "array": (2.1, 0.3), "shared_array": (1.2, 0.1),
           "memmap": (1.2, 0.1), "hf_dataset": (None, 0.1), "paths": (1.1, 0.1),
           "shared_paths": (0.6, 0.1)}


def report_lines(res: Dict[str, Any]) -> str:
    """The table printed after the benchmark's main one."""
    lines = [f"\nDatasets that hold their data: {res['data_gib']:g} GiB each (paths: {PATHS:,}), "
             f"{res['workers']} workers, 2 epochs of {BATCHES} batches of {BATCH}, each loader in a "
             f"fresh process; medians of {res['rounds']} rounds; one copy of the data at this "
             f"machine's memcpy rate: {res['copy_s']:.2f} s",
             f"{'dataset':<14}{'loader':<10}{'peak MB':>12}{'vs fork':>9}{'1st batch ep1 s':>16}"
             f"{'ep2 s':>8}{'total s':>9}  verdict"]
    for kind, by_loader in res["median"].items():
        fork = by_loader["fork"]
        # A shared kind is held against fork on the plain kind (what the
        # user would have without fastload.share), where it was measured.
        plain = res["median"].get(kind.replace("shared_", ""), by_loader)["fork"]
        pss_target, ep2_slack = TARGETS[kind]
        for name, m in by_loader.items():
            ratio = m["peak_mb"] / (plain if name == "fastload" else fork)["peak_mb"]
            verdict = ""
            if name == "fastload":
                misses = []
                if pss_target is not None and ratio > pss_target:
                    misses.append(f"memory > {pss_target}x")
                if m["first2_s"] > fork["first2_s"] + ep2_slack:
                    misses.append(f"ep2 > fork + {ep2_slack} s")
                if m["first1_s"] > fork["first1_s"] + res["copy_s"] + 0.3:
                    misses.append("ep1 > fork + copy + 0.3 s")
                verdict = "MISS (a finding, not a failure): " + ", ".join(misses) if misses else "met"
            lines.append(f"{kind:<14}{name:<10}{m['peak_mb']:>12.0f}{ratio:>8.2f}x"
                         f"{m['first1_s']:>16.2f}{m['first2_s']:>8.2f}{m['total_s']:>9.2f}  {verdict}")
    for kind, why in res["skipped"].items():
        lines.append(f"{kind:<14}skipped: {why}")
    lines.append("memory: the tree's PSS plus its shared memory (memfds, /dev/shm) at its "
                 "allocated size, peak of samples every 0.25 s")
    lines.append("targets: memory peak vs fork <= 1.2x (tensor, memmap, shared array), 2.1x (array), "
                 "1.1x (paths), 0.6x (shared paths); epoch 2's first batch <= fork's + 0.1 s "
                 "(+ 0.3 s for an array); epoch 1's <= fork's + one copy + 0.3 s. fastload's "
                 "'vs fork' of a shared_ kind is against fork on the plain kind when both ran "
                 "(what the dataset costs without fastload.share)")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastload.bench.held_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-gib", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return
    kinds = a.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    res = measure_held_data(a.data_gib, a.rounds, a.workers, kinds)
    print_and_save(report_lines(res), res, a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
