"""Reading strategy files (JSON, YAML, prototxt) so that every error names ``file:line``.

Python's ``json`` and PyYAML give the values but not where each key stood, so a wrong key
deep in a file would otherwise be reported with no place at all. :func:`read_mapping` parses a
file and returns the data with a *locator*: ``locate(("amp_configs", "decr_rate"))`` is the line
of that key. A malformed file is a ``ValueError`` starting ``file:line:col:``.
:func:`failing_path` finds the entry of such data that assignment refuses, for the locator to
place. :func:`decode_prototxt` types the entries :mod:`~fleetx.strategy.prototxt` parsed
against the strategy's fields (:mod:`~fleetx.strategy.fields`), each error with its line.
"""
from __future__ import annotations

import json
import re
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from fleetx.strategy import prototxt
from fleetx.strategy.config import Config, unknown_name
from fleetx.strategy.fields import MESSAGES, field_names, resolve_name, top_level

__all__ = ["read_mapping", "Locator", "failing_path", "decode_prototxt", "yaml_module"]

Locator = Callable[[Sequence[str]], Optional[int]]


def read_mapping(text: str, source: str, kind: str) -> tuple[Any, Locator]:
    """Parse ``text`` (``kind`` ``"json"`` or ``"yaml"``) and return ``(data, locate)``.

    ``locate(path)`` gives the 1-based line of the key at ``path`` (top-level name, then config
    key), or of its nearest located parent, or None.

    Raises:
        ValueError: the text is not valid JSON / YAML (``file:line:col: ...``).
        ImportError: YAML without pyyaml.
    """
    if kind == "json":
        return _read_json(text, source)
    return _read_yaml(text, source)


def _read_json(text: str, source: str) -> tuple[Any, Locator]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}:{e.lineno}:{e.colno}: not valid JSON: {e.msg}") from None

    def locate(path: Sequence[str]) -> Optional[int]:
        # The first '"key":' after the parent's: exact for the files save_to_json writes and
        # for hand-written ones that do not repeat a key name earlier in the same section.
        pos, line = 0, None
        for key in path:
            m = re.compile(re.escape(json.dumps(key)) + r"\s*:").search(text, pos)
            if m is None:
                return line
            pos, line = m.end(), text.count("\n", 0, m.start()) + 1
        return line
    return data, locate


def _read_yaml(text: str, source: str) -> tuple[Any, Locator]:
    yaml = yaml_module()
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{where}: not valid YAML: {problem}") from None

    def locate(path: Sequence[str]) -> Optional[int]:
        node, line = root, None
        for key in path:
            if node is None or node.id != "mapping":
                return line
            found = next(((k, v) for k, v in node.value if k.value == key), None)
            if found is None:
                return line
            line, node = found[0].start_mark.line + 1, found[1]
        return line
    return data, locate


def yaml_module() -> Any:
    """The ``yaml`` module.

    Raises:
        ImportError: pyyaml is not installed (the message says how to install it).
    """
    try:
        import yaml
    except ImportError:
        raise ImportError("YAML strategy files need pyyaml: pip install pyyaml "
                          "(or pip install fleetx[yaml])") from None
    return yaml


def failing_path(data: Mapping[str, Any]) -> Union[tuple[str, ...], None]:
    """The first field (or ``(config, key)``) of ``data`` that assignment refuses, to say where
    it stands in its file; None when no single entry is at fault."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # old names warn on the real load
        for name, value in data.items():
            try:
                field = resolve_name(name)
                if field not in MESSAGES:
                    top_level().check(field, value)
                    continue
                if not isinstance(value, Mapping):
                    return (name,)
            except (TypeError, ValueError):
                return (name,)
            cls = MESSAGES[field]
            for key, item in value.items():
                try:
                    cls.check(cls.canonical(key), item)
                except (TypeError, ValueError):
                    return (name, key)
    return None


def decode_prototxt(entries: tuple[prototxt.Entry, ...], source: str, ignore_unknown: bool,
                    skipped: list[str]) -> dict[str, Any]:
    """The strategy fields of parsed prototxt ``entries``, typed, as a dict for assignment.

    Args:
        entries: the parsed file (:func:`fleetx.strategy.prototxt.parse`).
        source: the file name, for messages.
        ignore_unknown: skip unknown names (appended to ``skipped``) instead of raising.
        skipped: receives the skipped names (``"amp_configs.use_bf16"``).

    Raises:
        ValueError: an unknown field, a message written as a scalar or the reverse, or a bad
            value (``file:line:`` first).
        TypeError: a value of the wrong type (``file:line:`` first).
    """
    return _decode(entries, top_level(), source, ignore_unknown, skipped)


def _decode(entries: tuple[prototxt.Entry, ...], cls: type[Config], source: str,
            ignore_unknown: bool, skipped: list[str]) -> dict[str, Any]:
    """Typed values of parsed prototxt entries against ``cls`` (and, at the top, ``MESSAGES``).

    Repeated lines gather into one list; a later scalar overwrites an earlier one.
    """
    top = cls is top_level()
    out: dict[str, Any] = {}
    for entry in entries:
        where = f"{source}:{entry.line}"
        name = _decoded_name(cls, entry.name)
        if name is None:
            if not ignore_unknown:
                known = field_names() if top else cls.specs()
                what = "DistributedStrategy field" if top else f"{cls.section} field"
                raise ValueError(f"{where}: {unknown_name(what, entry.name, known)}")
            skipped.append(entry.name if top else f"{cls.section}.{entry.name}")
            continue
        is_message = top and name in MESSAGES
        if entry.is_message != is_message:
            form = f"{name} {{ ... }}" if is_message else f"{name}: value"
            raise ValueError(f"{where}: {name} must be written as {form}")
        if is_message:
            merged = out.setdefault(name, {})
            for key, value in _decode(entry.value, MESSAGES[name], source, ignore_unknown,
                                      skipped).items():
                merged[key] = merged.get(key, []) + value if isinstance(value, list) else value
            continue
        spec = cls.specs()[name]
        value = prototxt.value_of(entry.value, spec.type, cls.label(name), source, spec.enum)
        try:
            value = spec.coerce_item(value, cls.label(name))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}: {e}") from None
        if spec.is_list:
            out.setdefault(name, []).append(value)
        else:
            out[name] = value
    return out


def _decoded_name(cls: type[Config], name: str) -> Union[str, None]:
    try:
        if cls is top_level():
            return resolve_name(name)
        return cls.canonical(name)
    except (TypeError, ValueError):
        return None
