"""Reading JSON and YAML strategy files so that every error names ``file:line``.

Python's ``json`` and PyYAML give the values but not where each key stood, so a wrong key
deep in a file would otherwise be reported with no place at all. :func:`read_mapping` parses a
file and returns the data with a *locator*: ``locate(("amp_configs", "decr_rate"))`` is the line
of that key. A malformed file is a ``ValueError`` starting ``file:line:col:``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional, Sequence

__all__ = ["read_mapping", "Locator"]

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
    yaml = _yaml()
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


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise ImportError("YAML strategy files need pyyaml: pip install pyyaml "
                          "(or pip install fleetx[yaml])") from None
    return yaml
