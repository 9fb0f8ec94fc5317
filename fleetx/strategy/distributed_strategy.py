"""``DistributedStrategy``: every distributed-training setting in one object.

This is Fleet's user surface, field for field (Paddle 2.2): boolean switches
(``strategy.amp = True``), a ``*_configs`` dictionary per algorithm
(``strategy.amp_configs = {"init_loss_scaling": 1024}``), communication flags, and
``build_strategy`` / ``execution_strategy``. Behind it each group of settings is a typed
:class:`~fleetx.strategy.config.Config` dataclass (``AmpConfig``...), so every assignment is
checked at once and the dictionary form, the printed overview and the file formats are all
generated from the declared fields.

Reading a ``*_configs`` attribute returns a new dict holding every key; assigning a dict merges
the given keys (checked before anything is written) and a list replaces the old list.
Assignments are remembered, so ``save_to_prototxt`` writes what was set, like protobuf's
``HasField``.

Example:
    >>> s = DistributedStrategy()
    >>> s.amp = True
    >>> s.amp_configs = {"init_loss_scaling": 1024}
    >>> s.amp_configs["init_loss_scaling"], s.amp_configs["incr_ratio"]
    (1024.0, 2.0)
    >>> s.typed_config("amp").init_loss_scaling
    1024.0
"""
from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any, Mapping, Union

from fleetx.strategy import file_formats, prototxt
from fleetx.strategy.config import Config, unknown_name
# TopLevelConfig, MESSAGES and markdown_reference live in fields.py / overview.py; they are
# re-exported here, where users and earlier releases import them from (and _ALIASES, _SPELLINGS
# for the docs test).
from fleetx.strategy.fields import (ALIASES as _ALIASES, BAGS as _BAGS, MESSAGES,
                                    SPELLINGS as _SPELLINGS, TopLevelConfig, field_names,
                                    resolve_name, top_level)
from fleetx.strategy.overview import markdown_reference, overview

__all__ = ["DistributedStrategy", "TopLevelConfig", "MESSAGES", "markdown_reference"]

_log = logging.getLogger(__name__)
PathLike = Union[str, "os.PathLike[str]"]
_STATE = ("_flags", "_msgs", "_set")


class DistributedStrategy:
    """All distributed-training settings: switches, ``*_configs`` dicts, communication flags.

    Every field of Paddle 2.2's strategy exists with its default (see
    ``docs/distributed_strategy.md``).
    Assignments are validated at once:

    Raises:
        TypeError: an unknown attribute, or a value of the wrong type (a bool is not a number).
        ValueError: an unknown ``*_configs`` key, or a value out of range.

    Example:
        >>> s = DistributedStrategy()
        >>> s.nccl_comm_num = True
        Traceback (most recent call last):
        TypeError: nccl_comm_num must be an int, got bool True
        >>> s.a_sync = True
        >>> s.a_sync_configs = {"k_steps": 100}
        >>> s.ps_mode()
        'geo'
    """

    __hash__ = None  # mutable, compared by value

    def __init__(self) -> None:
        object.__setattr__(self, "_flags", top_level()())
        object.__setattr__(self, "_msgs", {name: cls() for name, cls in MESSAGES.items()})
        object.__setattr__(self, "_set", set())  # "amp", "amp_configs.decr_ratio", ...

    # -- attribute surface ----------------------------------------------------------------------
    def _resolve(self, name: str) -> str:
        field = resolve_name(name)
        if field not in self._msgs and field not in type(self._flags).specs():
            # declared (fields.declare) after this object was built
            raise TypeError(f"strategy.{field} was declared after this DistributedStrategy was "
                            f"built; build a new one")
        return field

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not real attributes (the fields).
        if name.startswith("__") or name in _STATE:
            raise AttributeError(name)
        try:
            field = self._resolve(name)
        except TypeError as e:
            raise AttributeError(str(e)) from None
        if field in _BAGS:
            return self._msgs[field].copy()
        if field in self._msgs:
            return self._msgs[field].to_dict()
        return getattr(self._flags, field)

    def __setattr__(self, name: str, value: Any) -> None:
        self._assign(self._resolve(name), value, user=True)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(field_names()))

    def _assign(self, field: str, value: Any, user: bool = False) -> None:
        """Validate and store one field; ``user`` applies the setter side effects (``a_sync``),
        which restoring from a file or dict does not."""
        if field not in self._msgs:
            setattr(self._flags, field, value)
            self._set.add(field)
            if field == "a_sync" and user:
                self._assign("a_sync_configs", {"k_steps": 0})
            return
        current = self._msgs[field]
        if isinstance(value, type(current)):
            value = value.to_dict()
        elif field in _BAGS and not isinstance(value, Mapping):
            # Any object with the bag's attribute names (a Paddle BuildStrategy, say).
            found = {k: getattr(value, k) for k in current.specs() if hasattr(value, k)}
            if not found:
                raise TypeError(f"{field} must be a {type(current).__name__} or a dict, "
                                f"got {type(value).__name__} {value!r}")
            value = found
        updates = current.resolve(value)
        self._msgs[field] = current.merged(updates)
        self._set.update(f"{field}.{key}" for key in updates)

    def is_set(self, name: str) -> bool:
        """Whether a field was assigned (even to its default), like protobuf's ``HasField``.

        ``name`` is a field (``"amp"``), a config (``"amp_configs"``: any of its keys) or one key
        (``"amp_configs.decr_ratio"``).
        """
        return name in self._set or any(p.startswith(name + ".") for p in self._set)

    # -- typed access ---------------------------------------------------------------------------
    def typed_config(self, name: str) -> Config:
        """A copy of the config dataclass of switch ``name`` (``"amp"`` -> ``AmpConfig``).

        The attribute name (``"amp_configs"``) is accepted too.

        Raises:
            ValueError: ``name`` has no config (the message lists the names that do).
        """
        section = name if name.endswith("_configs") else f"{name}_configs"
        if section not in self._msgs:
            known = [s[:-len("_configs")] for s in self._msgs if s.endswith("_configs")]
            raise ValueError(unknown_name("strategy config", name, known))
        return self._msgs[section].copy()

    def ps_mode(self) -> str:
        """The parameter-server mode: ``"sync"``, ``"async"`` or ``"geo"``.

        ``a_sync=False, k_steps=0`` is sync; ``a_sync=True, k_steps=0`` async;
        ``a_sync=True, k_steps>0`` GEO. ``k_steps=-1`` (``a_sync`` never assigned) counts as 0.

        Raises:
            ValueError: ``a_sync=False`` with ``k_steps > 0``.
        """
        k_steps = self._msgs["a_sync_configs"].k_steps
        if k_steps <= 0:
            return "async" if self._flags.a_sync else "sync"
        if not self._flags.a_sync:
            raise ValueError(
                f"a_sync=False (sync) cannot be combined with a_sync_configs['k_steps']="
                f"{k_steps} (GEO); set a_sync=True for GEO, or k_steps=0 for sync")
        return "geo"

    # -- value semantics ------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._flags == other._flags and self._msgs == other._msgs

    def __getstate__(self) -> dict[str, Any]:
        return {name: self.__dict__[name] for name in _STATE}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        for name in _STATE:
            object.__setattr__(self, name, state[name])

    def __repr__(self) -> str:
        return overview(self._flags, self._msgs)

    # -- dict, JSON, YAML -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field with its value; configs and build/execution strategies as dicts."""
        out = self._flags.to_dict()
        out.update((name, msg.to_dict()) for name, msg in self._msgs.items())
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DistributedStrategy":
        """A strategy with the fields of ``data`` (as from :meth:`to_dict`; may be partial).

        Raises:
            TypeError / ValueError: as attribute assignment does.
        """
        strategy = cls()
        strategy._restore(data)
        return strategy

    def _restore(self, data: Mapping[str, Any]) -> None:
        """Merge ``data`` into this strategy, all or nothing, without setter side effects."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a strategy dict must be a mapping, got {type(data).__name__}")
        trial = copy.deepcopy(self)
        for name, value in data.items():
            trial._assign(self._resolve(name), value)
        self.__setstate__(trial.__getstate__())

    def save_to_json(self, path: PathLike) -> None:
        """Write :meth:`to_dict` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def load_from_json(self, path: PathLike) -> None:
        """Merge the fields of a JSON file into this strategy (lists replace), all or nothing.

        Raises:
            ValueError: malformed JSON (``file:line:col:``), an unknown config key or a value out
                of range (``file:line:``, with the valid choices).
            TypeError: an unknown field or a value of the wrong type (``file:line:``).
        """
        self._load_file(path, "json")

    def save_to_yaml(self, path: PathLike) -> None:
        """Write :meth:`to_dict` as YAML (needs pyyaml)."""
        yaml = file_formats.yaml_module()
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    def load_from_yaml(self, path: PathLike) -> None:
        """Merge the fields of a YAML file into this strategy (needs pyyaml), all or nothing.

        Raises:
            ValueError / TypeError: as :meth:`load_from_json` (``file:line:`` first).
        """
        self._load_file(path, "yaml")

    def _load_file(self, path: PathLike, kind: str) -> None:
        source = os.fspath(path)
        with open(path, encoding="utf-8") as f:
            data, locate = file_formats.read_mapping(f.read(), source, kind)
        if data is None and kind == "yaml":
            data = {}  # an empty YAML file
        if not isinstance(data, Mapping):
            raise TypeError(f"{source}: a strategy file holds a mapping of fields, "
                            f"got {type(data).__name__}")
        try:
            self._restore(data)
        except (TypeError, ValueError) as e:
            failing = file_formats.failing_path(data)
            line = locate(failing) if failing else None
            raise type(e)(f"{source}:{line}: {e}" if line else f"{source}: {e}") from None

    # -- prototxt -------------------------------------------------------------------------------
    def save_to_prototxt(self, output: PathLike) -> None:
        """Write the assigned fields in protobuf text format, in Paddle's field order."""
        message: dict[str, Any] = {}
        for name, spec in type(self._flags).specs().items():
            if name in self._set:
                value = getattr(self._flags, name)
                message[name] = prototxt.Ident(value) if spec.enum else value
        for name, msg in self._msgs.items():
            block = {key: value for key, value in msg.to_dict().items()
                     if f"{name}.{key}" in self._set and value != []}
            if block:
                message[name] = block
        with open(output, "w", encoding="utf-8") as f:
            f.write(prototxt.dumps(message))

    def load_from_prototxt(self, pb_file: PathLike, ignore_unknown: bool = False) -> list[str]:
        """Merge a protobuf text file (ours or Paddle's) into this strategy, all or nothing.

        Scalars overwrite, a repeated field's lines replace the old list, aliases are accepted.

        Args:
            pb_file: the file.
            ignore_unknown: skip unknown field names (logged) instead of raising.

        Returns:
            The skipped names (``"adam_d2sum"``, ``"amp_configs.use_bf16"``), empty if none.

        Raises:
            ValueError: a syntax error, an unknown field, or a bad value (``file:line:`` first).
            TypeError: a value of the wrong type (``file:line:`` first).
        """
        source = os.fspath(pb_file)
        with open(pb_file, encoding="utf-8") as f:
            entries = prototxt.parse(f.read(), source)
        skipped: list[str] = []
        updates = file_formats.decode_prototxt(entries, source, ignore_unknown, skipped)
        self._restore(updates)
        for name in skipped:
            _log.warning("%s: skipped unknown strategy field %s", source, name)
        return skipped


