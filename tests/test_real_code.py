"""Training code as people write it runs unchanged, as with DataLoader.

Each case is a real script run in a fresh interpreter: a file with no main
guard, ``python -c`` (no file behind ``__main__``, as in a notebook), classes
of ``__main__`` inside batches, datasets holding shared state. The contrast
is DataLoader with its default start method (fork on Linux).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import List

import psutil
import pytest

TIMEOUT = 180

pytestmark = pytest.mark.slow  # each case is a fresh interpreter running both loaders

UNGUARDED = textwrap.dedent(
    """
    import collections, dataclasses, enum, json, sys
    import torch
    from torch.utils.data import Dataset, DataLoader
    from fastload import FastLoader

    # Top-level code with a side effect: it must run once, in this process.
    with open(sys.argv[1], "a") as f:
        f.write("ran\\n")

    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass
    class Box:
        value: int

    class Kind(enum.Enum):
        EVEN = 0
        ODD = 1

    class Plain:
        def __init__(self, n): self.n = n

    class Samples(Dataset):
        def __len__(self): return 10
        def __getitem__(self, i):
            return Pair(torch.tensor([i, i * i]), i), Box(i), Kind(i % 2), Plain(i)

    def flat(batches):
        out = []
        for pairs, boxes, kinds, plains in batches:
            out.append([pairs.x.tolist(), pairs.y.tolist(), [b.value for b in boxes],
                        [k.name for k in kinds], [p.n for p in plains]])
        return out

    def types(batch):
        pairs, boxes, kinds, plains = batch
        return [type(pairs) is Pair, type(boxes[0]) is Box, kinds[0] is Kind.EVEN,
                type(plains[0]) is Plain]

    collate = lambda b: (torch.utils.data.default_collate([s[0] for s in b]),
                         [s[1] for s in b], [s[2] for s in b], [s[3] for s in b])
    ctx = None if sys.argv[2] == "default" else sys.argv[2]
    got = list(FastLoader(Samples(), batch_size=3, num_workers=2, collate_fn=collate,
                          multiprocessing_context=ctx))
    want = list(DataLoader(Samples(), batch_size=3, num_workers=2, collate_fn=collate))
    print("RESULT " + json.dumps({"equal": flat(got) == flat(want), "types": types(got[0]),
                                  "reference_types": types(want[0])}))
    """
)


def _run_script(args: List[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout)


def _result(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-4000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("ctx", ["default", "spawn", "forkserver"])
def test_unguarded_script_runs_once_and_main_classes_come_back(tmp_path: Path, ctx: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    marker = tmp_path / "ran.txt"
    res = _result(_run_script([str(script), str(marker), ctx]))
    assert res == {"equal": True, "types": [True] * 4, "reference_types": [True] * 4}
    # DataLoader (fork) does not re-run the script; neither do fastload's workers.
    assert marker.read_text() == "ran\n"


def test_main_classes_under_python_c(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    res = _result(_run_script(["-c", UNGUARDED, str(marker), "default"]))
    assert res["equal"] and res["types"] == [True] * 4
    assert marker.read_text() == "ran\n"


SHARED = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import torch
    from torch.utils.data import Dataset, DataLoader
    from fastload import FastLoader

    class Shared(Dataset):
        def __init__(self, ctx):
            self.epoch = torch.zeros(1, dtype=torch.long).share_memory_()
            self.plain = torch.zeros(1, dtype=torch.long)        # not shared: copied
            self.count = ctx.Value("i", 0)
            self.lock = ctx.Lock()
            self.seen = ctx.Queue()
        def __len__(self): return 8
        def __getitem__(self, i):
            with self.count.get_lock():
                self.count.value += 1
            with self.lock:
                self.seen.put(i)
            return torch.tensor([i, int(self.epoch), int(self.plain)])

    def run(Loader, ctx, **kw):
        ds = Shared(ctx)
        loader = Loader(ds, batch_size=2, num_workers=2, **kw)
        out = []
        for epoch in range(3):
            ds.epoch.fill_(epoch)      # visible to workers: shared
            ds.plain.fill_(epoch)      # a copy in workers: a forked DataLoader sees epoch 0's
            batches = [b.tolist() for b in loader]
            seen = sorted(ds.seen.get(timeout=10) for _ in range(8))
            out.append([batches, ds.count.value, seen])
        return out

    mp_ctx = {"spawn": multiprocessing.get_context("spawn"),
              "fork": multiprocessing.get_context("fork")}[sys.argv[1]]
    persistent = sys.argv[2] == "1"
    got = run(FastLoader, mp_ctx, persistent_workers=persistent)
    want = run(DataLoader, mp_ctx, persistent_workers=persistent)
    print("RESULT " + json.dumps({"got": got, "want": want}))
    """
)


@pytest.mark.parametrize("mp_ctx", ["spawn", "fork"])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_shared_state_stays_shared(tmp_path: Path, mp_ctx: str, persistent: str) -> None:
    """A dataset holding a shared tensor, a multiprocessing Value, Lock and
    Queue: workers see the main process's changes between epochs and their
    updates reach it, exactly as with DataLoader. Made in the fork context
    (Linux's default), they can only reach workers by fork: fastload then
    forks its workers from the training process, as DataLoader does."""
    script = tmp_path / "shared.py"
    script.write_text(SHARED)
    res = _result(_run_script([str(script), mp_ctx, persistent]))
    assert res["got"] == res["want"]
    # The shared epoch moved (not every epoch a copy of epoch 0's).
    assert [epoch[0][0][0][1] for epoch in res["got"]] == [0, 1, 2]


FORK_ONLY_WITH_SPAWN = textwrap.dedent(
    """
    import multiprocessing, torch
    from fastload import FastLoader

    class Counting(torch.utils.data.Dataset):
        def __init__(self): self.count = multiprocessing.get_context("fork").Value("i", 0)
        def __len__(self): return 4
        def __getitem__(self, i): return i

    try:
        iter(FastLoader(Counting(), num_workers=2, multiprocessing_context="spawn"))
    except RuntimeError as e:
        print("ERROR", repr(str(e)), repr(e.__notes__))
    """
)


def test_fork_only_objects_with_explicit_spawn_fail_clearly() -> None:
    """Explicit spawn is kept: an object only fork can hand over is an error
    (DataLoader's own under spawn), with the remedy."""
    r = _run_script(["-c", FORK_ONLY_WITH_SPAWN])
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("ERROR ")]
    assert "fork context" in line and "multiprocessing_context='fork'" in line


DIES_AT_START = textwrap.dedent(
    """
    import torch
    from fastload import FastLoader

    class Fatal(BaseException):
        pass

    class Dataset(torch.utils.data.Dataset):
        def __init__(self): self.n = 4
        def __len__(self): return self.n
        def __getitem__(self, i): return i
        def __setstate__(self, state):
            raise Fatal("this dataset cannot be rebuilt in a worker")

    try:
        list(FastLoader(Dataset(), num_workers=1, multiprocessing_context=__import__("sys").argv[1]))
    except RuntimeError as e:
        print("ERROR", repr(str(e)))
    """
)


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
def test_worker_dying_at_start_up_says_why(tmp_path: Path, ctx: str) -> None:
    r = _run_script(["-c", DIES_AT_START, ctx])
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("ERROR ")]
    assert "exited unexpectedly with exit code 1" in line
    assert "Details are lost" not in line
    assert "this dataset cannot be rebuilt in a worker" in line


CTRL_C = textwrap.dedent(
    """
    import sys, time
    import torch
    from fastload import FastLoader

    class Slow(torch.utils.data.Dataset):
        def __len__(self): return 10 ** 6
        def __getitem__(self, i): return i

    print("READY", flush=True)
    try:
        for batch in FastLoader(Slow(), batch_size=4, num_workers=2):
            pass
    except KeyboardInterrupt:
        print("INTERRUPTED", time.monotonic(), flush=True)
        raise
    """
)


def _tagged(tag: str) -> List[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FASTLOAD_TEST_TAG") == tag:
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5])
@pytest.mark.parametrize("target", ["process", "group"])
def test_ctrl_c_during_start_up(delay: float, target: str) -> None:
    """SIGINT while the first workers start (the zygote still importing
    torch) raises KeyboardInterrupt at once, and nothing is left behind.
    "process" is Jupyter's interrupt (the kernel alone), "group" the
    terminal's Ctrl-C (the whole foreground process group)."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, FASTLOAD_TEST_TAG=tag, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(delay)
        sent = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err, err[-2000:]
    (line,) = [x for x in out.splitlines() if x.startswith("INTERRUPTED")]
    # Raised within a second of the signal (CLOCK_MONOTONIC is system-wide).
    assert float(line.split()[1]) - sent < 1.0
    deadline = time.monotonic() + 10
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged(tag) == []
