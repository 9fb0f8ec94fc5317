"""Parameter-server checkpoints: which files a save holds and what a load accepts.

:mod:`fleetx.checkpoint` makes a save atomic and its files verified (a manifest of SHA-256
hashes and a save id, committed last); this module decides what the files hold, and
:mod:`fleetx.ps.chain` checks a save's metadata and a chain of saves. Layout of a save's folder
(``dirname/save-<save id>/``; every array is a ``.npy`` written with ``allow_pickle=False``)::

    dense.json, dense-<table>.npy      worker 0: save id, mode, each dense table's flat weights
    server-<i>-of-<n>/                 server i of n
      meta.json                        format, save id, mode, base and previous save (deltas),
                                       shard_num, per table: kind, dim/width, rule, rows,
                                       passes (sparse) or start/stop/blocks/scalars (dense)
      sparse-<table>.keys.npy          int64 ids, in row order
      sparse-<table>.rows.npy          float32 (rows, width): weights, then (mode 0, or a delta
                                       of a mode 0 base) the rule's state
      sparse-<table>.stats.npy         every mode, tables with an accessor: [show, click,]
                                       passes since the last update, per row saved
      sparse-<table>.pending.keys.npy  with the state (mode 0, and its deltas), tables with an
      sparse-<table>.pending.npy       admission entry: every id waiting for admission, and
                                       (sightings, passes since the last one)
      sparse-<table>.deleted.npy       mode 2: ids removed (by a shrink) since the save before
      dense-<table>.npy                float32: this server's slice (with its state in mode 0)

Modes (``save_persistables(dirname, mode)``): 0 saves everything a resumed job needs; 1 a base
(weights and statistics); 2 a delta: only the rows changed since the previous save (with their
statistics) and the ids removed since (with the state when the chain's base is a mode 0 save);
loading a delta replays on the rows it does not hold the show/click decay of the shrinks since
the previous save (its ``passes`` minus the previous one's), so that a resumed job's shrinks
remove what the uninterrupted job's would; ``"export"`` the weights for serving
(:mod:`fleetx.ps_torch.export` adds the dense ``state_dict``).

A save refuses tables holding NaN or inf (the previous checkpoint stays). A load refuses, with a
:class:`~fleetx.checkpoint.CheckpointError` naming the file: a file whose bytes do not match
the manifest, a missing file, metadata from another save than the manifest's, a row count that
disagrees with ``meta.json``, a duplicated key or a key of another server, rows or slices
holding NaN or inf, slices that do not tile their dense table, saves that are not one chain.

Loading filters saved rows through the current partition function, so a checkpoint can be
loaded by the same number of servers (each reads back what it wrote) or by a different one
(each takes its ids from every saved shard, and re-cuts dense slices); deltas likewise. When the
saved rule differs from the current one (another state width), weights are kept and state
starts fresh.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from fleetx.checkpoint import Checkpoint, CheckpointError, SaveWriter
from fleetx.ps.api import PSConfigError
from fleetx.ps.chain import FORMAT, Save, bad_file as _bad, open_chain, read_meta as _read_meta
from fleetx.ps.partition import server_of
from fleetx.ps.table import DenseTable, SparseTable

__all__ = ["FORMAT", "Chain", "Loaded", "save_server", "load_server", "load_server_folder",
           "save_dense", "load_dense", "server_folder", "confine"]


class Chain(NamedTuple):
    """The chain of saves a server continues: its base save, the last save, whether the base
    holds optimizer state (mode 0), which its deltas then carry too, and the sparse tables of
    the chain that were not loaded (``init_server(var_names=...)``)."""

    base: str
    prev: str
    state: bool
    skipped: tuple = ()

    def check_delta(self, error: Callable[[str], Exception], what: str) -> None:
        """Refuse a delta that cannot continue this chain: a table of the chain that was not
        loaded holds other rows than the chain says, so a delta (changed rows only) would claim
        the chain's rows for it; only a full save can start a chain again.

        Args:
            error: the exception to raise, built from its message.
            what: what was asked, leading the message.

        Raises:
            ``error``: ``"<what>: a delta (mode 2) cannot continue ..."``, naming the tables.

        Example:
            >>> Chain("a", "a", True, ("emb",)).check_delta(ValueError, "SAVE")
            Traceback (most recent call last):
            ValueError: SAVE: a delta (mode 2) cannot continue the chain of base save a: ...
        """
        if self.skipped:
            raise error(f"{what}: a delta (mode 2) cannot continue the chain of base save "
                        f"{self.base}: its table(s) {', '.join(map(repr, self.skipped))} were "
                        "not loaded (init_server with var_names), so their rows here are not "
                        "the chain's; make a full save (mode 0 or 1) first")


class Loaded(NamedTuple):
    """What :func:`load_server` loaded: rows (sparse) or values (dense) per table, and the
    chain the loaded saves form."""

    rows: dict
    chain: Chain


#: the most shrinks a delta may follow its previous save by (its show/click decay is replayed)
MAX_PASSES_BETWEEN = 1_000_000


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


def _dense_shape(table: DenseTable, with_state: bool) -> tuple[int, int]:
    """(blocks, scalars): the slice row is ``blocks`` runs of ``numel`` then ``scalars``."""
    if not with_state:
        return 1, 0
    b = table.rule.width(0)
    return (table.rule.width(1) - b, b)


def _refuse_nonfinite(name: str, slab: np.ndarray) -> None:
    bad = int((~np.isfinite(slab)).any(axis=-1).sum()) if slab.size else 0
    if bad:
        raise CheckpointError(f"table {name!r}: {bad} rows hold NaN or inf; not saving them "
                              "(the previous checkpoint is kept)")


def save_server(writer: SaveWriter, index: int, num_servers: int, shard_num: int,
                sparse: Mapping[str, SparseTable], dense: Mapping[str, DenseTable],
                mode: Any = 0, chain: Optional[Chain] = None) -> dict:
    """Write server ``index``'s shards into ``writer``'s save; returns ``{table: rows}``.

    Args:
        mode: 0 everything, 1 a base, 2 a delta since ``chain.prev``, ``"export"`` weights.
        chain: the chain a delta continues (required for mode 2).

    Raises:
        CheckpointError: a table holds NaN or inf, or a file cannot be written.
    """
    if mode == "export":  # serving takes the dense weights from the worker's state_dict
        dense = {}
    for name, t in {**sparse, **dense}.items():
        _refuse_nonfinite(name, t.slab)
    with_state = mode == 0 or (mode == 2 and chain.state)
    folder = server_folder(index, num_servers)
    meta: dict = {"format": FORMAT, "save_id": writer.save_id, "server": index, "mode": mode,
                  "num_servers": num_servers, "shard_num": shard_num, "tables": {}}
    if mode == 2:
        meta.update(base_save_id=chain.base, prev_save_id=chain.prev)
    counts = {}
    for name, t in sparse.items():
        meta["tables"][name] = _save_sparse(writer, f"{folder}/sparse-{name}", t, mode,
                                            with_state)
        counts[name] = meta["tables"][name]["rows"]
    for name, t in dense.items():
        writer.write_array(f"{folder}/dense-{name}.npy",
                           t.slab[0] if with_state else t.slab[0, :t.numel])
        blocks, scalars = _dense_shape(t, with_state)
        meta["tables"][name] = {"kind": "dense", "start": t.start, "stop": t.stop,
                                "rule": t.rule.name, "blocks": blocks, "scalars": scalars}
    writer.write_json(f"{folder}/meta.json", meta)
    return counts


def _save_sparse(writer: SaveWriter, stem: str, t: SparseTable, mode: Any,
                 with_state: bool) -> dict:
    """Write one sparse table's files (``stem`` + suffix); returns its ``meta.json`` entry."""
    n = len(t)
    rows = t.changes.changed(n) if mode == 2 else slice(0, n)
    cols = slice(None) if with_state else slice(0, t.dim)
    keys, values = t.index.keys[rows], t.slab[rows, cols]
    writer.write_array(f"{stem}.keys.npy", keys)
    writer.write_array(f"{stem}.rows.npy", values)
    info = {"kind": "sparse", "dim": t.dim, "width": values.shape[1], "rule": t.rule.name,
            "rows": len(keys), "passes": t.passes}
    if t.stats is not None and mode != "export":  # a resumed shrink needs them in every mode
        chosen = rows if mode == 2 else np.arange(n)
        writer.write_array(f"{stem}.stats.npy", t.stats.state(chosen, t.passes))
        info["stats"] = t.stats.width
    if with_state and t.admission is not None:  # all of them: a delta's replace the base's
        ids, pending = t.admission.state()
        pending[:, 1] = t.passes - pending[:, 1]  # portable: passes since the last sighting
        writer.write_array(f"{stem}.pending.keys.npy", ids)
        writer.write_array(f"{stem}.pending.npy", pending)
        info["pending"] = len(ids)
    if mode == 2:
        deleted = t.changes.removed_ids()
        writer.write_array(f"{stem}.deleted.npy", deleted)
        info["deleted"] = len(deleted)
    return info


def save_dense(writer: SaveWriter, values: Mapping[str, np.ndarray], mode: Any = 0) -> None:
    """Worker 0: write each dense table's full flat weights into ``writer``'s save.

    Raises:
        CheckpointError: a table holds NaN or inf, or a file cannot be written.
    """
    values = {n: np.asarray(v, np.float32).reshape(-1) for n, v in values.items()}
    for name, v in values.items():
        _refuse_nonfinite(name, v)
        writer.write_array(f"dense-{name}.npy", v)
    writer.write_json("dense.json", {"format": FORMAT, "save_id": writer.save_id, "mode": mode,
                                     "tables": {n: int(v.size) for n, v in values.items()}})


# ------------------------------------------------------------------------------ loading


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
    """``(keys, rows, table info)`` of one table in one server folder, checked."""
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
    return keys, rows, info


def _read_extra(ckpt: Checkpoint, rel: str, n: int, width: Optional[int], dtype) -> np.ndarray:
    """A per-id array of a sparse table (statistics, pending counts, deleted ids), checked."""
    a = ckpt.read_array(rel)
    shape = (n,) if width is None else (n, width)
    if a.dtype != dtype or a.shape != shape:
        raise _bad(ckpt, rel, f"expected {np.dtype(dtype)} {shape}, got {a.dtype} {a.shape}")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise _bad(ckpt, rel, f"{int((~np.isfinite(a)).sum())} values are NaN or inf")
    return a


def _load_sparse(save: Save, name: str, t: SparseTable, mine) -> int:
    """Replay one save of one sparse table on ``t`` (its deletions, then its rows); returns the
    rows written. ``mine(keys)``: the mask of keys this server owns."""
    n, ckpt = 0, save.ckpt
    parts = [(folder, meta) for folder, meta in save.servers if name in meta["tables"]]
    passes = max(_count(ckpt, folder, meta["tables"][name], "passes", 0)
                 for folder, meta in parts)
    if save.mode == 2 and t.stats is not None:  # the shrinks between the saves decayed every row
        if passes - t.passes > MAX_PASSES_BETWEEN:
            raise _bad(ckpt, f"{parts[0][0]}/meta.json", f"table {name!r}: {passes} passes, "
                       f"{passes - t.passes} after the save before it (at most "
                       f"{MAX_PASSES_BETWEEN} between two saves)")
        t.stats.decay(len(t), passes - t.passes)
    t.passes = max(t.passes, passes)  # before the rows: rows created now are of this pass
    if t.admission is not None and save.mode == 2 and \
            any("pending" in meta["tables"][name] for _, meta in parts):
        t.admission.clear()  # admitted or forgotten since the save before
    for folder, meta in parts:
        stem = f"{folder}/sparse-{name}"
        info = meta["tables"][name]
        if save.mode == 2:
            deleted = _read_extra(ckpt, f"{stem}.deleted.npy", _count(ckpt, folder, info,
                                                                       "deleted"), None, np.int64)
            t.remove(deleted[mine(deleted)])
        keys, rows, info = _read_sparse(ckpt, folder, meta, name, t.dim)
        own = mine(keys)
        if info.get("rule") == t.rule.name:
            placed = t.load(keys[own], rows[own])
        else:  # another rule's state means nothing here: keep the weights only
            t.assign(keys[own], rows[own][:, :t.dim])
            placed = t.index.find(keys[own])
        if "stats" in info and t.stats is not None and info["stats"] == t.stats.width:
            stats = _read_extra(ckpt, f"{stem}.stats.npy", len(keys), info["stats"], np.float32)
            t.stats.restore(placed, stats[own], t.passes)
        elif t.stats is not None:  # a save without statistics: count its rows as seen now
            t.stats.touched(placed, t.passes)
        if "pending" in info and t.admission is not None:
            _load_pending(ckpt, stem, _count(ckpt, folder, info, "pending"), t, mine)
        n += int(own.sum())
    return n


def _count(ckpt: Checkpoint, folder: str, info: dict, key: str, default: Any = None) -> int:
    v = info.get(key, default)
    if type(v) is not int or v < 0:
        raise _bad(ckpt, f"{folder}/meta.json", f"malformed {key!r} count {v!r}")
    return v


def _load_pending(ckpt: Checkpoint, stem: str, n: int, t: SparseTable, mine) -> None:
    ids = _read_extra(ckpt, f"{stem}.pending.keys.npy", n, None, np.int64)
    cols = _read_extra(ckpt, f"{stem}.pending.npy", n, 2, np.float32)
    own = mine(ids)
    cols = cols[own].copy()
    cols[:, 1] = t.passes - cols[:, 1]
    t.admission.restore(ids[own], cols)


def load_server(dirnames: Union[str, Sequence[str]], index: int, num_servers: int,
                shard_num: int, sparse: Mapping[str, SparseTable],
                dense: Mapping[str, DenseTable], tables: Optional[Sequence[str]] = None
                ) -> Loaded:
    """Fill this server's tables from a save, or from a base save and the deltas after it.

    Tables absent from the saves are left as they are (and not marked loaded).

    Args:
        dirnames: a save folder, or a base and its deltas in the order they were saved.
        tables: load only these tables (sparse or dense); None: every table.

    Raises:
        CheckpointError: no checkpoint, any file that does not match, saves that are not one
            chain (named).
        PSConfigError: a table's shape changed, or ``tables`` names a table that is not in
            this job or not in the save.
    """
    saves = open_chain(dirnames)
    for save in saves:
        _worker_dense(save.ckpt)  # not used here, but a save is accepted whole or not at all
    names = _selected(tables, sparse, dense, saves[0])

    def mine(keys):
        return server_of(keys, num_servers, shard_num) == index

    loaded: dict = {}
    for name in names & set(sparse):
        t = sparse[name]
        for save in saves:
            if any(name in m["tables"] for _, m in save.servers):
                _load_sparse(save, name, t, mine)
                loaded[name] = len(t)
    for name in names & set(dense):
        parts = [(folder, m) for folder, m in saves[-1].servers if name in m["tables"]]
        if parts:
            _load_dense_slice(saves[-1].ckpt, name, dense[name], parts)
            loaded[name] = dense[name].numel
    skipped = sorted(n for n in set(sparse) - names
                     if any(n in m["tables"] for save in saves for _, m in save.servers))
    return Loaded(loaded, Chain(saves[0].save_id, saves[-1].save_id, saves[0].mode == 0,
                                tuple(skipped)))


def _selected(tables, sparse, dense, base: Save) -> set:
    """The names of ``tables`` (None: all), checked against the job's tables and the save."""
    if tables is None:
        return set(sparse) | set(dense)
    if isinstance(tables, str) or not all(isinstance(n, str) for n in tables):
        raise PSConfigError(f"var_names={tables!r}: expected a list of table names")
    known = set(sparse) | set(dense)
    saved = {n for _, m in base.servers for n in m["tables"]}
    for n in tables:
        if n not in known:
            raise PSConfigError(f"var_names: no table {n!r} in this job; its tables: "
                                f"{', '.join(sorted(known))}")
        if n not in saved:
            raise PSConfigError(f"var_names: table {n!r} is not in the save "
                                f"{base.ckpt.dirname}; it holds: {', '.join(sorted(saved))}")
    return set(tables)


def _dense_part(ckpt: Checkpoint, folder: str, meta: dict, name: str) -> tuple[dict, np.ndarray]:
    """``(info, row)`` of one saved slice of a dense table, checked: its ``meta.json`` entry,
    the row's type and length, finite values."""
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
    return info, row


def _dense_parts(ckpt: Checkpoint, name: str, parts: list) -> list:
    """``(info, row)`` of every saved slice of a dense table, sorted, checked to tile it."""
    out, stop = sorted((_dense_part(ckpt, folder, meta, name) for folder, meta in parts),
                       key=lambda x: x[0]["start"]), 0
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


def load_server_folder(ckpt: Checkpoint, index: int, num_servers: int, shard_num: int,
                       sparse: Mapping[str, SparseTable], dense: Mapping[str, DenseTable]
                       ) -> Loaded:
    """Fill this server's tables from its own folder of an opened save, the only folder that
    save needs to hold (a server's failover snapshot, :mod:`fleetx.ps.snapshots`): the sparse
    rows this server owns, and the dense slice it owns, which must be the slice saved there.
    Every file is checked as :func:`load_server` checks it. Tables absent from the folder are
    left as they are.

    Args:
        ckpt: the save, opened (its manifest read once by the caller).
        index, num_servers, shard_num: this server; the folder must have been written by the
            same server of the same cluster.

    Raises:
        CheckpointError: the folder's metadata or any file does not match, the folder holds a
            delta or an export (neither loads alone), a dense slice other than this server's
            (the file is named).
        PSConfigError: a table's shape changed.

    Example:
        >>> loaded = load_server_folder(Checkpoint(d), 0, 2, 2, sparse, dense)  # doctest: +SKIP
        >>> sorted(loaded.rows)
        ['dense', 'emb']
    """
    folder = server_folder(index, num_servers)
    meta = _read_meta(ckpt, f"{folder}/meta.json")
    _check_own(ckpt, folder, meta, (index, num_servers, shard_num))
    save = Save(ckpt, [(folder, meta)], meta.get("mode", 0), None, None)

    def mine(keys):
        return server_of(keys, num_servers, shard_num) == index

    loaded: dict = {}
    for name in sorted(set(sparse) & set(meta["tables"])):
        _load_sparse(save, name, sparse[name], mine)
        loaded[name] = len(sparse[name])
    for name in sorted(set(dense) & set(meta["tables"])):
        _load_own_slice(ckpt, folder, meta, name, dense[name])
        loaded[name] = dense[name].numel
    return Loaded(loaded, Chain(ckpt.save_id, ckpt.save_id, save.mode == 0))


def _check_own(ckpt: Checkpoint, folder: str, meta: dict, server: tuple) -> None:
    """``meta`` was written by ``server`` (index, num_servers, shard_num), in a save that loads
    alone (mode 0 or 1)."""
    rel = f"{folder}/meta.json"
    saved = tuple(meta.get(k) for k in ("server", "num_servers", "shard_num"))
    if not all(type(v) is int for v in saved) or saved != server:
        raise _bad(ckpt, rel, f"written by server {saved[0]!r} of {saved[1]!r} (shard_num "
                   f"{saved[2]!r}), this is server {server[0]} of {server[1]} (shard_num "
                   f"{server[2]})")
    if meta.get("mode", 0) not in (0, 1):
        raise _bad(ckpt, rel, f"save mode {meta.get('mode')!r} does not load alone: expected "
                   "a full save (mode 0 or 1)")


def _load_own_slice(ckpt: Checkpoint, folder: str, meta: dict, name: str,
                    t: DenseTable) -> None:
    info, row = _dense_part(ckpt, folder, meta, name)
    if (info["start"], info["stop"]) != (t.start, t.stop):
        raise _bad(ckpt, f"{folder}/dense-{name}.npy", f"holds [{info['start']}, "
                   f"{info['stop']}) of dense table {name!r}, this server owns [{t.start}, "
                   f"{t.stop})")
    n = t.numel  # the row: blocks runs of n values (weights first), then scalars
    t.assign(row[:n], row[n:] if info.get("rule") == t.rule.name else None)


def load_dense(dirnames: Union[str, Sequence[str]]) -> dict[str, np.ndarray]:
    """The dense weights worker 0 saved, by table name (verified; empty when the save has
    none); of a chain of saves, the last one's.

    Raises:
        CheckpointError: a damaged, missing or mismatched file, saves that are not one chain
            (named).
    """
    return _worker_dense(open_chain(dirnames)[-1].ckpt)


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
