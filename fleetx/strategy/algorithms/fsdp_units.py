"""Which sub-modules of a model become FSDP2 units of their own at sharding stages 2 and 3.

A pure function of the model's facts (:class:`~fleetx.strategy.plan.ModelInfo`), so the plan
can list the units before anything is sharded. The rule, in order:

1. ``sharding_configs['units']`` given: every module that an entry names, by class
   (``"GPT2Block"``) or by qualified-name glob (``"model.layers.*"``, where ``*`` matches
   within one dotted segment, so it does not reach ``model.layers.0.mlp``). An entry that
   matches nothing, only containers or only parameter-free modules, and a unit that would split
   a tie, is an error naming it.
2. Otherwise, the model's blocks: each module of a repeated block list (two or more children of
   one class in an ``nn.ModuleList`` or ``nn.ModuleDict``, anywhere in the tree) and each module whose class a module
   of the model lists in ``_no_split_modules`` (Hugging Face models do), outermost only (a
   block inside a block stays in its block's unit).
3. A model with no such block: each child holding parameters, looking through ``ModuleList``,
   ``ModuleDict`` and ``Sequential`` (which a model may iterate over rather than call).

Under rules 2 and 3 a module that shares a parameter with a module outside it (a tied input
embedding and output head) is left to the root unit, where the tie stays one parameter.

Example:
    >>> from torch import nn
    >>> from fleetx.strategy.plan import ModelInfo
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> [(u.name, u.cls) for u in plan_units(ModelInfo.of(net))]
    [('1.0', 'Linear'), ('1.1', 'Linear')]
"""
from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterator, Sequence

from fleetx.strategy.api import StrategyError
from fleetx.strategy.plan import ModelInfo

__all__ = ["Unit", "plan_units", "describe_units"]

_KEY = "sharding_configs['units']"


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit: the module's qualified name, its class, and which rule chose it
    (``"units"``, ``"blocks"`` or ``"children"``)."""

    name: str
    cls: str
    rule: str


class _Tree:
    """The module tree of a :class:`ModelInfo`: children, classes, where parameters live and
    which modules a tie crosses."""

    def __init__(self, info: ModelInfo) -> None:
        self.names = info.module_names
        self.cls = dict(zip(info.module_names, info.module_classes))
        self.kind = dict(zip(info.module_names, info.containers))
        self.no_split = set(info.no_split)
        self.children: dict[str, list[str]] = {}
        for name in self.names[1:]:
            self.children.setdefault(name.rpartition(".")[0], []).append(name)
        self.holding = {p for name in info.param_names for p in _prefixes(name)}
        # module -> (a tied name inside it, its twin outside): fully_shard on it alone would
        # make the two names two parameters
        self.splits: dict[str, tuple[str, str]] = {}
        for names in info.tied:
            for inside in names:
                for m in _prefixes(inside):
                    twin = next((n for n in names if not n.startswith(m + ".")), None)
                    if twin is not None:
                        self.splits.setdefault(m, (inside, twin))

    def fits(self, name: str) -> bool:
        """Holds parameters and splits no tie."""
        return name in self.holding and name not in self.splits

    def unit(self, name: str, rule: str) -> Unit:
        return Unit(name, self.cls[name], rule)


def _prefixes(param: str) -> Iterator[str]:
    """The qualified names of the modules (root excluded) that hold parameter (or module)
    ``param``: its ancestors."""
    parts = param.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def plan_units(info: ModelInfo, entries: Sequence[str] = ()) -> list[Unit]:
    """The units of the model ``info`` describes, in module order (see the module docstring).

    Args:
        info: the model's facts (``ModelInfo.of(model)``).
        entries: ``sharding_configs['units']``: class names or qualified-name globs; empty:
            the model's blocks, else its children.

    Raises:
        StrategyError: an entry matches no module holding parameters, names a container, or
            names a module that would split a tie (the message names it and the nearest valid
            entries).
    """
    tree = _Tree(info)
    if entries:
        return _named(tree, entries)
    blocks = _blocks(tree)
    return blocks if blocks else list(_children(tree, ""))


def _blocks(tree: _Tree) -> list[Unit]:
    """Rule 2: the repeated blocks of module lists and the ``_no_split_modules`` classes,
    outermost only."""
    chosen = {n for n in tree.names[1:] if tree.cls[n] in tree.no_split}
    for parent, kids in tree.children.items():
        if tree.kind.get(parent) in ("ModuleList", "ModuleDict"):  # torchtitan: a ModuleDict
            counts = Counter(tree.cls[k] for k in kids)
            chosen.update(k for k in kids if counts[tree.cls[k]] >= 2)
    chosen = {n for n in chosen if tree.fits(n)}
    return [tree.unit(n, "blocks") for n in tree.names
            if n in chosen and not any(p in chosen for p in _prefixes(n))]


def _children(tree: _Tree, parent: str) -> Iterator[Unit]:
    """Rule 3: the children holding parameters, looking through containers."""
    for child in tree.children.get(parent, []):
        if tree.kind[child]:
            yield from _children(tree, child)
        elif tree.fits(child):
            yield tree.unit(child, "children")


def _matches(entry: str, name: str, cls: str) -> bool:
    """``entry`` names the module: its class, or a glob over its dotted segments."""
    if entry == cls:
        return True
    want, have = entry.split("."), name.split(".")
    return len(want) == len(have) and all(map(fnmatchcase, have, want))


def _named(tree: _Tree, entries: Sequence[str]) -> list[Unit]:
    """Rule 1: the modules the entries name, each entry checked."""
    chosen: set[str] = set()
    for entry in entries:
        hits = [n for n in tree.names[1:] if _matches(entry, n, tree.cls[n])]
        _check(tree, entry, hits)
        chosen.update(n for n in hits if n in tree.holding)
    return [tree.unit(n, "units") for n in tree.names if n in chosen]


def _check(tree: _Tree, entry: str, hits: list[str]) -> None:
    """Refuse an entry that matches nothing useful or would split a tie."""
    model = tree.cls[""]
    for name in hits:
        if tree.kind[name]:
            raise StrategyError(
                f"{_KEY}: {entry!r} names {name!r}, a {tree.kind[name]}, which is never "
                f"called, so FSDP2 would never gather it: name its modules instead "
                f"({name + '.*'!r}{_classes_in(tree, name)})")
        if name in tree.splits:
            inside, twin = tree.splits[name]
            raise StrategyError(
                f"{_KEY}: {entry!r} makes {name!r} ({tree.cls[name]}) a unit, but its "
                f"parameter {inside!r} is tied to {twin!r} outside it; a unit of its own would "
                f"split the tie into two parameters: leave it out (it stays in the root with "
                f"its twin){_nearest(tree, entry)}")
    if not any(n in tree.holding for n in hits):
        what = "no module" if not hits else f"only modules without parameters ({hits[0]!r})"
        raise StrategyError(f"{_KEY}: {entry!r} matches {what} of {model} (a class name, or a "
                            f"qualified-name glob where * stays within one segment)"
                            f"{_nearest(tree, entry)}")


def _classes_in(tree: _Tree, container: str) -> str:
    classes = sorted({tree.cls[k] for k in tree.children.get(container, [])})
    return "".join(f" or {c!r}" for c in classes)


def _nearest(tree: _Tree, entry: str) -> str:
    """The valid entries closest to ``entry``: classes and name patterns (indices as ``*``)."""
    valid = {tree.cls[n] for n in tree.names[1:] if not tree.kind[n] and tree.fits(n)}
    valid |= {re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", n) for n in tree.names[1:]
              if not tree.kind[n] and tree.fits(n)}
    close = difflib.get_close_matches(entry, sorted(valid), n=3, cutoff=0.5)
    return f"; nearest valid: {', '.join(map(repr, close))}" if close else ""


def describe_units(units: Sequence[Unit]) -> str:
    """The units for the plan: their count and classes, and the rule that chose them.

    Example:
        >>> describe_units([Unit("h.0", "Block", "blocks"), Unit("h.1", "Block", "blocks")])
        '2 units (2 Block: the repeated blocks) and the root'
    """
    if not units:
        return "no unit but the root (no child holds parameters apart from a tie)"
    counts = Counter(u.cls for u in units)
    classes = ", ".join(f"{n} {c}" for c, n in counts.items())
    why = {"units": "sharding_configs['units']", "blocks": "the repeated blocks",
           "children": "each child: no repeated block list"}[units[0].rule]
    return f"{len(units)} unit{'s' if len(units) > 1 else ''} ({classes}: {why}) and the root"
