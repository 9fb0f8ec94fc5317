"""The typed-config machinery (config.py) and the per-strategy config dataclasses."""
import dataclasses
import doctest
import importlib
from dataclasses import dataclass

import numpy as np
import pytest

from fleetx.strategy.config import Config, Constraint, markdown_table, option, unknown_name
from fleetx.strategy.distributed_strategy import MESSAGES, TopLevelConfig

# Modules of fleetx.strategy: one per algorithm under algorithms/, and the build / execution bags.
STRATEGY_MODULES = [f"algorithms.{name}" for name in (
    "amp", "recompute", "localsgd", "adaptive_localsgd", "gradient_merge", "dgc", "pipeline",
    "a_sync", "lars", "lamb", "sharding", "hybrid", "tensor_parallel", "trainer_desc",
    "gradient_scale", "anomaly_guard")] + ["build"]


@dataclass
class Demo(Config):
    section = "demo_configs"
    aliases = {"old_ratio": "ratio"}

    ratio: float = option(0.5, "A ratio.", gt=0, lt=1)
    steps: int = option(1, "Steps.", ge=1)
    names: list[str] = option([], "Names.")
    shape: list[int] = option([], "A shape.", ge=1)
    on: bool = option(False, "A switch.")
    kind: str = option("a", "A kind.", choices=("a", "b"))


@pytest.mark.parametrize("rule, text", [
    (Constraint(gt=0, lt=1), "in (0, 1)"), (Constraint(ge=0, lt=1), "in [0, 1)"),
    (Constraint(ge=0, le=1), "in [0, 1]"), (Constraint(gt=0), "> 0"), (Constraint(ge=1), ">= 1"),
    (Constraint(le=5), "<= 5"), (Constraint(lt=5), "< 5"), (Constraint(ge=1, also=(-1,)), ">= 1 or -1"),
    (Constraint(choices=("x", "y")), "one of 'x', 'y'"), (Constraint(), ""),
])
def test_rule_describe(rule, text):
    assert rule.describe() == text


def test_rule_allows():
    assert Constraint(ge=1, also=(-1,)).allows(-1) and not Constraint(ge=1, also=(-1,)).allows(0)
    assert not Constraint(gt=0).allows(float("nan"))
    assert Constraint().allows(float("nan"))


def test_construction_and_assignment_are_checked():
    with pytest.raises(ValueError, match=r"demo_configs\['ratio'\] must be in \(0, 1\), got 1.0"):
        Demo(ratio=1)
    d = Demo()
    with pytest.raises(TypeError, match=r"demo_configs\['steps'\] must be an int, got bool True"):
        d.steps = True
    with pytest.raises(TypeError, match=r"demo_configs\['on'\] must be a bool, got int 0"):
        d.on = 0
    with pytest.raises(ValueError, match=r"demo_configs\['shape'\]\[1\] must be >= 1, got 0"):
        d.shape = [2, 0]
    with pytest.raises(ValueError, match="unknown demo_configs key 'stepz'"):
        d.stepz = 1
    assert d == Demo()


def test_numbers_are_normalised():
    d = Demo(ratio=np.float32(0.25), steps=np.int64(3), on=np.bool_(True))
    assert (type(d.ratio), type(d.steps), type(d.on)) == (float, int, bool)
    d.names = ("x", "y")
    assert d.names == ["x", "y"]


def test_merged_is_a_checked_copy():
    d = Demo()
    e = d.merged({"steps": 4, "names": ["n"]})
    assert (d.steps, e.steps, e.names) == (1, 4, ["n"])
    with pytest.raises(ValueError):
        d.merged({"steps": 2, "ratio": 7})
    assert d == Demo()
    with pytest.warns(DeprecationWarning, match=r"demo_configs\['old_ratio'\] is an old name"):
        assert d.merged({"old_ratio": 0.1}).ratio == 0.1
    with pytest.raises(TypeError, match=r"demo_configs must be a dict \(or Demo\), got int 3"):
        d.merged(3)


def test_default_lists_are_not_shared():
    a, b = Demo(), Demo()
    a.names.append("x")
    assert b.names == []
    assert a.copy() == a and a.copy().names is not a.names


def test_unknown_name_suggests_the_closest():
    assert unknown_name("thing", "ampp", ["lamb", "amp"]) == (
        "unknown thing 'ampp' (did you mean 'amp'?); known: amp, lamb")
    assert unknown_name("thing", "zzz", ["amp"]) == "unknown thing 'zzz'; known: amp"


def test_unsupported_field_type_is_refused():
    @dataclass
    class Bad(Config):
        x: tuple = option((), "no")

    with pytest.raises(TypeError, match="config field 'x' has unsupported type"):
        Bad()


def test_markdown_table():
    table = markdown_table(Demo)
    assert table.splitlines()[:3] == [
        "| key | type | default | allowed | meaning |", "|---|---|---|---|---|",
        "| `ratio` | float | `0.5` | in (0, 1) | A ratio. |"]
    assert "| `shape` | list[int] | `[]` | each >= 1 | A shape. |" in table
    assert table.endswith("| `old_ratio` | alias | | | old name of `ratio` |\n")


@pytest.mark.parametrize("name", STRATEGY_MODULES)
def test_strategy_modules_document_every_field(name):
    module = importlib.import_module(f"fleetx.strategy.{name}")
    assert module.__doc__ and len(module.__doc__.strip()) > 80
    # A module may also hold its Strategy class; the config dataclasses are the Config ones.
    classes = [c for c in (getattr(module, n) for n in module.__all__)
               if isinstance(c, type) and issubclass(c, Config)]
    assert classes and all(c.__doc__ for c in classes)
    for cls in classes:
        assert cls.section in MESSAGES and MESSAGES[cls.section] is cls
        for field in dataclasses.fields(cls):
            assert field.metadata["help"].strip(), f"{cls.__name__}.{field.name}"
        cls()  # defaults pass their own rules


def test_every_config_is_reachable_from_the_strategy():
    assert {m.removeprefix("fleetx.strategy.") for m in (c.__module__ for c in MESSAGES.values())
            } == set(STRATEGY_MODULES)
    for field in dataclasses.fields(TopLevelConfig):
        assert field.metadata["help"].strip(), field.name


@pytest.mark.parametrize("name", STRATEGY_MODULES + ["config", "distributed_strategy",
                                                     "prototxt"])
def test_docstring_examples_run(name):
    module = importlib.import_module(f"fleetx.strategy.{name}")
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0



def test_each_strategy_names_its_config_class():
    from fleetx.strategy.api import registered
    from fleetx.strategy.planner import load_strategies

    load_strategies()
    for cls in registered():
        if f"{cls.name}_configs" in MESSAGES:
            assert cls.config is MESSAGES[f"{cls.name}_configs"], cls.name
        if cls.config is not None:
            assert MESSAGES[cls.config.section] is cls.config, cls.name
    assert registered("parameter_server").config is MESSAGES["a_sync_configs"]
