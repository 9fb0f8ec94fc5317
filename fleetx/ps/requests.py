"""Checking what a request asks for before it touches a table.

The transport guarantees only that a frame is well formed: a JSON meta block and raw arrays of
known dtypes. Everything else a request carries is checked here against this server's tables,
and a request that fails any check is refused as a whole with a :class:`RequestError` naming
the request kind, the table or field and what was expected; nothing of it is applied. Sync
rounds rely on this: a push joins a round only once it is known to apply, so one malformed
push can never take the other workers' pushes of the same round down with it.

Pure functions over ``(meta, buffers)`` and the tables' shapes: no sockets, no threads.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from fleetx.ps import kernels
from fleetx.ps.api import RequestError

__all__ = ["Push", "check_meta", "names", "parse_push", "nonfinite_error", "parse_pull",
           "parse_set_lr", "parse_barrier", "parse_save", "parse_shrink", "SAVE_MODES",
           "geo_names", "optional_bool"]

_I64, _F32 = np.dtype("<i8"), np.dtype("<f4")
MAX_NAME = 200       # barrier names
MAX_PATH = 4096      # SAVE folders (PATH_MAX)


class Push(NamedTuple):
    """A checked PUSH or INIT: ``sparse = [(table, ids, values (n, dim))]``,
    ``dense = [(table, flat values)]``; ``nonfinite``: tables whose values hold NaN or inf."""

    sparse: list
    dense: list
    nonfinite: list


def _fail(kind: str, message: str) -> RequestError:
    return RequestError(f"{kind}: {message}")


def check_meta(kind: str, meta: Any) -> dict:
    """``meta`` if it is a JSON object.

    Raises:
        RequestError: it is a list, a string, a number...
    """
    if not isinstance(meta, dict):
        raise _fail(kind, f"the meta block must be a JSON object, got {type(meta).__name__}")
    return meta


def names(kind: str, meta: dict, key: str, known: Mapping[str, Any], what: str) -> list:
    """``meta[key]``: a list of distinct names of ``known`` tables (missing: empty).

    Raises:
        RequestError: not a list of strings, a repeated name, or an unknown table.
    """
    value = meta.get(key, [])
    if value is None:
        value = []
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise _fail(kind, f"{key!r} must be a list of table names, got {_short(value)}")
    if len(set(value)) != len(value):
        raise _fail(kind, f"{key!r} names a table twice: {_short(value)}")
    for n in value:
        if n not in known:
            what_ = f"{what} " if what else ""
            raise _fail(kind, f"unknown {what_}table {_short(n)}; known {what_}tables: "
                        f"{', '.join(sorted(known)) or '(none)'}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _ids(kind: str, name: str, buf: np.ndarray, table) -> np.ndarray:
    if buf.dtype != _I64 or buf.ndim != 1:
        raise _fail(kind, f"table {name!r}: ids must be int64, got {buf.dtype}")
    bound = table.spec.num_embeddings
    if bound is not None and len(buf) and (buf.min() < 0 or buf.max() >= bound):
        raise _fail(kind, f"table {name!r}: ids must be in [0, {bound}); got "
                    f"[{buf.min()}, {buf.max()}]")
    return buf


def _values(kind: str, name: str, buf: np.ndarray, count: int, context: str) -> np.ndarray:
    if buf.dtype != _F32:
        raise _fail(kind, f"table {name!r}: values must be float32, got {buf.dtype}")
    if buf.size != count:
        raise _fail(kind, f"table {name!r}: got {buf.size} values, expected {count} ({context})")
    return buf


def parse_push(kind: str, meta: dict, bufs: list, sparse: Mapping[str, Any],
               dense: Mapping[str, Any]) -> Push:
    """A PUSH's or INIT's buffers, checked: per sparse table an int64 ids buffer (in bounds)
    and ``len(ids) * dim`` float32 values (a PUSH to a show/click table: ``dim + 2`` per id,
    the gradient then show and click), then per dense table this server's slice length.

    Raises:
        RequestError: any mismatch (the message names the table and both sizes).
    """
    s_names = names(kind, meta, "sparse", sparse, "sparse")
    d_names = names(kind, meta, "dense", dense, "dense")
    if len(bufs) != 2 * len(s_names) + len(d_names):
        raise _fail(kind, f"{len(s_names)} sparse and {len(d_names)} dense tables need "
                    f"{2 * len(s_names) + len(d_names)} buffers, got {len(bufs)}")
    out_s, out_d, bad = [], [], []
    for i, n in enumerate(s_names):
        t = sparse[n]
        ids = _ids(kind, n, bufs[2 * i], t)
        width = t.spec.push_width if kind == "PUSH" else t.dim
        what = f"dim {t.dim}" if width == t.dim else f"(dim {t.dim} + show, click)"
        vals = _values(kind, n, bufs[2 * i + 1], len(ids) * width, f"{len(ids)} ids x {what}")
        out_s.append((n, ids, vals.reshape(len(ids), width)))
    for j, n in enumerate(d_names):
        vals = _values(kind, n, bufs[2 * len(s_names) + j], dense[n].numel,
                       "this server's slice of the dense table")
        out_d.append((n, vals))
    for n, *arrays in out_s + out_d:
        if not kernels.all_finite(arrays[-1]):
            bad.append(n)
    return Push(out_s, out_d, bad)


def nonfinite_error(kind: str, push: Push, values: str) -> RequestError:
    """The refusal of a push or INIT holding NaN/inf values (names the tables)."""
    counts = {n: int((~np.isfinite(v[-1])).sum()) for n, *v in push.sparse + push.dense
              if n in push.nonfinite}
    listed = ", ".join(f"{n!r} ({c})" for n, c in counts.items())
    return _fail(kind, f"non-finite (NaN or inf) {values} refused in table {listed}")


def parse_pull(meta: dict, bufs: list, sparse: Mapping[str, Any],
               dense: Mapping[str, Any]) -> tuple[list, list, bool]:
    """``([(table, ids)], [dense table], create)`` of a PULL.

    Raises:
        RequestError: unknown tables, ids that are not int64 or out of bounds, a wrong count.
    """
    s_names = names("PULL", meta, "sparse", sparse, "sparse")
    d_names = names("PULL", meta, "dense", dense, "dense")
    if len(bufs) != len(s_names):
        raise _fail("PULL", f"{len(s_names)} sparse tables but {len(bufs)} id buffers")
    create = meta.get("create", True)
    if not isinstance(create, bool):
        raise _fail("PULL", f"'create' must be true or false, got {_short(create)}")
    return [(n, _ids("PULL", n, b, sparse[n])) for n, b in zip(s_names, bufs)], d_names, create


def parse_set_lr(meta: dict, tables: Mapping[str, Any], max_lr: float) -> tuple[float, list]:
    """``(lr, tables)`` of a SET_LR: a finite number in ``(0, max_lr]``; ``tables`` None or
    empty means every table.

    Raises:
        RequestError: a missing, non-numeric, non-finite or out-of-range rate, unknown tables.
    """
    lr = meta.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) \
            or not 0 < lr <= max_lr:
        raise _fail("SET_LR", f"learning rate {_short(lr)} refused: expected a finite number "
                    f"in (0, {max_lr:g}] (the maximum is FLEETX_PS_MAX_LR)")
    return float(lr), names("SET_LR", meta, "tables", tables, "") or list(tables)


def parse_barrier(meta: dict) -> str:
    """The barrier's name (a string of at most 200 characters; missing: ``""``)."""
    name = meta.get("name", "")
    if not isinstance(name, str) or len(name) > MAX_NAME:
        raise _fail("BARRIER", f"'name' must be a string of at most {MAX_NAME} characters")
    return name


#: SAVE modes: 0 everything (rows with optimizer state and statistics), 1 a base (weights),
#: 2 a delta since the last save, "export" weights for serving
SAVE_MODES = (0, 1, 2, "export")


def parse_save(meta: dict) -> tuple[str, str, Any]:
    """``(dirname, save_id, mode)`` of a SAVE (the id is checked where it names a folder; a
    missing mode is 0).

    Raises:
        RequestError: a missing or malformed folder, save id or mode.
    """
    dirname, save_id = meta.get("dirname"), meta.get("save_id")
    if not isinstance(dirname, str) or not dirname or len(dirname) > MAX_PATH or \
            "\0" in dirname:
        raise _fail("SAVE", f"'dirname' must be a path of 1-{MAX_PATH} characters, got "
                    f"{_short(dirname)}")
    if not isinstance(save_id, str):
        raise _fail("SAVE", f"'save_id' must be a string, got {_short(save_id)}")
    mode = meta.get("mode", 0)
    if isinstance(mode, bool) or mode not in SAVE_MODES:
        raise _fail("SAVE", f"'mode' must be one of {SAVE_MODES}, got {_short(mode)}")
    return dirname, save_id, mode


def parse_shrink(meta: dict) -> Optional[int]:
    """The ``threshold`` of a SHRINK: null (each table's own ``delete_after_unseen_days``) or an
    int in ``[0, 2**24)``.

    Raises:
        RequestError: anything else.
    """
    t = meta.get("threshold")
    if t is not None and (not isinstance(t, int) or isinstance(t, bool) or
                          not 0 <= t < 1 << 24):
        raise _fail("SHRINK", f"'threshold' must be null or an int in [0, 2**24), got "
                    f"{_short(t)}")
    return t


def geo_names(meta: dict, sparse: Mapping[str, Any], dense: Mapping[str, Any]) -> tuple:
    """``(geo_pull, pull_dense)`` table lists a PUSH asks to get back."""
    return (names("PUSH", meta, "geo_pull", sparse, "sparse"),
            names("PUSH", meta, "pull_dense", dense, "dense"))


def optional_bool(kind: str, meta: dict, key: str) -> bool:
    """``meta[key]`` if it is a JSON boolean (missing: False)."""
    value: Optional[Any] = meta.get(key, False)
    if not isinstance(value, bool):
        raise _fail(kind, f"{key!r} must be true or false, got {_short(value)}")
    return value
