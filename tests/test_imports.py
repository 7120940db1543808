"""fastload's modules import each other in one direction: no import cycles.

Every import statement of every module is read from its source with
``ast``, those inside functions and ``if TYPE_CHECKING:`` blocks included
(an import deferred into a function still ties the two modules together;
deferring it only hides the cycle until some caller imports them in the
wrong order). The graph of fastload's modules must then hold no cycle but
the known ones listed below, and :mod:`fastload.launching` and
:mod:`fastload.transport` must each keep the dependency order its docstring
states.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest


# Cycles that exist today outside the launching code, each with its reason;
# any other cycle fails the test.
KNOWN_CYCLES = {
    # bench's __init__ imports its command line inside main() (the package
    # stays light: spawned workers import it to unpickle the built-in
    # datasets); cli imports its options, which read the package's
    # docstring for --help.
    frozenset({"fastload.bench", "fastload.bench.cli", "fastload.bench.options"}),
}

Graph = Dict[str, Dict[str, List[Tuple[int, bool]]]]  # module -> imported -> [(line, deferred)]


def _modules(root: Path, package: str) -> Dict[str, Tuple[Path, bool]]:
    """Every module of ``package`` (whose directory is ``root``) with a
    Python source: dotted name -> (path, whether it is a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _is_module(name: str, known: Dict[str, Tuple[Path, bool]]) -> bool:
    """Whether ``name`` is a module of the package (``from pkg import name``
    may name an attribute instead): one with a source, or one without (the
    compiled ``fastload._core``), looked for without running it."""
    if name in known:
        return True
    parent = name.rpartition(".")[0]
    if parent not in known or not known[parent][1]:
        return False  # outside the package, or an attribute of a module
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _imports(module: str, path: Path, is_package: bool,
             known: Dict[str, Tuple[Path, bool]]) -> Iterator[Tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each module that
    ``module``'s source imports."""
    tree = ast.parse(path.read_text(), str(path))
    in_function: Set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" if _is_module(f"{source}.{alias.name}", known)
                     else source for alias in node.names]
        else:
            continue
        for name in names:
            yield name, node.lineno, node in in_function


def _graph(package: str) -> Graph:
    root = Path(importlib.import_module(package).__file__).parent  # type: ignore[arg-type]
    known = _modules(root, package)
    graph: Graph = {name: {} for name in known}
    for name, (path, is_package) in known.items():
        for target, line, deferred in _imports(name, path, is_package, known):
            while target and not _is_module(target, known):  # outside: dropped
                target = target.rpartition(".")[0]
            if target and target != name:
                where = graph[name].setdefault(target, [])
                if (line, deferred) not in where:  # one per statement
                    where.append((line, deferred))
                graph.setdefault(target, {})  # fastload._core has no source
    return graph


def _cycles(graph: Graph) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: Graph, cycle: Set[str]) -> str:
    return "; ".join(f"{a} -> {b} (line {line}{', in a function' if deferred else ''})"
                     for a in sorted(cycle) for b, where in graph[a].items() if b in cycle
                     for line, deferred in where)


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclic_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from .b import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = _graph("cyclic_pkg")
    assert graph["cyclic_pkg.b"] == {"cyclic_pkg.a": [(2, True)]}
    assert _cycles(graph) == [{"cyclic_pkg.a", "cyclic_pkg.b"}]


def test_fastload_has_no_import_cycle():
    graph = _graph("fastload")
    # The graph is read right: edges known to exist are there.
    assert "fastload.launching.zygote_main" in graph["fastload.launching.boot"]
    assert "fastload.launching.parcels" in graph["fastload.worker.loop"]
    assert "fastload.transport.overflow" in graph["fastload.pool.ledger"]
    new = [c for c in _cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not new, "import cycles: " + " | ".join(_describe(graph, c) for c in new)


@pytest.mark.parametrize("package", ["fastload.launching", "fastload.transport"])
def test_a_package_keeps_its_documented_order(package: str) -> None:
    """Each module of the package imports only the package's modules its
    docstring lists before it, none inside a function; and the rest of
    fastload that it imports never leads back into it."""
    graph = _graph("fastload")
    doc = importlib.import_module(package).__doc__ or ""
    order = re.findall(r"^\s*\d+\. ``(\w+)``", doc, re.MULTILINE)
    mine = {m for m in graph if m.startswith(package + ".")}
    assert sorted(f"{package}.{m}" for m in order) == sorted(mine), \
        "the docstring's list and the package's modules differ"
    for i, name in enumerate(order):
        module = f"{package}.{name}"
        for target, where in graph[module].items():
            if target in mine:
                assert target in {f"{package}.{m}" for m in order[:i]}, \
                    f"{module} imports {target}, listed after it"
            if target.startswith("fastload"):
                assert not any(deferred for _line, deferred in where), \
                    f"{module} imports {target} inside a function (line {where[0][0]})"
    outside = {t for m in mine for t in graph[m] if t not in mine and t.startswith("fastload")}
    seen: Set[str] = set()
    todo = list(outside)
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        assert v not in mine and v != package, \
            f"{package} imports {sorted(outside)}, and one of them leads back into it ({v})"
        todo.extend(graph[v])


def _unit(module: str) -> str:
    """The part of fastload a module belongs to: its subpackage
    (``fastload.pool`` for ``fastload.pool.ledger``) or, at the top level,
    the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _unit_graph(graph: Graph) -> Dict[str, Set[str]]:
    units: Dict[str, Set[str]] = {}
    for module, targets in graph.items():
        if not module.startswith("fastload") or module == "fastload":
            continue  # the package's __init__: the public surface imports every layer
        for target in targets:
            if target.startswith("fastload.") and _unit(target) != _unit(module):
                units.setdefault(_unit(module), set()).add(_unit(target))
        units.setdefault(_unit(module), set())
    return units


# What runs where decides who may import whom: code that runs in a worker
# never needs the main process's pool or iterators; the pool (a ring and
# its processes) is used by the iterators and never uses them; the leaves
# below are used by every layer and use none of them. The top-level modules
# consume the whole loader (the public surface): no subpackage imports them.
CONSUMERS = {"fastload.loader", "fastload.install", "fastload.debug", "fastload.run_report",
             "fastload.__main__", "fastload.bench"}
LAYERS = {"fastload.worker", "fastload.pool", "fastload.iterator"}
LEAVES = ("fastload.common", "fastload.launching", "fastload.transport", "fastload.resume",
          "fastload.stats", "fastload.device")
MAY_NOT_IMPORT = {
    "fastload.worker": {"fastload.pool", "fastload.iterator", *CONSUMERS},
    "fastload.pool": {"fastload.iterator", *CONSUMERS},
    "fastload.iterator": CONSUMERS,
    **{leaf: LAYERS | CONSUMERS for leaf in LEAVES},
}


def test_subpackages_import_in_one_direction() -> None:
    """Taken as wholes, fastload's subpackages and top-level modules form no
    cycle: none is both imported by a part below it and importing a part
    above it. And the layers keep to what their processes need."""
    units = _unit_graph(_graph("fastload"))
    assert {"fastload.worker", "fastload.pool", "fastload.iterator"} <= set(units)
    assert "fastload.pool" in units["fastload.iterator"]  # read right: a known edge
    new = [c for c in _cycles({u: {t: [] for t in ts} for u, ts in units.items()})
           if frozenset(c) not in {frozenset({"fastload.bench"})}]
    assert not new, f"parts of fastload that import each other: {new}"
    for unit, forbidden in MAY_NOT_IMPORT.items():
        bad = units.get(unit, set()) & forbidden
        assert not bad, f"{unit} imports {sorted(bad)}"


def test_each_subpackage_says_its_job() -> None:
    root = Path(importlib.import_module("fastload").__file__).parent  # type: ignore[arg-type]
    subpackages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert {"iterator", "pool", "worker", "resume", "stats", "device", "launching",
            "transport"} <= set(subpackages)
    for name in subpackages:
        doc = importlib.import_module(f"fastload.{name}").__doc__
        assert doc and doc.strip(), f"fastload.{name} has no docstring"
        first = doc.strip().split("\n\n")[0]
        assert first.rstrip().endswith("."), f"fastload.{name}: its job in one sentence first"


def test_the_top_level_keeps_to_the_public_surface() -> None:
    root = Path(importlib.import_module("fastload").__file__).parent  # type: ignore[arg-type]
    modules = sorted(p.stem for p in root.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(modules) <= 12, f"{len(modules)} modules at the top level: {modules}"
    assert {f"fastload.{m}" for m in modules} <= CONSUMERS, "a top-level module no consumer"
    graph = _graph("fastload")
    for module, targets in graph.items():  # the package itself: its __init__ is public surface
        if module.count(".") >= 2 and not module.startswith("fastload.bench"):
            assert "fastload" not in targets, f"{module} imports the fastload package itself"
    units = _unit_graph(graph)
    for unit, targets in units.items():
        if unit.count(".") == 1 and unit not in CONSUMERS:  # a subpackage (or the extension)
            top = {t for t in targets if t in CONSUMERS and t != "fastload.bench"}
            assert not top, f"{unit} imports the top-level {sorted(top)}"
