"""fastload needs nothing at run time that torch does not bring: no numpy.

torch does not depend on numpy, so a training environment may have torch
and fastload alone. Each case runs a script in a fresh interpreter where
``import numpy`` fails in the training process and in every worker (a
``numpy`` package that raises ImportError comes first on ``PYTHONPATH``),
and compares an epoch against DataLoader's, batches kept alive (so that
fastload copies them out of the ring) and dropped. CI also installs the
built wheel into a venv holding torch alone (``.ci/wheel_smoke.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

SCRIPT = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset
from fastload import FastLoader
try:
    import numpy
except ImportError:
    pass
else:
    raise SystemExit("numpy was importable")

class Rows(Dataset):
    def __len__(self): return 61
    def __getitem__(self, i):
        return {"x": torch.arange(5.0) + i, "nested": [torch.tensor(i), i * 2], "name": str(i)}

ctx = None if sys.argv[1] == "default" else sys.argv[1]
g = lambda: torch.Generator().manual_seed(3)
theirs = list(DataLoader(Rows(), batch_size=4, shuffle=True, generator=g()))
held = list(FastLoader(Rows(), batch_size=4, shuffle=True, generator=g(), num_workers=2,
                       multiprocessing_context=ctx))
def same(a, b):
    return (a["name"] == b["name"] and torch.equal(a["x"], b["x"])
            and torch.equal(a["nested"][0], b["nested"][0]) and torch.equal(a["nested"][1], b["nested"][1]))
assert len(held) == len(theirs) and all(same(a, b) for a, b in zip(held, theirs))
assert torch.equal(torch.cat([b["x"] for b in held]), torch.cat([b["x"] for b in theirs]))
dropped = [b["x"].clone() for b in FastLoader(Rows(), batch_size=4, shuffle=True, generator=g(),
                                               num_workers=2, multiprocessing_context=ctx)]
assert all(torch.equal(a, b["x"]) for a, b in zip(dropped, theirs))
print("OK", len(held))
"""


@pytest.mark.parametrize("ctx", ["default", pytest.param("spawn", marks=pytest.mark.slow),
                                 pytest.param("fork", marks=pytest.mark.slow)])
def test_an_epoch_without_numpy_matches_dataloader(tmp_path: Path, ctx: str) -> None:
    hidden = tmp_path / "hide" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ModuleNotFoundError("numpy is hidden for this test", name="numpy")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hidden.parent)] + [p for p in sys.path if p])
    env["PYTHONWARNINGS"] = "ignore:Failed to initialize NumPy:UserWarning"
    out = subprocess.run([sys.executable, "-c", SCRIPT, ctx], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-6000:]
    assert "OK 16" in out.stdout
