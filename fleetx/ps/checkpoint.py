"""Parameter-server checkpoints: which files a save holds and what a load accepts.

:mod:`fleetx.checkpoint` makes a save atomic and its files verified (a manifest of SHA-256
hashes and a save id, committed last); this module decides what the files hold. Layout of a
save's folder (``dirname/save-<save id>/``; every array is a ``.npy`` written with
``allow_pickle=False``)::

    dense.json, dense-<table>.npy      worker 0: save id, each dense table's full flat weights
    server-<i>-of-<n>/                 server i of n
      meta.json                        format, save id, shard_num, per table: kind, dim/width,
                                       rule, rows (sparse) or start/stop/blocks/scalars (dense)
      sparse-<table>.keys.npy          int64 ids, in row order
      sparse-<table>.rows.npy          float32 (rows, width): weights then rule state
      dense-<table>.npy                float32 (width,): this server's slice with its state

A save refuses tables holding NaN or inf (the previous checkpoint stays). A load refuses, with a
:class:`~fleetx.checkpoint.CheckpointError` naming the file: a file whose bytes do not match
the manifest, a missing file, metadata from another save than the manifest's, a row count that
disagrees with ``meta.json``, a duplicated key or a key of another server, rows or slices
holding NaN or inf, slices that do not tile their dense table.

Loading filters saved rows through the current partition function, so a checkpoint can be
loaded by the same number of servers (each reads back what it wrote) or by a different one
(each takes its ids from every saved shard, and re-cuts dense slices). When the saved rule
differs from the current one (another state width), weights are kept and state starts fresh.
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping

import numpy as np

from fleetx.checkpoint import Checkpoint, CheckpointError, SaveWriter
from fleetx.ps.api import PSConfigError
from fleetx.ps.partition import server_of
from fleetx.ps.table import DenseTable, SparseTable

__all__ = ["FORMAT", "save_server", "load_server", "save_dense", "load_dense", "server_folder",
           "confine"]

FORMAT = 2
_FOLDER = re.compile(r"(server-(\d+)-of-(\d+))/meta\.json\Z")


def server_folder(index: int, num_servers: int) -> str:
    """Server ``index``'s folder inside a save."""
    return f"server-{index}-of-{num_servers}"


def confine(path: str, root: str) -> str:
    """``path`` as a real absolute path, if it lies under ``root`` (a relative ``path`` is
    taken relative to ``root``; symbolic links are resolved before the check).

    Raises:
        PSConfigError: the path leaves the root (the message names both).
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if os.path.commonpath([real_root, real]) != real_root:
        raise PSConfigError(f"checkpoint folder {path!r} is outside the save root {real_root!r}; "
                          "save and load under it, or set FLEETX_PS_SAVE_ROOT")
    return real


def _dense_shape(table: DenseTable) -> tuple[int, int]:
    """(blocks, scalars): the slice row is ``blocks`` runs of ``numel`` then ``scalars``."""
    b = table.rule.width(0)
    return (table.rule.width(1) - b, b)


def _refuse_nonfinite(name: str, slab: np.ndarray) -> None:
    bad = int((~np.isfinite(slab)).any(axis=-1).sum()) if slab.size else 0
    if bad:
        raise CheckpointError(f"table {name!r}: {bad} rows hold NaN or inf; not saving them "
                              "(the previous checkpoint is kept)")


def save_server(writer: SaveWriter, index: int, num_servers: int, shard_num: int,
                sparse: Mapping[str, SparseTable], dense: Mapping[str, DenseTable]) -> dict:
    """Write server ``index``'s shards into ``writer``'s save; returns ``{table: rows}``.

    Raises:
        CheckpointError: a table holds NaN or inf, or a file cannot be written.
    """
    for name, t in {**sparse, **dense}.items():
        _refuse_nonfinite(name, t.slab)
    folder = server_folder(index, num_servers)
    meta: dict = {"format": FORMAT, "save_id": writer.save_id, "server": index,
                  "num_servers": num_servers, "shard_num": shard_num, "tables": {}}
    counts = {}
    for name, t in sparse.items():
        writer.write_array(f"{folder}/sparse-{name}.keys.npy", t.index.keys)
        writer.write_array(f"{folder}/sparse-{name}.rows.npy", t.slab)
        meta["tables"][name] = {"kind": "sparse", "dim": t.dim, "width": t.width,
                                "rule": t.rule.name, "rows": len(t)}
        counts[name] = len(t)
    for name, t in dense.items():
        writer.write_array(f"{folder}/dense-{name}.npy", t.slab[0])
        blocks, scalars = _dense_shape(t)
        meta["tables"][name] = {"kind": "dense", "start": t.start, "stop": t.stop,
                                "rule": t.rule.name, "blocks": blocks, "scalars": scalars}
    writer.write_json(f"{folder}/meta.json", meta)
    return counts


def save_dense(writer: SaveWriter, values: Mapping[str, np.ndarray]) -> None:
    """Worker 0: write each dense table's full flat weights into ``writer``'s save.

    Raises:
        CheckpointError: a table holds NaN or inf, or a file cannot be written.
    """
    values = {n: np.asarray(v, np.float32).reshape(-1) for n, v in values.items()}
    for name, v in values.items():
        _refuse_nonfinite(name, v)
        writer.write_array(f"dense-{name}.npy", v)
    writer.write_json("dense.json", {"format": FORMAT, "save_id": writer.save_id,
                                     "tables": {n: int(v.size) for n, v in values.items()}})


# ------------------------------------------------------------------------------ loading


def _bad(ckpt: Checkpoint, rel: str, what: str) -> CheckpointError:
    return CheckpointError(f"{ckpt.path(rel)}: {what}", ckpt.path(rel))


def _read_meta(ckpt: Checkpoint, rel: str) -> dict:
    """A ``meta.json`` / ``dense.json`` of this save: right format and save id."""
    meta = ckpt.read_json(rel)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(ckpt, rel, f"checkpoint format {_get(meta, 'format')!r}, expected {FORMAT}")
    if meta.get("save_id") != ckpt.save_id:
        raise _bad(ckpt, rel, f"belongs to save {meta.get('save_id')!r}, but the manifest is of "
                   f"save {ckpt.save_id!r}: files of different saves are mixed")
    if not isinstance(meta.get("tables"), dict):
        raise _bad(ckpt, rel, "no 'tables' object")
    return meta


def _get(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, dict) else None


def _saved_servers(ckpt: Checkpoint) -> list[tuple[str, dict]]:
    """``(folder, meta)`` of every saved server, checked to be one complete set."""
    found = []
    for rel in ckpt.names("server-"):
        m = _FOLDER.match(rel)
        if not m:
            continue
        meta = _read_meta(ckpt, rel)
        if (meta.get("server"), meta.get("num_servers")) != (int(m[2]), int(m[3])) or \
                not isinstance(meta.get("shard_num"), int) or meta["shard_num"] < 1:
            raise _bad(ckpt, rel, f"says server {meta.get('server')} of "
                       f"{meta.get('num_servers')} (shard_num {meta.get('shard_num')!r}) but "
                       f"lies in {m[1]}")
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


def _table_info(ckpt: Checkpoint, folder: str, name: str, info: Any, keys: tuple) -> dict:
    if not isinstance(info, dict) or not all(isinstance(info.get(k), int) and info[k] >= 0
                                             for k in keys):
        raise _bad(ckpt, f"{folder}/meta.json", f"table {name!r}: malformed entry {info!r}")
    return info


def _check_keys(ckpt: Checkpoint, rel: str, keys: np.ndarray, meta: dict) -> None:
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise _bad(ckpt, rel, f"keys must be a 1-d int64 array, got {keys.dtype} {keys.shape}")
    ordered = np.sort(keys)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(dup):
        raise _bad(ckpt, rel, f"duplicated key {int(dup[0])} ({len(dup)} duplicates)")
    owner = server_of(keys, meta["num_servers"], meta["shard_num"])
    foreign = keys[owner != meta["server"]]
    if len(foreign):
        raise _bad(ckpt, rel, f"key {int(foreign[0])} belongs to another server than "
                   f"server {meta['server']} of {meta['num_servers']}")


def _check_rows(ckpt: Checkpoint, rel: str, rows: np.ndarray, width: int, keys) -> None:
    if rows.dtype != np.float32 or rows.ndim != 2 or rows.shape[1] != width:
        raise _bad(ckpt, rel, f"rows must be float32 (n, {width}), got {rows.dtype} "
                   f"{rows.shape}")
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        raise _bad(ckpt, rel, f"{int(bad.sum())} rows hold NaN or inf (the first: key "
                   f"{int(keys[bad][0])})")


def _read_sparse(ckpt: Checkpoint, folder: str, meta: dict, name: str, dim: int):
    """``(keys, rows, saved rule)`` of one table in one server folder, checked."""
    info = _table_info(ckpt, folder, name, meta["tables"][name], ("dim", "width", "rows"))
    if info["dim"] != dim:
        raise PSConfigError(f"table {name!r}: saved dim {info['dim']} != {dim}")
    k_rel, r_rel = f"{folder}/sparse-{name}.keys.npy", f"{folder}/sparse-{name}.rows.npy"
    keys, rows = ckpt.read_array(k_rel), ckpt.read_array(r_rel)
    _check_keys(ckpt, k_rel, keys, meta)
    if not info["rows"] == len(keys) == len(rows):
        raise _bad(ckpt, f"{folder}/meta.json", f"wrong row count: table {name!r} has "
                   f"{info['rows']} rows here, but {k_rel} holds {len(keys)} keys and {r_rel} "
                   f"{len(rows)} rows")
    _check_rows(ckpt, r_rel, rows, info["width"], keys)
    return keys, rows, info.get("rule")


def load_server(dirname: str, index: int, num_servers: int, shard_num: int,
                sparse: Mapping[str, SparseTable], dense: Mapping[str, DenseTable]) -> dict:
    """Fill this server's tables from a checkpoint; returns ``{table: rows loaded}``.

    Tables absent from the checkpoint are left as they are (and not marked loaded).

    Raises:
        CheckpointError: no checkpoint, or any file that does not match (named).
        PSConfigError: a table's shape changed.
    """
    ckpt = Checkpoint(dirname)
    saved = _saved_servers(ckpt)
    _worker_dense(ckpt)  # not used here, but a checkpoint is accepted whole or not at all
    loaded: dict = {}
    for name, t in sparse.items():
        n = 0
        for folder, meta in saved:
            if name not in meta["tables"]:
                continue
            keys, rows, rule = _read_sparse(ckpt, folder, meta, name, t.dim)
            mine = server_of(keys, num_servers, shard_num) == index
            if mine.any():
                if rule == t.rule.name:
                    t.load(keys[mine], rows[mine])
                else:  # another rule's state means nothing here: keep the weights only
                    t.assign(keys[mine], rows[mine][:, :t.dim])
                n += int(mine.sum())
            loaded[name] = n
    for name, t in dense.items():
        parts = [(folder, m) for folder, m in saved if name in m["tables"]]
        if parts:
            _load_dense_slice(ckpt, name, t, parts)
            loaded[name] = t.numel
    return loaded


def _dense_parts(ckpt: Checkpoint, name: str, parts: list) -> list:
    """``(info, row)`` of every saved slice of a dense table, sorted, checked to tile it."""
    out, stop = [], 0
    for folder, meta in parts:
        info = _table_info(ckpt, folder, name, meta["tables"][name],
                           ("start", "stop", "blocks", "scalars"))
        rel = f"{folder}/dense-{name}.npy"
        row = ckpt.read_array(rel)
        need = info["blocks"] * (info["stop"] - info["start"]) + info["scalars"]
        if row.dtype != np.float32 or row.shape != (need,):
            raise _bad(ckpt, rel, f"expected float32 ({need},) for [{info['start']}, "
                       f"{info['stop']}), got {row.dtype} {row.shape}")
        if not np.isfinite(row).all():
            raise _bad(ckpt, rel, f"{int((~np.isfinite(row)).sum())} values are NaN or inf")
        out.append((info, row))
    out.sort(key=lambda x: x[0]["start"])
    for info, _ in out:
        if info["start"] != stop or info["stop"] < info["start"]:
            raise CheckpointError(f"{ckpt.folder}: the slices of dense table {name!r} do not "
                                  f"tile it (a slice starts at {info['start']}, expected "
                                  f"{stop})", ckpt.folder)
        stop = info["stop"]
    return out


def _load_dense_slice(ckpt: Checkpoint, name: str, t: DenseTable, parts: list) -> None:
    parts = _dense_parts(ckpt, name, parts)
    numel = parts[-1][0]["stop"]
    if numel != t.spec.numel:
        raise PSConfigError(f"dense table {name!r}: saved numel {numel} != {t.spec.numel}")
    blocks, scalars = parts[0][0]["blocks"], parts[0][0]["scalars"]
    full = np.zeros((blocks, numel), np.float32)
    tail = np.zeros(scalars, np.float32)
    for info, row in parts:
        n = info["stop"] - info["start"]
        full[:, info["start"]:info["stop"]] = row[:blocks * n].reshape(blocks, n)
        if info["start"] == 0:
            tail = row[blocks * n:]
    mine = full[:, t.start:t.stop]
    same_rule = parts[0][0]["rule"] == t.rule.name
    state = np.concatenate([mine[1:].reshape(-1), tail]) if same_rule else None
    t.assign(mine[0], state)


def load_dense(dirname: str) -> dict[str, np.ndarray]:
    """The dense weights worker 0 saved, by table name (verified; empty when the save has
    none).

    Raises:
        CheckpointError: a damaged, missing or mismatched file (named).
    """
    return _worker_dense(Checkpoint(dirname))


def _worker_dense(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    if "dense.json" not in ckpt:
        return {}
    meta = _read_meta(ckpt, "dense.json")
    out = {}
    for name, numel in meta["tables"].items():
        rel = f"dense-{name}.npy"
        v = ckpt.read_array(rel)
        if v.dtype != np.float32 or v.shape != (numel,):
            raise _bad(ckpt, rel, f"expected float32 ({numel},) as dense.json says, got "
                       f"{v.dtype} {v.shape}")
        if not np.isfinite(v).all():
            raise _bad(ckpt, rel, f"{int((~np.isfinite(v)).sum())} values are NaN or inf")
        out[name] = v
    return out
