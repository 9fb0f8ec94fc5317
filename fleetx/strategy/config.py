"""Typed configuration: dataclasses whose fields check themselves.

Every setting of :class:`~fleetx.strategy.distributed_strategy.DistributedStrategy` (a top-level
switch, a key of one of the ``*_configs`` dictionaries, a field of ``build_strategy``) is a field
of a :class:`Config` dataclass declared with :func:`option`: its default, its help text, the
values it allows and, for a setting fleetx accepts but does not act on, why it has no effect
(``no_effect="reason"`` on the field, or ``no_effect`` on the whole config class). Everything
else is generated from those declarations: validation on construction and on every assignment,
the dictionary form, the printed overview, the prototxt writer, the plan's warning about
settings without effect and the field reference in ``docs/distributed_strategy.md``.

The rules are strict on purpose. A bool is not a number here (``True`` for an int field is a
mistake, not ``1``) and an int is not a bool; an int is accepted for a float field and stored as a
Python float. Errors are raised at once and name the setting and what it accepts::

    TypeError: amp_configs['incr_ratio'] must be a float, got str '2'
    ValueError: amp_configs['decr_ratio'] must be in (0, 1), got 1.5

Process-wide state here: the field specs of each config class, computed once from its
declaration, and the recorder :func:`recording_reads` opens, a test tool (one at a time for the
whole process, since a config's fields are read with no handle to report to; production code
never opens one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import numbers
import sys
import typing
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Iterator, Mapping, Optional, TypeVar

__all__ = ["Config", "FieldSpec", "Constraint", "option", "unknown_name", "markdown_table",
           "warn_old_name", "recording_reads"]

_C = TypeVar("_C", bound="Config")
_SCALARS = (bool, int, float, str)
_ARTICLE = {bool: "a bool", int: "an int", float: "a float", str: "a str"}


def warn_old_name(message: str) -> None:
    """Warn (``DeprecationWarning``) at the first caller outside ``fleetx.strategy``."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("fleetx.strategy"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def unknown_name(what: str, name: str, known: Iterable[str]) -> str:
    """The message for a name that is not one of ``known``: the closest match and the full list.

    >>> unknown_name("amp_configs key", "decr_rate", ["decr_ratio", "incr_ratio"])
    "unknown amp_configs key 'decr_rate' (did you mean 'decr_ratio'?); known: decr_ratio, incr_ratio"
    """
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {name!r}{hint}; known: {', '.join(known)}"


@dataclass(frozen=True)
class Constraint:
    """The values a number or string field allows.

    ``ge``/``gt``/``le``/``lt`` bound numbers; ``choices`` lists the allowed values; ``also`` names
    sentinel values accepted outside the bounds (``-1`` meaning "infer it", for example).
    """

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: tuple = ()
    also: tuple = ()

    def describe(self) -> str:
        """The rule in words, e.g. ``in (0, 1)``, ``>= 1 or -1``, ``one of 'avg', 'sum'``."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt)
        high = ("]", self.le) if self.le is not None else (")", self.lt)
        if low[1] is not None and high[1] is not None:
            text = f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
        elif low[1] is not None:
            text = f"{'>=' if self.ge is not None else '>'} {low[1]}"
        elif high[1] is not None:
            text = f"{'<=' if self.le is not None else '<'} {high[1]}"
        else:
            return ""
        return " or ".join([text] + [repr(v) for v in self.also])

    def allows(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if value in self.also:
            return True
        # Written as "not (value >= bound)" so that NaN fails every bound.
        return not any((self.ge is not None and not value >= self.ge,
                        self.gt is not None and not value > self.gt,
                        self.le is not None and not value <= self.le,
                        self.lt is not None and not value < self.lt))


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: what it holds, its default, its help text and its rule.

    ``enum`` maps the names of an enumeration field to their protobuf numbers (the prototxt form
    writes the bare name, the printed overview the number).
    """

    name: str
    type: type
    is_list: bool
    default: Any
    help: str
    rule: Constraint
    enum: Optional[Mapping[str, int]] = None
    no_effect: Optional[str] = None  # why fleetx does not act on it; None: it has an effect

    @property
    def type_name(self) -> str:
        """``bool``, ``int``, ``float``, ``str``, ``list[str]``..."""
        return f"list[{self.type.__name__}]" if self.is_list else self.type.__name__

    def coerce(self, value: Any, label: str) -> Any:
        """Check ``value`` for this field and return it as stored (lists copied, ints as floats).

        Raises:
            TypeError: wrong type (``label`` names the setting).
            ValueError: a value outside the rule.
        """
        if not self.is_list:
            return self.coerce_item(value, label)
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{label} must be a list of {self.type.__name__}, "
                            f"got {type(value).__name__} {value!r}")
        return [self.coerce_item(v, f"{label}[{i}]") for i, v in enumerate(value)]

    def coerce_item(self, value: Any, label: str) -> Any:
        """Check one scalar (a list field's element) and return it as stored."""
        t = self.type
        if t is bool:
            ok = isinstance(value, bool) or _is_numpy_bool(value)
            value = bool(value) if ok else value
        elif t is str:
            ok = isinstance(value, str)
        else:
            number = numbers.Integral if t is int else numbers.Real
            ok = isinstance(value, number) and not isinstance(value, bool)
            value = t(value) if ok else value
        if not ok:
            raise TypeError(f"{label} must be {_ARTICLE[t]}, got {type(value).__name__} {value!r}")
        if not self.rule.allows(value):
            raise ValueError(f"{label} must be {self.rule.describe()}, got {value!r}")
        return value


def option(default: Any, help: str, *, ge: Optional[float] = None, gt: Optional[float] = None,
           le: Optional[float] = None, lt: Optional[float] = None, choices: Iterable = (),
           also: Iterable = (), enum: Optional[Mapping[str, int]] = None,
           no_effect: Optional[str] = None) -> Any:
    """Declare a :class:`Config` field: default, help text and allowed values.

    A list default is copied for every instance. For a list field the rule applies to each
    element. ``enum`` makes a string field an enumeration (its names are the choices).
    ``no_effect`` says why fleetx accepts the setting without acting on it: the plan names it
    when it differs from its default, and the generated reference marks it. When the setting
    gains an effect, this is the one place that changes.

    Example:
        >>> @dataclass
        ... class Demo(Config):
        ...     section = "demo_configs"
        ...     k_steps: int = option(1, "Steps between synchronisations.", ge=1)
        >>> Demo(k_steps=0)
        Traceback (most recent call last):
        ValueError: demo_configs['k_steps'] must be >= 1, got 0
    """
    choices = tuple(enum) if enum else tuple(choices)
    metadata = {"help": help, "enum": dict(enum) if enum else None, "no_effect": no_effect,
                "rule": Constraint(ge, gt, le, lt, choices, tuple(also))}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


_SPECS: dict[type, dict[str, FieldSpec]] = {}


class Config:
    """Base of every configuration dataclass (subclasses are decorated with ``@dataclass``).

    Class attributes:
        section: the ``DistributedStrategy`` attribute that holds it (``"amp_configs"``); it
            names the field in error messages (``amp_configs['decr_ratio']``).
        aliases: older key names accepted for a field (``{"micro_batch": "accumulate_steps"}``);
            using one warns with a ``DeprecationWarning``.
        synonyms: other current names of a field (``{"offload": "optimize_offload"}``), accepted
            without a warning; files and ``to_dict()`` use the field's name.
        no_effect: why no key of this config has an effect in fleetx (None: each key says for
            itself with ``option(..., no_effect=...)``).

    Every assignment, including those made by the generated ``__init__``, is checked.
    """

    section: ClassVar[str] = ""
    aliases: ClassVar[Mapping[str, str]] = {}
    synonyms: ClassVar[Mapping[str, str]] = {}
    no_effect: ClassVar[Optional[str]] = None

    # -- the declared fields --------------------------------------------------------------------
    @classmethod
    def specs(cls) -> dict[str, FieldSpec]:
        """Name -> :class:`FieldSpec`, in declaration (protobuf field-number) order."""
        specs = _SPECS.get(cls)
        if specs is None:
            hints = typing.get_type_hints(cls)
            specs = {f.name: _spec_of(f, hints[f.name]) for f in dataclasses.fields(cls)}
            _SPECS[cls] = specs
        return specs

    @classmethod
    def no_effect_of(cls, key: str) -> Optional[str]:
        """Why field ``key`` has no effect in fleetx (its own reason, else its config's), or None
        when it has one."""
        return cls.specs()[key].no_effect or cls.no_effect

    @classmethod
    def key_name(cls, key: str) -> str:
        """The setting's name in plans and in ``is_set``: ``amp_configs.decr_ratio``, or the bare
        name for a top-level field."""
        return f"{cls.section}.{key}" if cls.section else key

    @classmethod
    def label(cls, key: str) -> str:
        """How error messages name field ``key``: ``amp_configs['decr_ratio']``."""
        return f"{cls.section}[{key!r}]" if cls.section else key

    @classmethod
    def what(cls) -> str:
        """How error messages name this config's keys: ``amp_configs key``."""
        return f"{cls.section} key" if cls.section else f"{cls.__name__} field"

    @classmethod
    def canonical(cls, key: str) -> str:
        """The declared name for ``key`` (itself, or the field an alias or synonym stands for).

        Raises:
            ValueError: ``key`` is neither a field nor an alias (the message lists the fields).
        """
        if key in cls.specs():
            return key
        if key in cls.synonyms:
            return cls.synonyms[key]
        if key in cls.aliases:
            warn_old_name(f"{cls.label(key)} is an old name; use {cls.label(cls.aliases[key])}")
            return cls.aliases[key]
        raise ValueError(unknown_name(cls.what(), key, [*cls.specs(), *cls.synonyms]))

    @classmethod
    def check(cls, key: str, value: Any) -> Any:
        """Validate ``value`` for field ``key`` (a declared name) and return it as stored."""
        return cls.specs()[key].coerce(value, cls.label(key))

    # -- instances ------------------------------------------------------------------------------
    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if _reads is not None and not _quiet:
            cls = type(self)
            if name in cls.specs():
                _reads.add(cls.key_name(name))
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        specs = type(self).specs()
        if name not in specs:
            raise ValueError(unknown_name(self.what(), name, specs))
        object.__setattr__(self, name, specs[name].coerce(value, self.label(name)))

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain value (lists copied), in declaration order."""
        return {k: list(v) if isinstance(v, list) else v for k, v in vars(self).items()}

    def resolve(self, updates: Mapping[str, Any]) -> dict[str, Any]:
        """Map the keys of ``updates`` to declared names, refusing unknown and doubled keys.

        Raises:
            TypeError: ``updates`` is not a mapping.
            ValueError: an unknown key, or an alias given beside the name it stands for.
        """
        if not isinstance(updates, Mapping):
            name = self.section or type(self).__name__
            raise TypeError(f"{name} must be a dict (or {type(self).__name__}), "
                            f"got {type(updates).__name__} {updates!r}")
        resolved: dict[str, Any] = {}
        given: dict[str, str] = {}  # declared name -> the key that named it
        for key, value in updates.items():
            name = self.canonical(key)
            if name in given:
                raise ValueError(f"{self.label(given[name])} and {self.label(key)} name the same "
                                 "setting; give only one")
            resolved[name], given[name] = value, key
        return resolved

    def merged(self: _C, updates: Mapping[str, Any]) -> _C:
        """A copy with ``updates`` applied, every value checked first (all or nothing).

        Lists in ``updates`` replace the old lists.

        Raises:
            TypeError / ValueError: as :meth:`resolve` and :meth:`FieldSpec.coerce`.
        """
        with _unrecorded():
            return dataclasses.replace(self, **self.resolve(updates))

    def copy(self: _C) -> _C:
        with _unrecorded():
            return dataclasses.replace(self)


# Which settings were read, for the check that every setting has a reader or says it has none.
_reads: Optional[set] = None
_quiet = False


@contextlib.contextmanager
def recording_reads() -> Iterator[set]:
    """Collect the names (``Config.key_name``) of the config fields read while the block runs.

    Copying a config does not count as reading it. One recorder at a time, for the whole
    process (a test tool: production code never opens one).

    Example:
        >>> from fleetx.strategy.algorithms.amp import AmpConfig
        >>> cfg = AmpConfig()
        >>> with recording_reads() as reads:
        ...     _ = cfg.copy().decr_ratio
        >>> sorted(reads)
        ['amp_configs.decr_ratio']
    """
    global _reads
    outer, _reads = _reads, set()
    try:
        yield _reads
    finally:
        _reads = outer


@contextlib.contextmanager
def _unrecorded() -> Iterator[None]:
    global _quiet
    outer, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = outer


def _is_numpy_bool(value: Any) -> bool:
    # numpy.bool_ is not a bool subclass; recognised by name so numpy stays optional here.
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _spec_of(f: dataclasses.Field, hint: Any) -> FieldSpec:
    is_list = typing.get_origin(hint) is list
    base = typing.get_args(hint)[0] if is_list else hint
    if base not in _SCALARS:
        raise TypeError(f"config field {f.name!r} has unsupported type {hint!r}")
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    meta = f.metadata
    return FieldSpec(f.name, base, is_list, default, meta.get("help", ""),
                     meta.get("rule", Constraint()), meta.get("enum"), meta.get("no_effect"))


def markdown_table(cls: type[Config], title: str = "key") -> str:
    """A Markdown table of ``cls``'s fields: name, type, default, allowed values, help text.

    A field without effect in fleetx says so first in its meaning (**no effect**: why), unless
    its whole config has none (the caller says that once, above the table).
    """
    rows = [f"| {title} | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for spec in cls.specs().values():
        allowed = spec.rule.describe()  # empty: any value of the type
        if spec.is_list and allowed:
            allowed = f"each {allowed}"
        meaning = spec.help
        if spec.no_effect:
            meaning = f"**no effect**: {spec.no_effect}. {meaning}"
        rows.append(f"| `{spec.name}` | {spec.type_name} | `{spec.default!r}` | {allowed} "
                    f"| {meaning} |")
    for old, new in cls.aliases.items():
        rows.append(f"| `{old}` | alias | | | old name of `{new}` |")
    for other, name in cls.synonyms.items():
        rows.append(f"| `{other}` | synonym | | | another name of `{name}` |")
    return "\n".join(rows) + "\n"
