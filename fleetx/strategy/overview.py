"""What a :class:`~fleetx.strategy.distributed_strategy.DistributedStrategy` prints, and the
field reference of ``docs/distributed_strategy.md``: both generated from the declared fields
(:mod:`~fleetx.strategy.fields`).

:func:`overview` is ``repr(strategy)``, in the layout of Paddle's overview table;
:func:`markdown_reference` is the generated part of the docs, which
``tests/unit/test_strategy_docs.py`` keeps current.
"""
from __future__ import annotations

from typing import Any, Mapping

from fleetx.strategy.config import Config, markdown_table
from fleetx.strategy.fields import MESSAGES, top_level

__all__ = ["overview", "markdown_reference"]

_KEY_W, _GAP, _VAL_W = 38, 2, 38
_WIDTH = _KEY_W + _GAP + _VAL_W


def _title(text: str) -> str:
    return f"    |{text:^{_WIDTH}}|\n"


def _row(key: str, value: Any) -> str:
    return f"    |{key:>{_KEY_W}}{' ' * _GAP}{str(value):^{_VAL_W}}|\n"


def _rows(cfg: Config) -> str:
    """One row per key; a list prints one row per element with the key on the first only."""
    out = []
    for key, value in cfg.to_dict().items():
        items = value if isinstance(value, list) else [value]
        out.extend(_row(key if i == 0 else "", v) for i, v in enumerate(items))
    return "".join(out)


def overview(flags: Config, msgs: Mapping[str, Config]) -> str:
    """Paddle's overview table of a strategy with top-level values ``flags`` and messages
    ``msgs``: each switch with a config prints as a block when on, the other fields as rows."""
    border = "    +" + "=" * _WIDTH + "+\n"
    line = "    +" + "-" * _WIDTH + "+\n"
    out = [border, _title(""), _title("DistributedStrategy Overview"), _title("")]
    env = []
    for name, spec in type(flags).specs().items():
        value = getattr(flags, name)
        if spec.type is bool and f"{name}_configs" in msgs:
            if value:  # a switch with a config prints as a block, and only when on
                out += [border, _title(f"{name}=True <-> {name}_configs"), line,
                        _rows(msgs[f"{name}_configs"])]
            continue
        env.append(_row(name, spec.enum[value] if spec.enum else value))
    out += [border, _title("Environment Flags, Communication Flags"), line, *env]
    out += [border, _title("Build Strategy"), line, _rows(msgs["build_strategy"]), border]
    out += [_title("Execution Strategy"), line, _rows(msgs["execution_strategy"]), border]
    return "".join(out)


def markdown_reference() -> str:
    """The field reference of ``docs/distributed_strategy.md``, generated from the declarations.

    Settings declared without effect are marked (**no effect**, and why); a config with no
    effect at all says so once, above its table.
    """
    parts = ["### Top-level fields\n\n", markdown_table(top_level(), "field")]
    for name, cls in MESSAGES.items():
        parts.append(f"\n### `{name}` ({cls.__name__}, `{cls.__module__}`)\n\n")
        if cls.no_effect:
            parts.append(f"**No effect in fleetx** ({cls.no_effect}): every key is accepted and "
                         f"checked, and named in the plan when changed.\n\n")
        parts.append(markdown_table(cls))
    return "".join(parts)
