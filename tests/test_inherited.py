"""Workers see the training process's environment, default dtype and
``warnings`` filters as they are at ``iter()``, as DataLoader's forked
workers do, although fastload's are forked from a zygote started earlier."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastload import FastLoader
from fastload.common.inherited import InheritedSettings

VAR = "FASTLOAD_TEST_SETTING"
GONE = "FASTLOAD_TEST_GONE"


class Snoop(Dataset):
    """Each sample: what its worker sees of the process state."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn("fastload test: silenced by the script", UserWarning)
        return {"env": os.environ.get(VAR, "<unset>"), "gone": os.environ.get(GONE, "<unset>"),
                "dtype": str(torch.tensor([0.5]).dtype), "warned": len(caught),
                "modes": f"{torch.is_grad_enabled()} {torch.are_deterministic_algorithms_enabled()} "
                         f"{torch.get_float32_matmul_precision()}"}


def _seen(loader) -> list:
    return [(b["env"], b["gone"], b["dtype"], b["warned"].tolist(), b["modes"]) for b in loader]


@pytest.fixture
def script_state(monkeypatch):
    """What a training script might set after building its loader; undone after."""
    dtype, precision = torch.get_default_dtype(), torch.get_float32_matmul_precision()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the script's own filters, before it changes them
        def change() -> None:
            monkeypatch.setenv(VAR, "set after the loader")
            monkeypatch.delenv(GONE, raising=False)
            torch.set_default_dtype(torch.float64)
            torch.set_grad_enabled(False)
            torch.use_deterministic_algorithms(True)
            torch.set_float32_matmul_precision("medium")
            warnings.filterwarnings("ignore", message="fastload test: silenced")
        try:
            yield change
        finally:
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(True)
            torch.use_deterministic_algorithms(False)
            torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("how", ["default", "persistent", "spawn"])
def test_workers_see_what_the_script_set_before_iter(script_state, monkeypatch, how: str) -> None:
    kw: dict = {"persistent": dict(persistent_workers=True),
                "spawn": dict(multiprocessing_context="spawn")}.get(how, {})
    monkeypatch.setenv(GONE, "set before the loader, unset after")
    loader = FastLoader(Snoop(), batch_size=2, num_workers=2, **kw)
    reference = DataLoader(Snoop(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    try:
        before = _seen(loader)
        assert before == _seen(reference)
        assert before[0] == (["<unset>"] * 2, ["set before the loader, unset after"] * 2,
                             ["torch.float32"] * 2, [1, 1], ["True False highest"] * 2)
        script_state()
        after = _seen(loader)
        expected = _seen(reference)
        if how == "persistent":  # the same workers all along, as DataLoader's
            assert after == before
        else:
            assert after == expected
            assert after[0] == (["set after the loader"] * 2, ["<unset>"] * 2,
                                ["torch.float64"] * 2, [0, 0], ["False True medium"] * 2)
    finally:
        del loader


def test_accelerators_stay_hidden_and_the_state_round_trips(monkeypatch) -> None:
    """Applying a state leaves the accelerator variables as this process has
    them (the loader hides them in workers), and sets everything else; the
    filters naming a warning class this process has not imported stay out."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv(VAR, "here")
    dtype = torch.get_default_dtype()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="a pattern", category=DeprecationWarning,
                                module="some\\.module", lineno=7)
        warnings.simplefilter("ignore", ResourceWarning)
        warnings.simplefilter("ignore", SnoopWarning)
        state = InheritedSettings.capture()
        captured_filters = list(warnings.filters)
        state.environ["CUDA_VISIBLE_DEVICES"] = "0"
        state.warning_filters.insert(0, ("ignore", None, ("not.imported.anywhere", "W"), None, 0))
        monkeypatch.delenv(VAR)
        monkeypatch.setenv(GONE, "not in the captured state")
        warnings.resetwarnings()
        torch.set_default_dtype(torch.float64)
        try:
            pickle.loads(pickle.dumps(state)).apply_filters()
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
            assert os.environ[VAR] == "here"
            assert GONE not in os.environ
            assert torch.get_default_dtype() == dtype
            assert warnings.filters == captured_filters
            assert "not.imported.anywhere" not in sys.modules
        finally:
            torch.set_default_dtype(dtype)


class SnoopWarning(UserWarning):
    pass


def test_a_filter_does_not_import_its_warning_class_s_package_in_workers(
        tmp_path, monkeypatch, caplog) -> None:
    """Lightning and SciPy install filters for their own warning classes.
    Workers that never import those packages get no such filter, rather than
    an import each (which in the zygote starts threads and stops it sharing
    the dataset)."""
    (tmp_path / "heavy_package.py").write_text(
        "import os\n"
        "with open(os.environ['FASTLOAD_TEST_IMPORTS'], 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "class HeavyWarning(Warning):\n"
        "    pass\n")
    imports = tmp_path / "imports"
    monkeypatch.setenv("FASTLOAD_TEST_IMPORTS", os.fspath(imports))
    monkeypatch.syspath_prepend(os.fspath(tmp_path))
    monkeypatch.delitem(sys.modules, "heavy_package", raising=False)
    import heavy_package

    loader = FastLoader(Snoop(), batch_size=2, num_workers=2)
    try:
        with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="fastload"):
            warnings.simplefilter("always")
            warnings.simplefilter("ignore", heavy_package.HeavyWarning)
            for _epoch in range(2):
                assert len(list(loader)) == 2
    finally:
        del loader
    assert imports.read_text().split() == [str(os.getpid())]  # this process's import only
    assert not [r for r in caplog.records if "unpickle the dataset themselves" in r.getMessage()]


_DETERMINISTIC_SCRIPT = r"""
import sys
import torch
from torch.utils.data import Dataset
import fastload
from fastload.common.inherited import set_deterministic


class Snoop(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return [torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                "torch._inductor" in sys.modules]


def state():
    import torch._inductor.config as inductor_config
    return (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), inductor_config.deterministic)


torch.use_deterministic_algorithms(True, warn_only=True)
for ctx in (None, "spawn"):
    loader = fastload.FastLoader(Snoop(), batch_size=None, num_workers=1,
                                 multiprocessing_context=ctx)
    print("worker", ctx, [[bool(x) for x in b] for b in loader])
    del loader

# The private setter leaves the state the public function leaves.
for mode, warn_only in [(True, False), (False, False), (True, True), (False, True)]:
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    public = state()
    torch.use_deterministic_algorithms(not mode, warn_only=not warn_only)
    set_deterministic(mode, warn_only)
    print("same", mode, warn_only, state() == public, public)
"""


def test_deterministic_algorithms_reach_workers_without_importing_inductor(tmp_path) -> None:
    """A script that asks for deterministic algorithms (Ultralytics does by
    default) has them in its workers, as under DataLoader, without the import
    of ``torch._inductor`` that ``torch.use_deterministic_algorithms`` makes
    (1-1.5 s before every loader's first batch). The private setter fastload
    uses for it must leave the state the public function leaves: this pins
    it."""
    import subprocess

    script = tmp_path / "deterministic.py"
    script.write_text(_DETERMINISTIC_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["worker None [[True, True, False], [True, True, False]]",
                         "worker spawn [[True, True, False], [True, True, False]]"], out.stdout
    same = [line for line in lines if line.startswith("same ")]
    assert len(same) == 4 and all(" True (" in line for line in same), out.stdout
