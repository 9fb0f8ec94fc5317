"""Reading parameter-server saves: each save's metadata checked, and a chain of saves (a base and
the deltas after it) checked to be one chain in the order it was written.

A save's kind is its *mode*, written in every ``meta.json`` and in the manifest's ``info``:
0 (everything: rows with optimizer state and statistics), 1 (a base: weights and statistics),
2 (a delta: what changed since the save before it, which it names with the base of its
chain), or ``"export"`` (weights for serving; not loadable as a checkpoint). Saves of format 2
(before modes existed) are full saves, mode 0.

Every ``meta.json`` field a load trusts is checked for its type before use (a hostile save
cannot make a load allocate or loop for what it claims): format, mode and server numbers are
ints (not floats or booleans), ``1 <= num_servers <= `` the server folders present,
``num_servers <= shard_num <= MAX_SHARD_NUM``, a delta's base and previous save are save ids,
table names follow the table-name rule.

:func:`open_chain` refuses, naming the manifest files involved: a delta given first (its base
is missing), a delta of another base than the first save's (another chain), a delta that does
not follow the save given before it (out of order, or a delta missing in between), a base
given after the first save, an export, and a save whose server folders disagree on its mode.
The per-file checks every load makes (hashes, row counts, keys, NaN) are in
:mod:`fleetx.ps.checkpoint`.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple, Sequence, Union

from fleetx.checkpoint import Checkpoint, CheckpointError
from fleetx.checkpoint.api import check_save_id

__all__ = ["FORMAT", "READABLE", "Save", "open_chain", "read_meta", "bad_file", "saved_servers"]

#: the format of a save's metadata files; older readable ones are listed in READABLE
FORMAT = 3
READABLE = (2, 3)
MODES = (0, 1, 2, "export")
_FOLDER = re.compile(r"(server-(\d{1,9})-of-(\d{1,9}))/meta\.json\Z")
#: the largest shard_num a save may claim (ids map to servers as shard * num_servers // shard_num
#: in int64)
MAX_SHARD_NUM = 1 << 31


class Save(NamedTuple):
    """One opened save: its checkpoint, its server folders ``[(folder, meta)]``, its mode, and
    for a delta the base of its chain and the save it follows."""

    ckpt: Checkpoint
    servers: list
    mode: Any
    base: str
    prev: str

    @property
    def save_id(self) -> str:
        return self.ckpt.save_id


def bad_file(ckpt: Checkpoint, rel: str, what: str) -> CheckpointError:
    """The error for file ``rel`` of ``ckpt`` (its path leads the message)."""
    return CheckpointError(f"{ckpt.path(rel)}: {what}", ckpt.path(rel))


def read_meta(ckpt: Checkpoint, rel: str) -> dict:
    """A ``meta.json`` / ``dense.json`` of this save: a readable format and this save's id.

    Raises:
        CheckpointError: another format, another save's id, no tables (names the file).
    """
    meta = ckpt.read_json(rel)
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if type(fmt) is not int or fmt not in READABLE:
        raise bad_file(ckpt, rel, f"checkpoint format {fmt!r}, expected one of {READABLE}")
    if meta.get("save_id") != ckpt.save_id:
        raise bad_file(ckpt, rel, f"belongs to save {meta.get('save_id')!r}, but the manifest "
                       f"is of save {ckpt.save_id!r}: files of different saves are mixed")
    if not isinstance(meta.get("tables"), dict):
        raise bad_file(ckpt, rel, "no 'tables' object")
    mode = meta.get("mode", 0)
    if not (mode == "export" or type(mode) is int and mode in MODES):
        raise bad_file(ckpt, rel, f"unknown save mode {mode!r}: expected one of {MODES}")
    for key in ("base_save_id", "prev_save_id"):
        if key in meta and not (mode == 2 and _is_save_id(meta[key])):
            raise bad_file(ckpt, rel, f"{key}={meta[key]!r}: expected a save id (a string) "
                           "in a delta (mode 2) only")
    for name in meta["tables"]:  # the rule of SparseTableSpec / DenseTableSpec names
        if not (0 < len(name) <= 200 and name.isprintable() and "/" not in name):
            raise bad_file(ckpt, rel, f"bad table name {name!r}: expected 1-200 printable "
                           "characters without '/'")
    return meta


def _is_save_id(v: Any) -> bool:
    try:
        check_save_id(v)
    except CheckpointError:
        return False
    return True


def _check_server(ckpt: Checkpoint, rel: str, meta: dict, folder: re.Match, present: int) -> None:
    """``meta``'s server, num_servers and shard_num: ints that match its folder's name, with
    ``1 <= num_servers <= present`` (the server folders the save holds), so that nothing is
    sized by what a file claims."""
    index, n, shards = meta.get("server"), meta.get("num_servers"), meta.get("shard_num")
    what = f"says server {index!r} of {n!r} (shard_num {shards!r}) but lies in {folder[1]}"
    if not all(type(v) is int for v in (index, n, shards)):
        raise bad_file(ckpt, rel, f"{what}: server, num_servers and shard_num must be ints")
    if (index, n) != (int(folder[2]), int(folder[3])):
        raise bad_file(ckpt, rel, what)
    if not 1 <= n <= present:
        raise CheckpointError(f"{ckpt.folder}: incomplete checkpoint: {rel} claims {n} servers, "
                              f"but the save holds {present} server folder(s)", ckpt.folder)
    if not 0 <= index < n or not n <= shards <= MAX_SHARD_NUM:
        raise bad_file(ckpt, rel, f"{what}: expected 0 <= server < num_servers <= shard_num <= "
                       f"{MAX_SHARD_NUM}")


def saved_servers(ckpt: Checkpoint) -> list[tuple[str, dict]]:
    """``(folder, meta)`` of every saved server, checked to be one complete set."""
    found = []
    folders = [(rel, m) for rel in ckpt.names("server-") for m in [_FOLDER.match(rel)] if m]
    for rel, m in folders:
        meta = read_meta(ckpt, rel)
        _check_server(ckpt, rel, meta, m, len(folders))
        found.append((m[1], meta))
    if not found:
        raise CheckpointError(f"no parameter-server checkpoint in {ckpt.dirname} (its save has "
                              "no server-<i>-of-<n>/meta.json)", ckpt.dirname)
    n = found[0][1]["num_servers"]
    if sorted(m["server"] for _, m in found) != list(range(n)) or \
            len({m["num_servers"] for _, m in found}) != 1:
        raise CheckpointError(f"{ckpt.folder}: incomplete checkpoint: server folders "
                              f"{[f for f, _ in found]}, expected {n}", ckpt.folder)
    return found


def open_save(dirname: str) -> Save:
    """Open one save and read its mode (every server folder must agree with the others and
    with the manifest's ``info``)."""
    ckpt = Checkpoint(dirname)
    servers = saved_servers(ckpt)
    marks = {(m.get("mode", 0), m.get("base_save_id"), m.get("prev_save_id"))
             for _, m in servers}
    if len(marks) != 1:
        raise CheckpointError(f"{ckpt.folder}: the server folders disagree on the save's mode "
                              f"and chain: {sorted(marks, key=str)}", ckpt.folder)
    mode, base, prev = marks.pop()
    info = ckpt.manifest.info
    if info and (info.get("mode", 0), info.get("base_save_id"), info.get("prev_save_id")) != \
            (mode, base, prev):
        raise CheckpointError(f"{_manifest(ckpt)}: its info {dict(info)} disagrees with the "
                              f"server folders (mode {mode!r}, base {base!r}, previous {prev!r})",
                              _manifest(ckpt))
    return Save(ckpt, servers, mode, base, prev)


def _manifest(ckpt: Checkpoint) -> str:
    return f"{ckpt.dirname}/manifest.json"


def open_chain(dirnames: Union[str, Sequence[str]]) -> list[Save]:
    """Open a base save and the deltas to replay on it, in order, and check that they form
    one chain.

    Args:
        dirnames: a save folder, or a list: a full save (mode 0 or 1), then deltas (mode 2)
            in the order they were written.

    Raises:
        CheckpointError: a damaged save, or saves that are not one chain (names the manifest
            files).
    """
    names = [dirnames] if isinstance(dirnames, str) or not isinstance(dirnames, Sequence) \
        else list(dirnames)
    if not names:
        raise CheckpointError("no save folder given")
    saves = [open_save(str(d)) for d in names]
    first = saves[0]
    if first.mode == "export":
        raise CheckpointError(f"{_manifest(first.ckpt)}: an export for serving "
                              "(save_inference_model), not a checkpoint: it holds weights only; "
                              "load a save_persistables folder", _manifest(first.ckpt))
    if first.mode == 2:
        raise CheckpointError(f"{_manifest(first.ckpt)}: save {first.save_id} is a delta "
                              f"(mode 2) of base save {first.base}, which is missing: give its "
                              "base first, then the deltas in order: init_server([base, delta_1, "
                              "..., this one])", _manifest(first.ckpt))
    for before, save in zip(saves, saves[1:]):
        _check_link(first, before, save)
    return saves


def _check_link(first: Save, before: Save, save: Save) -> None:
    here = _manifest(save.ckpt)
    if save.mode != 2:
        raise CheckpointError(f"{here}: save {save.save_id} is a full save (mode {save.mode!r}); "
                              "only deltas (mode 2) may follow the first save of a chain", here)
    if save.base != first.save_id:
        raise CheckpointError(f"{here}: delta of base save {save.base}, but the base given "
                              f"({_manifest(first.ckpt)}) is save {first.save_id}: it belongs "
                              "to another chain", here)
    if save.prev != before.save_id:
        raise CheckpointError(f"{here}: delta that follows save {save.prev}, but the save given "
                              f"before it ({_manifest(before.ckpt)}) is {before.save_id}: give "
                              "the deltas in the order they were saved, none left out", here)
