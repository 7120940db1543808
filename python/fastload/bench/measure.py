"""What the benchmark measures and how.

One *run* is one loader (fastload or DataLoader) in a fresh child process
(``python -c``, so a spawned worker imports nothing of the bench but the
dataset's module), two epochs of the same loader, ``persistent_workers=False``:

* epoch 1, short (``4 x workers`` batches, ``2 x`` with ``--quick``), read to its end: the COLD time to
  first batch (loader construction to first batch, in a process that has
  never started a worker) and a full-epoch check: every index exactly once,
  in order, and each batch's checksum equal to the in-process reference.
* epoch 2, long: the WARM time to first batch (``iter()`` to first batch;
  DataLoader spawns its workers again, fastload reuses its pool), a warm-up
  (``--warmup`` seconds and at least ``2 x workers`` batches), then
  ``--seconds`` of steady state: samples/s, batches/s and the main process's
  CPU time per batch (``time.process_time``, all threads of the main
  process), and the same checks on every batch read.

Runs never overlap: the next run's process is started (interpreter, torch,
dataset) once this run has written its result, but told to go only when this
run's process and all its workers are gone (:func:`run_children`). The
child's code is :mod:`fastload.bench.child`.

The consumer loop does the same cheap work for both loaders: it checks the
batch's indices (``batch["y"]`` for dicts, else ``batch[-1]``) against the
expected range and computes :func:`fastload.bench.checks.checksum`.

Peak memory: the parent samples the child and all its descendants (workers,
multiprocessing's resource tracker) while the run goes: RSS every 50 ms from
``/proc/<pid>/statm`` and PSS every 0.25 s from ``/proc/<pid>/smaps_rollup``
(reading it walks the page tables, ~10 ms for a torch process, so it is not
done more often). The peak reported is the PSS total between loader
construction and the end of the steady state; RSS is used where the kernel
has no smaps_rollup. Shared memory is counted once: the PSS of a page mapped
by several processes is split between them, which holds for DataLoader's
``/dev/shm`` tensors and for fastload's ring alike.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import default_collate

from .checks import checksum, slice_sample
from .child import _Consumer
from .workloads import Workload


def base_seeds(seed: int, epochs: int) -> List[int]:
    """The ``base_seed`` DataLoader draws from ``generator`` at each ``iter()``."""
    g = torch.Generator()
    g.manual_seed(seed)
    return [int(torch.empty((), dtype=torch.int64).random_(generator=g).item()) for _ in range(epochs)]


CHILD = "from fastload.bench.child import child_main; child_main()"


# ----------------------------------------------------- memory of a process tree --


class MemSampler(threading.Thread):
    """Samples the memory of ``pid`` and all its descendants (module docstring)."""

    def __init__(self, pid: int, every: float = 0.05, pss_every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every = every
        self.pss_every = pss_every
        self.samples: List[Tuple[float, int, Optional[int], int]] = []  # t, rss, pss, procs
        self.has_pss = os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")
        self._halt = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._children_files = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")

    def tree(self) -> List[int]:
        if not self._children_files:  # kernel without CONFIG_PROC_CHILDREN: scan /proc
            kids: Dict[int, List[int]] = {}
            for name in os.listdir("/proc"):
                try:
                    with open(f"/proc/{name}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    kids.setdefault(ppid, []).append(int(name))
                except (OSError, ValueError, IndexError):
                    pass
            out, todo = [], [self.pid]
            while todo:
                out.append(todo.pop())
                todo += kids.get(out[-1], [])
            return out
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for tid in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{tid}/children") as f:
                        todo += [int(c) for c in f.read().split()]
            except OSError:
                pass
        return out

    def _rss(self, pid: int) -> int:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * self._page

    @staticmethod
    def _pss(pid: int) -> int:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        return 0

    def run(self) -> None:
        next_pss = 0.0
        while not self._halt.is_set():
            now = time.time()
            rss, pss, n = 0, 0 if self.has_pss and now >= next_pss else None, 0
            for p in self.tree():
                try:
                    rss += self._rss(p)
                    if pss is not None:
                        pss += self._pss(p)
                    n += 1
                except (OSError, ValueError):
                    pass
            if pss is not None:
                next_pss = now + self.pss_every
            if n:
                self.samples.append((now, rss, pss, n))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def peak(self, t0: float, t1: float) -> Dict[str, Any]:
        win = [s for s in self.samples if t0 <= s[0] <= t1] or self.samples
        rss = max((s[1] for s in win), default=0)
        pss = max((s[2] for s in win if s[2] is not None), default=None)
        return {"peak_mem_mb": (pss if pss is not None else rss) / 2**20,
                "mem_kind": "PSS" if pss is not None else "RSS",
                "peak_rss_sum_mb": rss / 2**20, "max_procs": max((s[3] for s in win), default=0)}


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies waiting for
    init to reap them do not count)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            return True
    return False


class Child:
    """One run's process, seen from the parent: started ahead (its interpreter
    and imports overlap the previous run's teardown), told to go when the
    previous run's processes are all gone, memory sampled throughout."""

    def __init__(self, spec: Dict[str, Any]) -> None:
        self.spec = spec
        fd, self.out = tempfile.mkstemp(prefix="fastload-bench-", suffix=".json")
        os.close(fd)
        os.unlink(self.out)  # the child creates it, whole, when its result is ready
        self.log = tempfile.TemporaryFile()
        self.t_launch = time.time()
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec), self.out],
                                  stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self.mem = MemSampler(self.p.pid)
        self.mem.start()
        self.err: Optional[str] = None

    def go(self, timeout: float) -> None:
        """Let it measure; return when its result is out (or it died, or ``timeout``)."""
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(b"go\n")
            self.p.stdin.close()
        except OSError:
            pass  # it died already: finish() says how
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.out) and self.p.poll() is None:
            if time.monotonic() > deadline:
                self.err = f"timed out after {timeout:.0f} s"
                self.kill()
                return
            time.sleep(0.02)

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()

    def finish(self, grace: float = 30.0) -> Dict[str, Any]:
        """Wait for the process and everything it started to be gone; the result."""
        try:
            self.p.wait(grace)
        except subprocess.TimeoutExpired:
            self.err = self.err or f"did not exit within {grace:.0f} s of its result"
        deadline = time.monotonic() + 10
        while _group_running(self.p.pid):  # its workers share its process group
            if time.monotonic() > deadline:
                self.kill()
                break
            time.sleep(0.05)
        self.p.wait()
        self.mem.stop()
        try:
            with open(self.out) as f:
                res = json.load(f)
            os.unlink(self.out)
        except (OSError, ValueError):
            res = {}
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-3000:]
        self.log.close()
        err = self.err
        if err is None and "error" not in res and self.p.returncode != 0:
            err = f"exit code {self.p.returncode}"
        if err is not None or "error" in res or not res:
            res = {"error": res.get("error") or err or "no result", "log": tail}
        else:
            res.update(self.mem.peak(res["t_start"], res["t_end"]))
            # where the wall time of a run goes, for the curious
            res["wall_s"] = {"start_python_torch": res["t_main"] - self.t_launch,
                             "run": res["t_done"] - res["t_go"], "exit": time.time() - res["t_done"]}
            if tail.strip():
                res["log"] = tail
        res["kind"] = self.spec["kind"]
        return res


def run_children(specs: List[Dict[str, Any]], timeout: float,
                 on_start: Callable[[int], None], on_done: Callable[[int, Dict[str, Any]], None]) -> None:
    """Run ``specs`` one after the other, never two measuring at once: run
    ``i + 1`` is started (imports) once run ``i`` has its result, and told to
    go once run ``i`` and all its processes are gone."""
    nxt: Optional[Child] = Child(specs[0]) if specs else None
    cur: Optional[Child] = None
    try:
        for i in range(len(specs)):
            cur, nxt = nxt, None
            assert cur is not None
            on_start(i)
            cur.go(timeout)
            if i + 1 < len(specs):
                nxt = Child(specs[i + 1])
            res = cur.finish()
            cur = None
            on_done(i, res)
    finally:
        for c in (cur, nxt):
            if c is not None:
                c.kill()
                c.mem.stop()


# ----------------------------------------------------------------- limits --


def memcpy_bandwidth(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Single-thread memcpy bandwidth, bytes copied per second (median)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        return nbytes / statistics.median(times)
    finally:
        torch.set_num_threads(threads)


class _WorkerLike:
    """In-process, seed ``random``/``torch``/``numpy`` as DataLoader's worker
    ``wid`` would, one torch thread; :meth:`fetch` runs ``dataset[i]`` with
    ``get_worker_info()`` set as there (not around the collate, which would
    then allocate in shared memory). Everything is restored on exit."""

    def __init__(self, base_seed: int, wid: int, workers: int, dataset: Any) -> None:
        from torch.utils.data._utils import worker as tw

        self.tw, self.base_seed, self.wid, self.dataset = tw, base_seed, wid, dataset
        self.info = tw.WorkerInfo(id=wid, num_workers=workers, seed=base_seed + wid, dataset=dataset)

    def __enter__(self) -> "_WorkerLike":
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        self._py = random.getstate()
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        seed = self.base_seed + self.wid
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            self._np = np.random.get_state()
            np.random.seed(self.tw._generate_state(self.base_seed, self.wid))
        except ImportError:
            self._np = None
        return self

    def fetch(self, idx: Any) -> List[Any]:
        saved, self.tw._worker_info = self.tw._worker_info, self.info
        try:
            return [self.dataset[i] for i in idx]
        finally:
            self.tw._worker_info = saved

    def __exit__(self, *exc: Any) -> None:
        if self._np is not None:
            import numpy as np

            np.random.set_state(self._np)
        random.setstate(self._py)
        torch.set_num_threads(self._threads)
        self._fork.__exit__(None, None, None)


def raw_rate(w: Workload, cache: str, batch_size: int, seconds: float, seed: int = 0) -> float:
    """Samples/s of ``dataset[i]`` + collate in this process, one thread, as one
    worker would make them."""
    ds, collate = w.make(cache)
    collate = collate or default_collate
    done, k = 0, 0
    with _WorkerLike(seed, 0, 1, ds) as wl:
        collate(wl.fetch(range(batch_size)))  # first touch: lazy opens
        t = time.perf_counter()
        while True:
            collate(wl.fetch(range(k * batch_size, (k + 1) * batch_size)))
            k += 1
            done += batch_size
            el = time.perf_counter() - t
            if el >= seconds and k >= 2:
                return done / el


def _stack_into_ring(slots: int, slot_bytes: int = 16 << 20) -> None:
    """Make this process's default_collate stack tensors into ``slots`` slots
    of a memfd mapping in turn, as a fastload worker stacks into its ring (a
    tensor bigger than a slot is stacked as usual). For measuring children
    only: it changes torch's collate map for the rest of the process."""
    import itertools
    import mmap

    from torch.utils.data._utils import collate as tc

    fd = os.memfd_create("fastload-bench-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, slots * slot_bytes)
        mm = mmap.mmap(fd, slots * slot_bytes)
    finally:
        os.close(fd)
    u8 = torch.frombuffer(mm, dtype=torch.uint8)
    turn = itertools.count()
    plain = tc.collate_tensor_fn

    def stack_into_slot(batch: Any, *, collate_fn_map: Any = None) -> Any:
        elem = batch[0]
        n = elem.element_size() * elem.numel() * len(batch)
        if n > slot_bytes:
            return plain(batch, collate_fn_map=collate_fn_map)
        start = next(turn) % slots * slot_bytes
        out = u8[start : start + n].view(elem.dtype).view((len(batch), *elem.shape))
        return torch.stack(batch, 0, out=out)

    tc.default_collate_fn_map[torch.Tensor] = stack_into_slot


def _side_by_side(spec: Dict[str, Any], batch_size: int, cache: str, seconds: float, seed: int,
                  ready: Any, go: Any, results: Any, into_ring: int = 0) -> None:
    from .workloads import rebuild

    if into_ring:
        _stack_into_ring(into_ring)
    w = rebuild(spec, batch_size)
    ready.put(os.getpid())
    go.wait()
    results.put(raw_rate(w, cache, batch_size, seconds, seed))


def parallel_rate(w: Workload, cache: str, batch_size: int, seconds: float, procs: int,
                  seed: int = 0, timeout: float = 180.0, into_ring: int = 0) -> float:
    """Samples/s summed over ``procs`` plain processes, no loader, each doing
    :func:`raw_rate` at the same time (started together once all have
    imported torch): what the machine allows ``procs`` workers. On a machine
    whose cores slow each other down it is below ``procs`` x ``raw_rate``.
    ``into_ring=N``: each stacks its batches into N shared-memory slots in
    turn, as a fastload worker does, instead of into fresh memory."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    spec = w.spec or {"name": w.name}
    ps = [ctx.Process(target=_side_by_side, daemon=True,
                      args=(spec, batch_size, cache, seconds, seed, ready, go, results, into_ring))
          for _ in range(procs)]
    try:
        for p in ps:
            p.start()

        def collect(q: Any, n: int, limit: float) -> List[Any]:
            got: List[Any] = []
            deadline = time.monotonic() + limit
            while len(got) < n:
                try:
                    got.append(q.get(timeout=0.2))
                except queue.Empty:
                    dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"{w.name}: side-by-side rate: a measuring process "
                                           f"{'exited with ' + str(dead[0]) if dead else 'timed out'}")
            return got

        collect(ready, procs, timeout)
        go.set()
        rates = collect(results, procs, seconds + timeout)
    finally:
        for p in ps:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return float(sum(rates))


def consumer_cost(w: Workload, cache: str, batch_size: int, reps: int = 50) -> float:
    """Microseconds the run loop's own work (index check + checksum) takes on
    one batch of ``w``: what the benchmark adds to every batch of both loaders."""
    ds, collate = w.make(cache)
    with _WorkerLike(0, 0, 1, ds) as wl:
        batch = (collate or default_collate)(wl.fetch(range(batch_size)))
    c = _Consumer()
    times = []
    for _ in range(reps + 1):  # the first call pays one-off costs: dropped by the median
        c.pos = 0
        t = time.perf_counter()
        c.add(batch)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def _big(sample: Any) -> bool:
    """Whether a sample holds a tensor large enough that collating only the
    checksummed elements (:func:`slice_sample`) beats collating it whole."""
    if isinstance(sample, dict):
        return any(_big(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return any(_big(v) for v in sample)
    return isinstance(sample, torch.Tensor) and sample.numel() > 16384


def reference(w: Workload, cache: str, base_seed: int, workers: int, batch_size: int,
              epoch_len: int, n_batches: int) -> List[int]:
    """Checksums of batches ``0 .. n_batches-1`` of an epoch of ``epoch_len``
    samples, made in-process by replaying each worker: batch ``b`` is made by
    worker ``b % workers``, whose RNGs were seeded with ``base_seed + worker``.
    With the default collate and large samples only the elements the checksum
    reads are collated (:func:`slice_sample`)."""
    ds, collate = w.make(cache)
    n_batches = min(n_batches, -(-epoch_len // batch_size))
    out: List[int] = [0] * n_batches
    for wid in range(workers):
        with _WorkerLike(base_seed, wid, workers, ds) as wl:
            for b in range(wid, n_batches, workers):
                samples = wl.fetch(range(b * batch_size, min((b + 1) * batch_size, epoch_len)))
                if collate is None and _big(samples[0]):
                    out[b] = checksum(default_collate([slice_sample(s) for s in samples]), sliced=True)
                else:
                    out[b] = checksum((collate or default_collate)(samples))
    return out


def machine_info() -> Dict[str, Any]:
    import platform

    info: Dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "loadavg_start": list(os.getloadavg()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[1:2] and ln.split()[1].isdigit()}
        info["mem_total_gib"] = round(kb["MemTotal"] / 2**20, 1)
        info["mem_available_gib"] = round(kb["MemAvailable"] / 2**20, 1)
    except (OSError, KeyError):
        pass
    try:
        import PIL
        from PIL import features

        turbo = features.check_feature("libjpeg_turbo")
        ver = features.version_feature("libjpeg_turbo") if turbo else features.version("jpg")
        simd = "post" in PIL.__version__  # pillow-simd versions read like 9.0.0.post1
        info["decoder"] = (f"{'pillow-simd' if simd else 'Pillow'} {PIL.__version__}, "
                           f"{'libjpeg-turbo' if turbo else 'libjpeg'} {ver}")
    except ImportError:
        info["decoder"] = "none (Pillow not installed)"
    try:
        import fastload

        info["fastload"] = fastload.__version__
    except ImportError:
        pass
    return info


def timed(fn: Callable[[], Any]) -> Tuple[Any, float]:
    t = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t
