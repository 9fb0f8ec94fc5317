"""No import cycle between fleetx's units, counting every import statement.

A *unit* is a subpackage of ``fleetx`` (``fleetx/fleet/``, ``fleetx/ps/``, and any package added
later: ``parallel``, ``data``, ``checkpoint`` ... are found by walking the tree, not listed here),
a top-level module (``fleetx/env.py``, ``fleetx/role_maker.py``), or the package root
(``fleetx/__init__.py``, unit ``fleetx``). Every ``import`` / ``from ... import`` in every file
counts, wherever it stands: a function-level ("late") import only postpones the cycle to run
time, it does not remove it; so does ``importlib.import_module("fleetx.x")`` with a constant name. ``from fleetx import x`` counts as an edge to unit ``x`` when ``x``
is a unit, and to the root otherwise; relative imports are resolved against the file's package.

Also checked here: the parameter server's core (``fleetx.ps``) imports no torch, as
``docs/parameter_server.md`` says.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

import fleetx

PACKAGE = Path(fleetx.__file__).parent
ROOT = "fleetx"

Edge = Tuple[str, str]          # (from unit, to unit)
Where = Dict[Edge, str]         # an edge -> "file:line" of one import that makes it


def _units(pkg: Path) -> Set[str]:
    """The units of the package rooted at ``pkg``: subpackages and top-level modules."""
    units = {ROOT}
    for p in pkg.iterdir():
        if p.is_dir() and (p / "__init__.py").exists():
            units.add(p.name)
        elif p.suffix == ".py" and p.name != "__init__.py":
            units.add(p.stem)
    return units


def _module_of(pkg: Path, path: Path) -> List[str]:
    """``fleetx/ps/client.py`` -> ``["fleetx", "ps", "client"]`` (a package's ``__init__`` is the
    package itself)."""
    parts = [ROOT] + list(path.relative_to(pkg).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _unit_of(dotted: List[str], units: Set[str]) -> Optional[str]:
    """The unit a dotted module path inside fleetx belongs to (None outside fleetx)."""
    if not dotted or dotted[0] != ROOT:
        return None
    if len(dotted) == 1 or dotted[1] not in units:
        return ROOT
    return dotted[1]


def _dynamic(node: ast.Call) -> Optional[str]:
    """The module a call ``importlib.import_module("fleetx.x")`` / ``__import__("fleetx.x")``
    with a constant name loads (it is an import too), else None."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ("import_module", "__import__") and node.args and \
            isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _targets(node: ast.AST, here: List[str], is_pkg: bool, units: Set[str]) -> List[str]:
    """The units one import statement (or constant dynamic import) in module ``here`` reaches."""
    if isinstance(node, ast.Call):
        name = _dynamic(node)
        return [u] if name and (u := _unit_of(name.split("."), units)) else []
    if isinstance(node, ast.Import):
        return [u for a in node.names if (u := _unit_of(a.name.split("."), units))]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = here if is_pkg else here[:-1]
        base = base[:len(base) - (node.level - 1)]
        dotted = base + (node.module.split(".") if node.module else [])
    else:
        dotted = node.module.split(".")
    if dotted == [ROOT]:
        # `from fleetx import env` reaches unit env; `from fleetx import fleet_api_name` the root
        return [n.name if n.name in units else ROOT for n in node.names]
    unit = _unit_of(dotted, units)
    return [unit] if unit else []


def unit_graph(pkg: Path) -> Tuple[Dict[str, Set[str]], Where]:
    """Parse every ``.py`` under ``pkg`` and return the unit graph and where each edge comes from.

    Args:
        pkg: the directory of the ``fleetx`` package (or a synthetic tree shaped like it).
    """
    units = _units(pkg)
    graph: Dict[str, Set[str]] = {u: set() for u in units}
    where: Where = {}
    for path in sorted(pkg.rglob("*.py")):
        here = _module_of(pkg, path)
        src = _unit_of(here, units)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                continue
            for dst in _targets(node, here, path.name == "__init__.py", units):
                if dst != src:
                    graph[src].add(dst)
                    where.setdefault((src, dst), f"{path.relative_to(pkg.parent)}:{node.lineno}")
    return graph, where


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None. Depth-first, in sorted order so the
    answer is stable."""
    state: Dict[str, int] = {}      # 1 = on the current path, 2 = finished
    stack: List[str] = []

    def visit(u: str) -> Optional[List[str]]:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def describe(cycle: List[str], where: Where) -> str:
    """``fleet -> metrics (fleetx/fleet/x.py:3) -> fleet (fleetx/metrics/y.py:9)``."""
    hops = [f"{b} ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join([cycle[0]] + hops)


def assert_acyclic(pkg: Path) -> None:
    graph, where = unit_graph(pkg)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between fleetx units: {describe(cycle, where)}"


def test_fleetx_units_import_no_cycle():
    assert_acyclic(PACKAGE)


def test_the_graph_sees_the_packages_that_exist_today():
    graph, _ = unit_graph(PACKAGE)
    assert {"fleet", "ps", "ps_torch", "strategy", "launch", "env", "role_maker"} <= set(graph)
    assert "nn" in graph["ps_torch"] and "ps" in graph["ps_torch"]


def test_the_ps_adapter_sits_above_the_core_and_nn():
    graph, _ = unit_graph(PACKAGE)
    assert "ps_torch" not in graph["ps"] and "ps_torch" not in graph["nn"]


def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    pkg = tmp_path / "fleetx"
    for rel, text in files.items():
        f = pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return pkg


@pytest.mark.parametrize("files, cycle", [
    # a function-level import closes the cycle as surely as a top-level one
    ({"__init__.py": "", "fleet/__init__.py": "from fleetx.metrics import auc\n",
      "metrics/__init__.py": "", "metrics/auc.py": "def f():\n    from fleetx.fleet import x\n"},
     "fleet -> metrics (fleetx/fleet/__init__.py:1) -> fleet (fleetx/metrics/auc.py:2)"),
    # `from fleetx import env` reaches unit env; a new package is a unit without being listed
    ({"__init__.py": "", "env.py": "import fleetx.parallel.mesh\n",
      "parallel/__init__.py": "", "parallel/mesh.py": "from fleetx import env\n"},
     "env -> parallel (fleetx/env.py:1) -> env (fleetx/parallel/mesh.py:1)"),
    # relative imports, two levels up, and the root as a unit
    ({"__init__.py": "from fleetx.data import loader\n", "data/__init__.py": "",
      "data/loader.py": "from .. import DistributedStrategy\n"},
     "data -> fleetx (fleetx/data/loader.py:1) -> data (fleetx/__init__.py:1)"),
    # a dynamic import with a constant name is an import
    ({"__init__.py": "", "launch/__init__.py": "import importlib\n"
      "def f():\n    return importlib.import_module('fleetx.strategy.algorithms.amp')\n",
      "strategy/__init__.py": "from fleetx.launch import f\n"},
     "launch -> strategy (fleetx/launch/__init__.py:3) -> launch (fleetx/strategy/__init__.py:1)"),
    ({"__init__.py": "", "checkpoint/__init__.py": "from .io import save\n",
      "checkpoint/io.py": "from ..ps import table\n", "ps/__init__.py": "",
      "ps/table.py": "if True:\n    import fleetx.checkpoint\n"},
     "checkpoint -> ps (fleetx/checkpoint/io.py:1) -> checkpoint (fleetx/ps/table.py:2)"),
])
def test_a_cycle_fails_naming_it(tmp_path, files, cycle):
    with pytest.raises(AssertionError, match="import cycle between fleetx units: (.*)") as e:
        assert_acyclic(_tree(tmp_path, files))
    assert str(e.value).splitlines()[0].endswith(cycle)


def test_imports_inside_one_unit_and_outside_fleetx_are_no_edges(tmp_path):
    pkg = _tree(tmp_path, {"__init__.py": "import os\n", "ps/__init__.py": "from . import a\n",
                           "ps/a.py": "from .b import x\nimport numpy\n", "ps/b.py": ""})
    graph, _ = unit_graph(pkg)
    assert graph == {"fleetx": set(), "ps": set()}


def test_the_ps_core_imports_no_torch():
    # every module of the core, in a fresh interpreter (servers are numpy-only processes)
    mods = [f"fleetx.ps.{p.stem}" for p in sorted((PACKAGE / "ps").glob("*.py"))
            if p.stem != "__init__"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_ps_adapter_exports_its_names_and_loads_torch_only_for_them():
    # a process that only drives a communicator (numpy) does not pay torch's import
    code = ("import sys\nfrom fleetx.ps_torch import make_communicator, Communicator\n"
            "print('torch' in sys.modules)\n"
            "from fleetx.ps_torch import LocalSparseBackend, ModelLayout, PSRuntime, "
            "RemoteSparseBackend\nprint('torch' in sys.modules, ModelLayout.__module__)\n"
            "import fleetx.ps_torch as p\ntry:\n    p.nothing\nexcept AttributeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "False", "True fleetx.ps_torch.layout",
        "module 'fleetx.ps_torch' has no attribute 'nothing'; it has Communicator, "
        "LocalSparseBackend, ModelLayout, PSRuntime, RemoteSparseBackend, make_communicator"]
