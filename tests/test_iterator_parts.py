"""The multi-process iterator is a driver over parts that own their state.

Read from the source with ``ast``: no class of :mod:`fastload.iterator` is
a mixin or inherits from anything but DataLoader's own iterators, and no code there reads or sets a
private name (``x._name``) of any object but ``self``: a part's state is
reached through its methods and public attributes only, so each part can
be read, changed and tested on its own.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import List

from torch.utils.data.dataloader import _BaseDataLoaderIter

from fastload.iterator.multi_process import FastLoaderIter


def _sources() -> List[Path]:
    root = Path(importlib.import_module("fastload.iterator").__file__).parent  # type: ignore[arg-type]
    return sorted(root.glob("*.py"))


def test_the_iterator_has_no_mixin() -> None:
    assert FastLoaderIter.__bases__ == (_BaseDataLoaderIter,)
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert "Mixin" not in node.name, f"{path.name}: class {node.name}"
                for base in node.bases:
                    name = ast.unparse(base)
                    assert name in ("_BaseDataLoaderIter", "_SingleProcessDataLoaderIter", "enum.Enum"), \
                        f"{path.name}: {node.name} inherits from {name}"


def _reach_ins(source: str) -> List[str]:
    """``x._name`` where ``x`` is not ``self``, ``cls`` or ``super()`` (the
    iterators' own base, DataLoader's), with its line. torch's own private
    names (``torch._C...``) are not parts' state: tests/test_torch_privates.py
    pins each one fastload uses."""
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            and ast.unparse(node.value) != "super()"
            and not ast.unparse(node.value).startswith("torch.")
            and ast.unparse(node.value) != "torch"]


def test_the_checker_sees_a_reach_in() -> None:
    source = ("class A:\n    def f(self, other):\n        self._mine = other._theirs\n"
              "        return self.part._state\n")
    assert _reach_ins(source) == ["3: other._theirs", "4: self.part._state"]


def test_no_part_reads_another_parts_private_names() -> None:
    found = [f"{path.name}:{hit}" for path in _sources() for hit in _reach_ins(path.read_text())]
    assert not found, "private names of other objects: " + "; ".join(found)
