"""``keep_last``: a folder of numbered checkpoints, of which the newest ``k`` are kept.

Layout of ``path`` (each ``step-<n>/`` a whole checkpoint: its manifest and its save folder)::

    step-<n>/     the checkpoint taken when the job had made n optimizer steps
    latest        the name of the newest one ("step-<n>"), rewritten after each commit

The newest checkpoint is the highest-numbered ``step-<n>/`` whose manifest is committed;
``latest`` is for people and tools (``cat ckpt/latest``): fleetx does not rely on it, so a crash
between a commit and the pointer's update loses nothing. A folder holds one layout: this one,
or the single checkpoint of a save without ``keep_last`` (``manifest.json`` at its top).

Example:
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> folder(root, 40).endswith("step-40")
    True
    >>> has_checkpoint(root)
    False
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Optional

from fleetx.checkpoint.api import MANIFEST, CheckpointError
from fleetx.checkpoint.manifest import has_checkpoint as _committed

__all__ = ["folder", "newest", "resolve", "has_checkpoint", "check_layout", "check_keep_last",
           "rotate", "read_latest", "LATEST"]

log = logging.getLogger("fleetx.checkpoint")

#: the pointer file naming the newest checkpoint
LATEST = "latest"
_STEP = re.compile(r"step-(\d+)\Z")


def folder(path: str, steps: int) -> str:
    """The folder of the checkpoint taken at ``steps`` optimizer steps."""
    return os.path.join(os.fspath(path), f"step-{int(steps)}")


def _numbered(path: str) -> list:
    """``(n, name)`` of every ``step-<n>`` folder in ``path``, committed or not, by n."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(m.group(1)), name) for name in names if (m := _STEP.match(name))
             and os.path.isdir(os.path.join(path, name))]
    return sorted(found)


def newest(path: str) -> Optional[str]:
    """The highest-numbered committed ``step-<n>`` folder of ``path``, or None."""
    committed = [name for _, name in _numbered(path) if _committed(os.path.join(path, name))]
    return os.path.join(os.fspath(path), committed[-1]) if committed else None


def resolve(path: str) -> str:
    """The folder to load from: ``path`` itself when it holds a single checkpoint, else its
    newest committed ``step-<n>/`` (``path`` when it holds neither, for the loader to say so)."""
    if _committed(path):
        return os.fspath(path)
    return newest(path) or os.fspath(path)


def has_checkpoint(dirname: str) -> bool:
    """True if ``dirname`` holds a committed checkpoint: its own manifest, or a committed
    ``step-<n>/`` folder (``keep_last``).

    Example:
        >>> has_checkpoint("/nonexistent")
        False
    """
    return _committed(dirname) or newest(dirname) is not None


def check_keep_last(keep_last: object) -> Optional[int]:
    """``keep_last`` if it is None or a whole number of at least 1.

    Raises:
        ValueError: anything else (the message shows the value).
    """
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last expects None (one checkpoint, replaced by each save) or a "
                         f"whole number of checkpoints of at least 1, got {keep_last!r}")
    return keep_last


def check_layout(path: str, keep_last: Optional[int]) -> None:
    """Refuse to save into ``path`` in the other layout than the one it holds.

    Raises:
        CheckpointError: ``path`` holds numbered checkpoints and ``keep_last`` is None, or a
            single checkpoint and ``keep_last`` is set (names the folder and both choices).
    """
    numbered = bool(_numbered(path))
    single = os.path.isfile(os.path.join(path, MANIFEST))
    if keep_last is None and numbered:
        raise CheckpointError(f"{path} holds checkpoints kept by keep_last (step-<n>/ folders): "
                              f"save there with keep_last=k, or choose another folder for a "
                              f"single checkpoint", os.fspath(path))
    if keep_last is not None and single:
        raise CheckpointError(f"{path} holds a single checkpoint (saved without keep_last): "
                              f"save there without keep_last, or choose another folder for "
                              f"keep_last={keep_last}", os.fspath(path))


def rotate(path: str, committed: str, keep_last: int) -> None:
    """After ``committed`` (a ``step-<n>`` folder of ``path``) was committed: point ``latest``
    at the newest checkpoint and remove all but the newest ``keep_last`` committed ones, and
    the folders of saves that never committed (killed). Failures only cost space: logged."""
    try:
        _write_latest(path, os.path.basename(newest(path) or committed))
    except OSError as e:
        log.warning("checkpoint %s: could not update %s: %s", path, LATEST, e)
    numbered = _numbered(path)
    done = [name for _, name in numbered if _committed(os.path.join(path, name))]
    keep = set(done[-keep_last:]) | {os.path.basename(committed)}
    for _, name in numbered:
        if name not in keep:
            try:
                shutil.rmtree(os.path.join(path, name))
            except OSError as e:
                log.warning("checkpoint %s: could not remove %s: %s", path, name, e)


def _write_latest(path: str, name: str) -> None:
    target = os.path.join(path, LATEST)
    tmp = f"{target}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_latest(path: str) -> Optional[str]:
    """The name ``latest`` holds, or None."""
    try:
        with open(os.path.join(path, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None
