"""Every class name means one thing in fleetx: no two modules define a class of the same name.

A second ``Communicator`` or ``ConfigError`` makes a traceback, a doc link or a grep ambiguous.
The tree is parsed (every ``class`` statement at module level under ``fleetx/``), so a clash in
a package added later fails here too.
"""
import ast
from collections import defaultdict
from pathlib import Path

import fleetx

PACKAGE = Path(fleetx.__file__).parent

# Names still defined twice, each with the reason it is not yet resolved. Shrink, never grow.
PENDING: dict = {}


def class_definitions(pkg: Path) -> dict:
    """``{class name: [module file, ...]}`` for every module-level class under ``pkg``."""
    where = defaultdict(list)
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(pkg.parent)))
    return where


def clashes(pkg: Path) -> dict:
    return {name: files for name, files in class_definitions(pkg).items() if len(files) > 1}


def test_no_class_name_means_two_things():
    found = clashes(PACKAGE)
    assert set(found) <= set(PENDING), {k: v for k, v in found.items() if k not in PENDING}


def test_pending_names_still_clash():
    # once one is renamed, it leaves PENDING, so that it cannot come back unnoticed
    assert set(PENDING) <= set(clashes(PACKAGE))


def test_a_clash_is_found(tmp_path):
    (tmp_path / "fleetx" / "a").mkdir(parents=True)
    (tmp_path / "fleetx" / "a" / "x.py").write_text("class Link:\n    pass\n")
    (tmp_path / "fleetx" / "b.py").write_text("def f():\n    class Local: pass\nclass Link: pass\n")
    assert clashes(tmp_path / "fleetx") == {"Link": ["fleetx/a/x.py", "fleetx/b.py"]}


def test_renamed_classes_keep_only_the_documented_alias():
    from fleetx.comm.groups import ProcessGroups  # the collective job's process groups
    from fleetx.comm.hooks import Downstream  # what a gradient codec sends through
    from fleetx.launch import ConfigError as LaunchConfigError
    from fleetx.ps import ConfigError, PSConfigError
    from fleetx.ps_torch import Communicator
    from fleetx.strategy.config import Constraint
    assert ConfigError is PSConfigError and LaunchConfigError is not PSConfigError
    assert Communicator is not ProcessGroups and Downstream and Constraint
