"""No import cycle in fleetx, between its units and between its files, counting every import.

Both graphs are built from the source (every ``.py`` under ``fleetx/``), not from a running
interpreter, and every import statement counts wherever it stands: a function-level ("late")
import only postpones a cycle to run time, it does not remove it.

**Modules** (files). ``fleetx/ps/client.py`` is module ``fleetx.ps.client``, a package's
``__init__.py`` is the package itself (``fleetx.ps``), and a C source that setup.py builds
(``fleetx/ps/_kernels.c``) is the extension module of its name (``fleetx.ps._kernels``). What one
statement in module M reaches:

* ``import a.b.c`` reaches ``a.b.c`` (the longest prefix of it that is a module of fleetx);
* ``from a.b import n`` reaches ``a.b.n`` when ``n`` is a submodule of package ``a.b``, and
  otherwise ``a.b`` itself: the ``__init__`` (or module) that binds ``n``. Relative imports are
  resolved against M's package;
* ``importlib.import_module(x)`` / ``__import__(x)`` reaches ``x`` when it is a constant, each
  value of a module-level table of constant names when ``x`` indexes one (a lazy
  ``__getattr__``'s ``_LAZY[name]``, also inside an f-string), and every module of package ``P``
  for ``f"P.{...}"`` (the planner loading each strategy). Any other dynamic import is listed by
  :func:`module_graph`, and a test keeps that list to the one known case;
* reaching a module also reaches the packages above it, which Python runs first (importing
  ``fleetx.ps.client`` from ``fleetx.data`` runs ``fleetx/ps/__init__.py``), except M's own
  packages: Python started running those before M, so importing through them runs nothing anew.

That last rule is what keeps the normal package pattern acyclic: ``fleetx/ps/__init__.py``
imports ``fleetx.ps.client``, and client's ``from fleetx.ps import wire`` (or ``from . import
wire``) reaches ``fleetx.ps.wire`` only. A submodule that takes a *name* from its package's
``__init__`` (``from fleetx.fleet import _fleet``) reaches that ``__init__`` by rule two; if the
``__init__`` imports the submodule back, directly or through others, that is a cycle, and a
real one: the name exists only once the ``__init__`` has run past the line binding it.

**Units.** A unit is a subpackage of ``fleetx`` (``fleetx/fleet/``, ``fleetx/ps/``, and any
package added later: they are found by walking the tree, not listed here), a top-level module
(``fleetx/env.py``, ``fleetx/role_maker.py``), or the package root (``fleetx/__init__.py``, unit
``fleetx``). Two units are joined when a module of one reaches a module of the other; so ``from
fleetx import x`` joins unit ``x`` when ``x`` is a unit, and the root otherwise.

Also checked here: the parameter server's core (``fleetx.ps``) imports no torch, as
``docs/parameter_server.md`` says.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

import fleetx

PACKAGE = Path(fleetx.__file__).parent
ROOT = "fleetx"

Edge = Tuple[str, str]          # (from module or unit, to module or unit)
Where = Dict[Edge, str]         # an edge -> "file:line" of one import that makes it
Graph = Dict[str, Set[str]]


def _modules(pkg: Path) -> Dict[str, Path]:
    """Every module of the package rooted at ``pkg``, by dotted name -> its file."""
    found = {}
    for path in sorted(pkg.rglob("*")):
        if path.suffix in (".py", ".c") and "__pycache__" not in path.parts:
            parts = [ROOT] + list(path.relative_to(pkg).with_suffix("").parts)
            found.setdefault(".".join(parts[:-1] if parts[-1] == "__init__" else parts), path)
    return found


def _known(dotted: str, modules: Dict[str, Path]) -> Optional[str]:
    """The longest prefix of ``dotted`` that is a module of fleetx (None outside fleetx)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _parents(module: str) -> List[str]:
    """``fleetx.ps.client`` -> ``["fleetx", "fleetx.ps"]``."""
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def _tables(tree: ast.Module) -> Dict[str, List[str]]:
    """The module-level dicts (their values) and sets of constant strings, by name."""
    tables = {}
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        items = node.value.values if isinstance(node.value, ast.Dict) else \
            node.value.elts if isinstance(node.value, ast.Set) else None
        if isinstance(target, ast.Name) and items and all(
                isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
            tables[target.id] = [i.value for i in items]
    return tables


def _names(expr: ast.AST, tables: Dict[str, List[str]]) -> Optional[List[str]]:
    """The names a dynamic import's argument can take; ``*`` stands for an unknown part."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
        return tables.get(expr.value.id)
    if isinstance(expr, ast.FormattedValue):
        return _names(expr.value, tables) or ["*"]
    if isinstance(expr, ast.JoinedStr):
        names = [""]
        for part in expr.values:
            names = [n + p for n in names for p in _names(part, tables) or ["*"]]
        return names
    return None


def _dynamic(node: ast.Call) -> Optional[ast.AST]:
    """The argument of a call ``importlib.import_module(x)`` / ``__import__(x)``, else None."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return node.args[0] if name in ("import_module", "__import__") and node.args else None


class _Reach:
    """What the import statements of one module reach (the rules of this file's docstring)."""

    def __init__(self, name: str, is_pkg: bool, modules: Dict[str, Path]) -> None:
        self.name, self.is_pkg, self.modules = name, is_pkg, modules
        # the module's own packages have started running before it: reaching them runs nothing
        self.running = set(_parents(name)) | {name}

    def _with_parents(self, target: str) -> List[str]:
        return [p for p in _parents(target) if p not in self.running] + [target]

    def _named(self, names: List[str]) -> List[str]:
        """The modules a dynamic import of one of ``names`` reaches (``P.*``: each of P's)."""
        out = []
        for n in names:
            if n.endswith(".*") and n.count("*") == 1 and n[:-2] in self.modules:
                out += [m for m in self.modules if m.rpartition(".")[0] == n[:-2]]
            elif "*" not in n and (m := _known(n, self.modules)):
                out.append(m)
        return [t for m in out for t in self._with_parents(m)]

    def targets(self, node: ast.AST, tables: Dict[str, List[str]]) -> Optional[List[str]]:
        """The modules ``node`` reaches; None for a dynamic import whose name is not known."""
        if isinstance(node, ast.Call):
            names = _names(_dynamic(node), tables)
            if names is None or any("*" in n and not n.endswith(".*") for n in names):
                return None
            return self._named(names)
        if isinstance(node, ast.Import):
            return [t for a in node.names if (m := _known(a.name, self.modules))
                    for t in self._with_parents(m)]
        if node.level:
            base = self.name.split(".") if self.is_pkg else self.name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            dotted = ".".join(base + (node.module.split(".") if node.module else []))
        else:
            dotted = node.module
        if (module := _known(dotted, self.modules)) != dotted:
            return self._with_parents(module) if module else []
        # `from P import n`: the submodule P.n when there is one, else the names P binds
        subs = [f"{dotted}.{a.name}" for a in node.names]
        return [t for sub in subs
                for t in self._with_parents(sub if sub in self.modules else dotted)]


def _imports(tree: ast.Module) -> List[ast.AST]:
    """Every import statement and dynamic import of ``tree``, in the order of the source."""
    return sorted((node for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   or (isinstance(node, ast.Call) and _dynamic(node) is not None)),
                  key=lambda node: (node.lineno, node.col_offset))


def module_graph(pkg: Path) -> Tuple[Graph, Where, List[str]]:
    """Parse every ``.py`` under ``pkg``: the module graph, where each edge comes from, and the
    dynamic imports whose name is not known (``file:line``).

    Args:
        pkg: the directory of the ``fleetx`` package (or a synthetic tree shaped like it).
    """
    modules = _modules(pkg)
    graph: Graph = {m: set() for m in modules}
    where: Where = {}
    unknown = []
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        reach, tables = _Reach(name, path.name == "__init__.py", modules), _tables(tree)
        for node in _imports(tree):
            at = f"{path.relative_to(pkg.parent)}:{node.lineno}"
            targets = reach.targets(node, tables)
            if targets is None:
                unknown.append(at)
            for dst in targets or ():
                if dst != name:
                    graph[name].add(dst)
                    where.setdefault((name, dst), at)
    return graph, where, unknown


def _units(pkg: Path) -> Set[str]:
    """The units of the package rooted at ``pkg``: subpackages and top-level modules."""
    units = {ROOT}
    for p in pkg.iterdir():
        if p.is_dir() and (p / "__init__.py").exists():
            units.add(p.name)
        elif p.suffix == ".py" and p.name != "__init__.py":
            units.add(p.stem)
    return units


def _unit_of(module: str, units: Set[str]) -> str:
    """The unit a module of fleetx belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in units else ROOT


def _file_line(at: str) -> Tuple[str, int]:
    path, _, line = at.rpartition(":")
    return path, int(line)


def unit_graph(pkg: Path) -> Tuple[Graph, Where]:
    """The unit graph of the package rooted at ``pkg`` (its module graph, seen by unit) and
    where each edge comes from.

    Args:
        pkg: the directory of the ``fleetx`` package (or a synthetic tree shaped like it).
    """
    units = _units(pkg)
    _, module_where, _ = module_graph(pkg)
    graph: Graph = {u: set() for u in units}
    where: Where = {}
    for (a, b), at in sorted(module_where.items(), key=lambda kv: _file_line(kv[1])):
        src, dst = _unit_of(a, units), _unit_of(b, units)
        if src != dst:
            graph[src].add(dst)
            where.setdefault((src, dst), at)
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


def assert_modules_acyclic(pkg: Path) -> None:
    graph, where, _ = module_graph(pkg)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between fleetx modules: {describe(cycle, where)}"


def test_fleetx_units_import_no_cycle():
    assert_acyclic(PACKAGE)


def test_fleetx_modules_import_no_cycle():
    assert_modules_acyclic(PACKAGE)


def test_every_dynamic_import_in_fleetx_is_seen():
    # observe.api.require imports the optional library its caller names (tqdm, matplotlib...),
    # never a module of fleetx; any other dynamic import must be one the graph can follow
    _, _, unknown = module_graph(PACKAGE)
    assert {at.rpartition(":")[0] for at in unknown} == {"fleetx/observe/api.py"}


def test_the_c_sources_are_the_extension_modules_setup_builds():
    # the graph takes fleetx/ps/_kernels.c for module fleetx.ps._kernels: setup.py must agree
    setup = (PACKAGE.parent / "setup.py").read_text()
    built = dict(re.findall(r'Extension\("([\w.]+)", \["([\w/.]+)"\]', setup))
    sources = {f"{ROOT}.{'.'.join(c.relative_to(PACKAGE).with_suffix('').parts)}":
               str(c.relative_to(PACKAGE.parent)) for c in PACKAGE.rglob("*.c")}
    assert built == sources and sources


def test_the_module_graph_follows_the_lazy_tables_and_the_strategy_loader():
    graph, _, _ = module_graph(PACKAGE)
    assert {"fleetx.fleet", "fleetx.role_maker", "fleetx.strategy.distributed_strategy"} <= \
        graph["fleetx"]
    assert {"fleetx.ps_torch.layout", "fleetx.ps_torch.runtime"} <= graph["fleetx.ps_torch"]
    assert {"fleetx.strategy.algorithms.amp", "fleetx.strategy.algorithms.auto"} <= \
        graph["fleetx.strategy.planner"]
    assert "fleetx.ps._kernels" in graph["fleetx.ps.kernels"]


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


@pytest.mark.parametrize("files, cycle", [
    # two files of one package; the late import closes the cycle all the same
    ({"__init__.py": "", "data/__init__.py": "",
      "data/readers.py": "def start():\n    from fleetx.data.reader_process import Proc\n",
      "data/reader_process.py": "from fleetx.data.readers import ReadOptions\n"},
     "fleetx.data.reader_process -> fleetx.data.readers (fleetx/data/reader_process.py:1) -> "
     "fleetx.data.reader_process (fleetx/data/readers.py:2)"),
    # a submodule taking a name its package's __init__ binds, while the __init__ imports it
    ({"__init__.py": "", "fleet/__init__.py": "from fleetx.fleet.util import UtilBase\n"
      "_fleet = object()\n",
      "fleet/util.py": "def world():\n    from fleetx.fleet import _fleet\n"},
     "fleetx.fleet -> fleetx.fleet.util (fleetx/fleet/__init__.py:1) -> "
     "fleetx.fleet (fleetx/fleet/util.py:2)"),
    # importing a submodule from outside its package runs the package's __init__ first
    ({"__init__.py": "", "strategy/__init__.py": "", "strategy/algorithms/amp.py": "",
      "strategy/algorithms/__init__.py": "from fleetx.strategy import planner\n",
      "strategy/planner.py": "from fleetx.strategy.algorithms.amp import AmpStrategy\n"},
     "fleetx.strategy.algorithms -> fleetx.strategy.planner "
     "(fleetx/strategy/algorithms/__init__.py:1) -> "
     "fleetx.strategy.algorithms (fleetx/strategy/planner.py:1)"),
    # a lazy __getattr__'s table of modules, inside an f-string
    ({"__init__.py": "", "ps_torch/__init__.py": "import importlib\n_LAZY = {'X': 'layout'}\n"
      "def __getattr__(name):\n"
      "    return importlib.import_module(f'fleetx.ps_torch.{_LAZY[name]}')\n",
      "ps_torch/layout.py": "from fleetx.ps_torch import Communicator\n"},
     "fleetx.ps_torch -> fleetx.ps_torch.layout (fleetx/ps_torch/__init__.py:4) -> "
     "fleetx.ps_torch (fleetx/ps_torch/layout.py:1)"),
    # a loader of every module of a package reaches each of them
    ({"__init__.py": "", "strategy/__init__.py": "", "strategy/algorithms/__init__.py": "",
      "strategy/planner.py": "import importlib\ndef load(name):\n"
      "    importlib.import_module(f'fleetx.strategy.algorithms.{name}')\n",
      "strategy/algorithms/auto.py":
          "def plan():\n    from fleetx.strategy.planner import make_plan\n"},
     "fleetx.strategy.algorithms.auto -> fleetx.strategy.planner "
     "(fleetx/strategy/algorithms/auto.py:2) -> "
     "fleetx.strategy.algorithms.auto (fleetx/strategy/planner.py:3)"),
])
def test_a_module_cycle_fails_naming_it(tmp_path, files, cycle):
    with pytest.raises(AssertionError, match="import cycle between fleetx modules: (.*)") as e:
        assert_modules_acyclic(_tree(tmp_path, files))
    assert str(e.value).splitlines()[0].endswith(cycle)


def test_a_package_importing_its_submodules_is_no_cycle(tmp_path):
    # the package's own __init__ has started before its submodules run: reaching a sibling
    # through it (`from fleetx.ps import wire`, `from . import kernels`) runs nothing anew
    pkg = _tree(tmp_path, {
        "__init__.py": "", "ps/__init__.py": "from fleetx.ps.client import Client\n"
        "from . import wire\n", "ps/wire.py": "", "ps/_kernels.c": "",
        "ps/client.py":
            "from fleetx.ps import wire\nfrom . import kernels\nimport fleetx.ps.wire\n",
        "ps/kernels.py": "from fleetx.ps import _kernels\n", "data/__init__.py": "",
        "data/feed.py": "from fleetx.ps.client import Client\n"})
    assert_modules_acyclic(pkg)
    graph, where, _ = module_graph(pkg)
    assert graph["fleetx.ps.client"] == {"fleetx.ps.wire", "fleetx.ps.kernels"}
    assert graph["fleetx.ps.kernels"] == {"fleetx.ps._kernels"}  # the C extension, not the package
    assert graph["fleetx.data.feed"] == {"fleetx.ps", "fleetx.ps.client"}
    assert where[("fleetx.data.feed", "fleetx.ps")] == "fleetx/data/feed.py:1"


def test_imports_inside_one_unit_and_outside_fleetx_are_no_edges(tmp_path):
    pkg = _tree(tmp_path, {"__init__.py": "import os\n", "ps/__init__.py": "from . import a\n",
                           "ps/a.py": "from .b import x\nimport numpy\n", "ps/b.py": ""})
    graph, _ = unit_graph(pkg)
    assert graph == {"fleetx": set(), "ps": set()}


def test_the_ps_layers_its_docstring_lists_hold():
    # fleetx/ps/__init__.py lists every module of the core in layers, bottom up
    text = (PACKAGE / "ps" / "__init__.py").read_text()
    layers = re.findall(r"^\* ((?::mod:`\.\w+`,?\s+)+)- ", text, re.M)
    layer_of = {f"fleetx.ps.{m}": i for i, layer in enumerate(layers)
                for m in re.findall(r":mod:`\.(\w+)`", layer)}
    graph, where, _ = module_graph(PACKAGE)
    core = {m for m in graph if m.startswith("fleetx.ps.") and m != "fleetx.ps._kernels"}
    assert core == set(layer_of), "modules missing from the layers, or listed but absent"
    upward = [f"{a} -> {b} ({where[(a, b)]})" for a in sorted(core) for b in sorted(graph[a])
              if b in layer_of and layer_of[b] > layer_of[a]]
    assert upward == [], "imports of a later layer of fleetx/ps/__init__.py's list"


def test_the_ps_layer_table_of_the_docs_holds():
    # docs/parameter_server.md §1: every module of the core has a row, imports only the rows
    # above its own (the contract's parts aside), and depends on what its row says
    text = (PACKAGE.parent / "docs" / "parameter_server.md").read_text()
    section = text[text.index("## 1. Layers"):text.index("## 2. ")]
    rows = re.findall(r"^\| `(\w+)\.py`[^|]*\|[^|]*\| ([^|]*) \|$", section, re.M)
    place = {f"fleetx.ps.{name}": i for i, (name, _) in enumerate(rows)}
    graph, where, _ = module_graph(PACKAGE)
    core = {m for m in graph if m.startswith("fleetx.ps.") and m != "fleetx.ps._kernels"}
    assert core == set(place)
    contract = {f"fleetx.ps.{m}" for m in ("api", "errors", "wire", "specs", "config")}
    later = [f"{a} -> {b} ({where[(a, b)]})" for a in sorted(core) for b in sorted(graph[a])
             if b in place and b not in contract and place[b] > place[a]]
    assert later == [], "imports of a module listed below in docs/parameter_server.md"
    for name, deps in rows:
        stated = {f"fleetx.ps.{d.strip()}" for d in deps.split(",") if d.strip() != "—"
                  and not d.strip().startswith("`")}
        actual = graph[f"fleetx.ps.{name}"]
        assert stated <= actual, f"{name}.py does not import {sorted(stated - actual)}"


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
