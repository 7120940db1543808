"""The benchmark's workloads: datasets, their cached data, and ``--dataset``.

Every dataset here is importable by reference (spawned workers of both
loaders unpickle it the same way) and small to pickle: data files are opened
lazily in the process that reads them, and preallocated tensors are made on
first use, never sent.

Randomness (the crop of ``jpeg``, the window of ``tokens``) is drawn from the
*global torch RNG of the worker*, as torchvision's transforms do, so both
loaders draw the same values only if they seed their workers the same way
(``base_seed + worker_id``, ``base_seed`` drawn from ``generator``); the
reference checksums replay that seeding in-process (see ``measure.reference``).

Data is generated deterministically, once, under ``cache_root()``
(``$FASTLOAD_BENCH_CACHE`` or ``<tempdir>/fastload-bench/v<N>``), into a
temporary name that is renamed into place when complete: a crashed run leaves
no half cache.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.data import Dataset, IterableDataset

CACHE_VERSION = 1
BIG = 10**9  # "length" of the unbounded built-in datasets; the sampler decides
TINY_ROWS = 1009  # distinct x rows of `tiny` (a prime, so batches differ)

JPEG_FILES = 2000
JPEG_SIZE = (500, 375)  # width, height
CROP = 224
TOKENS = 32 * 1024 * 1024  # 32 Mi tokens, 64 MiB of uint16
VOCAB = 50257
WINDOW = 2049


def cache_root() -> str:
    env = os.environ.get("FASTLOAD_BENCH_CACHE")
    return env or os.path.join(tempfile.gettempdir(), "fastload-bench", f"v{CACHE_VERSION}")


def _publish(tmp: str, final: str) -> None:
    """Rename a finished temp file/dir into place; another run may have won."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.exists(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else os.unlink(tmp)


# ---------------------------------------------------------------- datasets --


class Transport(Dataset):
    """A preallocated 3x224x224 image per index (a bank of 8, ``i % 8``), and
    the index as label: pure loader overhead. ``dtype`` is uint8 or float32."""

    def __init__(self, dtype: str = "uint8", n: int = BIG) -> None:
        self.dtype = dtype
        self.n = n
        self._bank: Optional[torch.Tensor] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "n": self.n, "_bank": None}

    def bank(self) -> torch.Tensor:
        if self._bank is None:
            g = torch.Generator().manual_seed(1234)
            shape = (8, 3, CROP, CROP)
            if self.dtype == "uint8":
                self._bank = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
            else:
                self._bank = torch.rand(shape, generator=g, dtype=torch.float32)
        return self._bank

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        return self.bank()[i % 8], i


class Tiny(Dataset):
    """``{"x": 16 float32 values, "y": index}``: per-batch overhead.

    ``x`` is row ``i % 1009`` of a table made once per process (the values
    ``arange(16) + i % 1009``): the sample costs an index, so the loader's
    own per-batch work is what is measured (one process makes ~750k
    samples/s of it on a 2-core VM; computing ``x`` with ``torch.add`` per
    sample would make the workload mostly dataset time).
    """

    def __init__(self, n: int = BIG) -> None:
        self.n = n
        self._table: Optional[torch.Tensor] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"n": self.n, "_table": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if self._table is None:
            rows = torch.arange(TINY_ROWS, dtype=torch.float32)[:, None]
            self._table = torch.arange(16, dtype=torch.float32) + rows
        return {"x": self._table[i % TINY_ROWS], "y": i}


class JpegFolder(Dataset):
    """Generated 500x375 JPEGs decoded with PIL, a random crop (scale 0.25-1,
    aspect 3/4-4/3, torch RNG) resized to 224 bilinear, uint8 CHW; label = index."""

    def __init__(self, folder: str, files: int = JPEG_FILES, n: int = BIG) -> None:
        self.folder = folder
        self.files = files
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(os.path.join(self.folder, f"{i % self.files:05d}.jpg")) as im:
            img = im.convert("RGB")
        w, h = img.size
        area = w * h * (0.25 + 0.75 * float(torch.rand(())))
        ratio = math.exp(math.log(3 / 4) + math.log(16 / 9) * float(torch.rand(())))
        cw = min(w, max(1, round(math.sqrt(area * ratio))))
        ch = min(h, max(1, round(math.sqrt(area / ratio))))
        x0 = int(torch.randint(0, w - cw + 1, ()))
        y0 = int(torch.randint(0, h - ch + 1, ()))
        img = img.resize((CROP, CROP), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        return x.view(CROP, CROP, 3).permute(2, 0, 1).contiguous(), i


class TokenWindows(Dataset):
    """Random windows of 2,049 tokens (torch RNG) from a uint16 memmap, as
    int64; label = index. LLM pretraining style."""

    def __init__(self, path: str, tokens: int = TOKENS, n: int = BIG) -> None:
        self.path = path
        self.tokens = tokens
        self.n = n
        self._mm: Any = None

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "tokens": self.tokens, "n": self.n, "_mm": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        import numpy as np

        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint16, mode="r", shape=(self.tokens,))
        start = int(torch.randint(0, self.tokens - WINDOW + 1, ()))
        return torch.from_numpy(self._mm[start:start + WINDOW].astype(np.int64)), i


class Indexed(Dataset):
    """A user's map-style dataset, each sample paired with its position:
    ``(dataset[k % len(dataset)], k)``, so the bench can check delivery order;
    a dataset shorter than a run is cycled."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.n = len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return BIG

    def __getitem__(self, k: int) -> Tuple[Any, int]:
        return self.dataset[k % self.n], k


class IndexedCollate:
    """The user's ``collate_fn`` on the samples, the indices as a tensor last."""

    def __init__(self, collate_fn: Callable[[List[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, batch: List[Tuple[Any, int]]) -> List[Any]:
        return [self.collate_fn([s for s, _ in batch]), torch.tensor([i for _, i in batch])]


# ------------------------------------------------------------- cache data --


def _jpeg_bytes(k: int, noise: List[Any]) -> bytes:
    from PIL import Image, ImageChops

    rng = random.Random(1_000_003 * 7 + k)
    low = Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3))
    img = low.resize(JPEG_SIZE, Image.BICUBIC)  # smooth colour fields ...
    n = noise[k % len(noise)]
    ox, oy = rng.randrange(140), rng.randrange(105)
    img = ImageChops.add(img, n.crop((ox, oy, ox + JPEG_SIZE[0], oy + JPEG_SIZE[1])), 1.0, -21)
    buf = io.BytesIO()  # ... with grain, so the decoder has real work: ~74 kB a file
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def prepare_jpeg(root: str) -> str:
    """``JPEG_FILES`` JPEGs in ``root/jpeg`` (about 4 s on 2 cores, once)."""
    from PIL import Image

    final = os.path.join(root, "jpeg")
    if os.path.isdir(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="jpeg.tmp-", dir=root)
    try:
        base = random.Random(12345)
        noise = [Image.frombytes("RGB", (640, 480), base.randbytes(640 * 480 * 3)).point(lambda v: v // 6)
                 for _ in range(4)]

        def write(k: int) -> None:
            with open(os.path.join(tmp, f"{k:05d}.jpg"), "wb") as f:
                f.write(_jpeg_bytes(k, noise))

        # PIL releases the GIL while resizing and encoding: threads suffice.
        with ThreadPoolExecutor(max(1, min(4, len(os.sched_getaffinity(0))))) as ex:
            list(ex.map(write, range(JPEG_FILES)))
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def prepare_tokens(root: str) -> str:
    """``TOKENS`` uint16 tokens, uniform over ``VOCAB``, in ``root/tokens.u16``."""
    import numpy as np

    final = os.path.join(root, "tokens.u16")
    if os.path.isfile(final):
        return final
    os.makedirs(root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="tokens.tmp-", dir=root)
    try:
        raw = np.frombuffer(random.Random(4321).randbytes(TOKENS * 4), dtype=np.uint32)
        with os.fdopen(fd, "wb") as f:
            f.write((raw % VOCAB).astype(np.uint16).tobytes())
        _publish(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


# --------------------------------------------------------------- registry --


@dataclass
class Workload:
    """One row of the table. ``make(cache_dir)`` returns ``(dataset, collate_fn)``
    (``None`` for the default collate); ``rule`` names the throughput target."""

    name: str
    batch_size: int
    make: Callable[[str], Tuple[Dataset, Optional[Callable]]]
    rule: str  # "transport", "tiny", "tokens", "jpeg" or "user"
    desc: str
    prepare: Optional[Callable[[str], Any]] = None
    needs: Tuple[str, ...] = ()
    sample_bytes: int = 0  # bytes of one sample (the memcpy bound of transport rows)
    length: Optional[int] = None  # a user dataset's len(): caps epoch 1 (epoch 2 cycles it)
    spec: Dict[str, Any] = field(default_factory=dict)  # how a child process rebuilds it


def _builtin() -> Dict[str, Workload]:
    img = 3 * CROP * CROP
    return {w.name: w for w in [
        Workload("transport_u8", 64, lambda c: (Transport("uint8"), None), "transport",
                 "preallocated uint8 3x224x224, batch 64: pure loader overhead", sample_bytes=img),
        Workload("transport_f32", 64, lambda c: (Transport("float32"), None), "transport",
                 "preallocated float32 3x224x224, batch 64", sample_bytes=4 * img),
        Workload("tiny", 256, lambda c: (Tiny(), None), "tiny",
                 '{"x": 16 float32, "y": int}, batch 256: per-batch overhead'),
        Workload("jpeg", 64, lambda c: (JpegFolder(os.path.join(c, "jpeg")), None), "jpeg",
                 f"{JPEG_FILES} JPEGs 500x375, PIL decode, random crop + resize 224, batch 64",
                 prepare=prepare_jpeg, needs=("PIL",)),
        Workload("tokens", 32, lambda c: (TokenWindows(os.path.join(c, "tokens.u16")), None), "tokens",
                 f"uint16 memmap of {TOKENS >> 20} Mi tokens, random 2049-token windows "
                 "as int64, batch 32", prepare=prepare_tokens, needs=("numpy",)),
    ]}


WORKLOADS = _builtin()


def user_workload(target: str, batch_size: Optional[int] = None) -> Workload:
    """``--dataset module:callable``. The callable (no arguments) returns a
    map-style Dataset, or a dict ``{"dataset": ds, "batch_size": 32,
    "collate_fn": fn}`` (the last two optional). The module must be
    importable (the current directory and ``sys.path`` are passed on)."""
    ds, bs, collate = load_user(target)
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__getitem__"):
        raise SystemExit(f"--dataset {target}: only map-style datasets (with __getitem__ and "
                         f"__len__) can be checked index by index")
    try:
        n = len(ds)
    except TypeError:
        raise SystemExit(f"--dataset {target}: the dataset has no len()") from None

    def make(cache: str) -> Tuple[Dataset, Optional[Callable]]:
        d, _, c = load_user(target)
        return Indexed(d), (IndexedCollate(c) if c is not None else None)

    return Workload(target, batch_size or bs or 32, make, "user", f"your dataset {target} ({n} samples)",
                    length=n, spec={"user": target})


def load_user(target: str) -> Tuple[Dataset, Optional[int], Optional[Callable]]:
    mod, sep, attr = target.partition(":")
    if not sep or not mod or not attr:
        raise SystemExit(f"--dataset wants module:callable, got {target!r}")
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--dataset {target}: {type(e).__name__}: {e} (the module must be "
                         f"importable from the current directory or sys.path)") from None
    made = obj() if callable(obj) and not isinstance(obj, Dataset) else obj
    if isinstance(made, dict):
        return made["dataset"], made.get("batch_size"), made.get("collate_fn")
    return made, None, None


def missing_needs(w: Workload) -> List[str]:
    out = []
    for mod in w.needs:
        try:
            importlib.import_module(mod)
        except ImportError:
            out.append({"PIL": "pillow"}.get(mod, mod))
    return out


def rebuild(spec: Dict[str, Any], batch_size: int) -> Workload:
    """In a child process: the workload the parent described."""
    if "user" in spec:
        return user_workload(spec["user"], batch_size)
    return WORKLOADS[spec["name"]]


def timed_prepare(w: Workload, cache: str) -> float:
    t = time.perf_counter()
    if w.prepare is not None:
        w.prepare(cache)
    return time.perf_counter() - t
