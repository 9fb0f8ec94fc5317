"""The hot loops of a shard, in C when the extension is built and in numpy otherwise.

``_kernels.c`` and the numpy functions below compute the same results (tests run both); the C
versions exist because a per-id Python or multi-pass numpy loop caps a shard at a few million
ids/s (``docs/parameter_server.md`` has the numbers). Callers use the module-level functions,
which dispatch to the active backend.

Row layouts and the index format are described at the top of ``_kernels.c``.
"""
from __future__ import annotations

import logging
import warnings

import numpy as np

try:  # built by ``pip install -e .`` (setup.py); optional
    from fleetx.ps import _kernels as _c
    _C_MISSING = ""
except ImportError as e:  # pragma: no cover - depends on the build
    _c = None
    # Absent: Python reports "cannot import name '_kernels'"; present but broken: anything else.
    _C_MISSING = ("fleetx/ps/_kernels.c was not compiled when fleetx was installed"
                  if "cannot import name '_kernels'" in str(e) or isinstance(e, ModuleNotFoundError)
                  else f"the built extension does not load: {e}")

__all__ = ["backend", "set_backend", "describe", "log_backend", "mix64", "INDEX_SALT",
           "EMPTY", "index_find", "index_insert", "index_rebuild", "index_remove", "index_relink",
           "gather", "segment_sum", "apply_sgd", "apply_adagrad",
           "apply_adam", "apply_sum", "unique_inverse", "unique_first", "all_finite"]

# Measured with benchmarks/ps_table.py on one 10^6-row table: pulls ~8x, Adam pushes ~2.5-4x
# (docs/parameter_server.md §10).
SLOWDOWN = "2.5-8x slower"
FIX = ("install a C compiler and the Python headers (`bash scripts/setup.sh` does, or "
       "`apt-get install gcc python3-dev`) and reinstall fleetx (`pip install -e .`)")

INDEX_SALT = np.uint64(0x2545F4914F6CDD1D)
_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), \
    np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

_use_c = _c is not None


def backend() -> str:
    """``"c"`` or ``"numpy"``: which implementation the functions below run."""
    return "c" if _use_c else "numpy"


def describe() -> str:
    """The active backend in words, for logs and ``fleet.explain()``: ``"C kernels"``, or
    ``"numpy fallback (...)"`` with the reason and, when the extension is missing, the fix."""
    if _use_c:
        return "C kernels"
    if _c is not None:
        return "numpy fallback (chosen with kernels.set_backend('numpy'); C kernels are built)"
    return (f"numpy fallback ({SLOWDOWN} than the C kernels, which are not built: "
            f"{_C_MISSING}); to fix, {FIX}")


_warned = False


def log_backend(log: logging.Logger, who: str) -> None:
    """Log which backend ``who`` (a server, a worker) runs on; on the numpy fallback for want of
    the extension, also warn once per process (``logging`` and :mod:`warnings`).

    Args:
        log: the logger of the caller.
        who: names the process in the line, e.g. ``"server 0"``.
    """
    global _warned
    if _use_c or _c is not None:
        log.info("%s: parameter-server kernels: %s", who, describe())
        return
    log.warning("%s: parameter-server kernels: %s", who, describe())
    if not _warned:
        _warned = True
        warnings.warn(f"fleetx.ps runs on its numpy fallback, {SLOWDOWN} than its C kernels; "
                      f"to fix, {FIX}", RuntimeWarning, stacklevel=2)


def set_backend(name: str) -> None:
    """Select ``"c"`` (raises ImportError when the extension is not built) or ``"numpy"``."""
    global _use_c
    if name == "c" and _c is None:
        raise ImportError(f"fleetx.ps._kernels is not built ({_C_MISSING}); to fix, {FIX}")
    if name not in ("c", "numpy"):
        raise ValueError(f"backend {name!r}: expected 'c' or 'numpy'")
    _use_c = name == "c"


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 (wrapping arithmetic): a cheap, well-spread hash."""
    z = x + _GOLD
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


# ---------------------------------------------------------------------------- index
#
# Slots are uint32: (tag << rbits) | row with rbits the bit length of the slot count, all ones
# (EMPTY) for a free slot; row_keys[row] is the key of a row. A key's home slot is the high
# half of its hash times the slot count, over 2^32 (any slot count works); its tag is the low
# 32 - rbits bits of the hash, so that a probe reads a key only when the tags match.

EMPTY = np.uint32(0xFFFFFFFF)
MAX_SLOTS = 0x7FFFFFFF


class _Layout:
    """Where keys go in ``cap`` slots: home slots, tags, and the row field of a slot."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.rbits = int(cap).bit_length()
        self.rmask = np.uint32((1 << self.rbits) - 1)

    def hash(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(home slot (int64), tag in place (uint32))`` of every key."""
        h = mix64(keys.view(np.uint64) + INDEX_SALT)
        home = (((h >> np.uint64(32)) * np.uint64(self.cap)) >> np.uint64(32)).astype(np.int64)
        tag_bits = np.uint64((1 << (32 - self.rbits)) - 1)
        return home, ((h & tag_bits) << np.uint64(self.rbits)).astype(np.uint32)

    def row(self, s: np.ndarray) -> np.ndarray:
        return (s & self.rmask).astype(np.int64)


def _index_full(fn: str, cap: int) -> ValueError:
    return ValueError(f"{fn}: the index is full (all {cap} slots taken) and a key is absent; "
                      "grow the slots before inserting")


def _np_probe(slots, row_keys, keys, fn: str):
    """``(slot, row)`` of every key: the slot holding it (row >= 0) or the first empty slot on
    its probe path (row -1); one vectorised probe round per slot visited."""
    lay = _Layout(len(slots))
    home, tag = lay.hash(keys)
    slot, row = np.empty(len(keys), np.int64), np.empty(len(keys), np.int64)
    pending, pos = np.arange(len(keys)), home
    for _ in range(lay.cap):
        if not pending.size:
            break
        s = slots[pos]
        empty = s == EMPTY
        r = lay.row(s)
        cand = ~empty & ((s & ~lay.rmask) == tag[pending])
        if (r[cand] >= len(row_keys)).any():
            raise ValueError(f"{fn}: a slot names a row outside row_keys (a damaged index)")
        hit = cand.copy()
        hit[cand] = row_keys[r[cand]] == keys[pending[cand]]
        done = empty | hit
        slot[pending[done]], row[pending[done]] = pos[done], np.where(hit, r, -1)[done]
        pending, pos = pending[~done], pos[~done] + 1
        pos[pos == lay.cap] = 0
    if pending.size:
        raise _index_full(fn, lay.cap)
    return slot, row


def _np_place(slots, keys: np.ndarray, rows: np.ndarray) -> None:
    """Put new, distinct ``keys`` with their ``rows`` in free slots of their probe paths."""
    lay = _Layout(len(slots))
    home, tag = lay.hash(keys)
    values = tag | rows.astype(np.uint32)
    pending, pos = np.arange(len(keys)), home
    # A key moves on when its slot is taken and stays when it lost a free slot to another key,
    # which then holds it: each round either places a key or moves every other one on, so
    # len(keys) + capacity rounds place them all unless the index is full.
    for _ in range(len(keys) + lay.cap):
        if not pending.size:
            break
        free = slots[pos] == EMPTY
        cand, hs = pending[free], pos[free]
        _, win = np.unique(hs, return_index=True)  # one key per free slot per round
        slots[hs[win]] = values[cand[win]]
        placed = np.zeros(len(pending), bool)
        placed[np.flatnonzero(free)[win]] = True
        pending, pos = pending[~placed], pos[~placed]
        pos[~free[~placed]] += 1  # occupied slots: probe on; losers retry the same slot
        pos[pos == lay.cap] = 0
    if pending.size:
        raise _index_full("index_insert", lay.cap)


def _np_insert(slots, row_keys, keys, out, next_row: int) -> int:
    _, found = _np_probe(slots, row_keys[:next_row], keys, "index_insert")
    out[:len(keys)] = found
    miss = np.flatnonzero(found < 0)
    if not len(miss):
        return next_row
    uniq, first, inv = np.unique(keys[miss], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # rows in first-occurrence order, as in C
    new_keys = uniq[order]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    rows = next_row + np.arange(len(new_keys), dtype=np.int64)
    out[miss] = rows[rank[inv]]
    row_keys[rows] = new_keys
    _np_place(slots, new_keys, rows)
    return next_row + len(new_keys)


def _np_remove(slots, row_keys, keys) -> int:
    lay = _Layout(len(slots))
    removed = 0
    for k in keys:  # backward-shift deletion, one key at a time (each shift moves others)
        slot, row = _np_probe(slots, row_keys, k.reshape(1), "index_remove")
        if row[0] < 0:
            continue
        hole = i = int(slot[0])
        while True:
            i = 0 if i + 1 == lay.cap else i + 1
            s = slots[i]
            if s == EMPTY:
                break
            home, _ = lay.hash(row_keys[lay.row(s)].reshape(1))
            h = int(home[0])
            stays = (hole < h <= i) if hole < i else (h > hole or h <= i)
            if not stays:
                slots[hole], hole = s, i
        slots[hole] = EMPTY
        removed += 1
    return removed


def _check_index(fn: str, slots: np.ndarray, row_keys: np.ndarray, *keys: np.ndarray) -> None:
    """The preconditions both backends need (checked before anything is read or written)."""
    if not isinstance(slots, np.ndarray) or slots.dtype != np.uint32 or slots.ndim != 1 \
            or not slots.flags.c_contiguous:
        raise TypeError(f"{fn}: slots must be a contiguous 1-D uint32 array; got "
                        f"{getattr(slots, 'dtype', type(slots).__name__)} of shape "
                        f"{getattr(slots, 'shape', '?')}")
    for name, a in (("row_keys", row_keys),) + tuple(zip(("keys", "out"), keys)):
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1 \
                or not a.flags.c_contiguous:
            raise TypeError(f"{fn}: {name} must be a contiguous 1-D int64 array; got "
                            f"{getattr(a, 'dtype', type(a).__name__)} of shape "
                            f"{getattr(a, 'shape', '?')}")
    if not 1 <= len(slots) <= MAX_SLOTS:
        raise ValueError(f"{fn}: slots must hold 1 to {MAX_SLOTS} uint32 entries; got "
                         f"{len(slots)}")
    if len(keys) == 2 and len(keys[1]) < len(keys[0]):
        raise ValueError(f"{fn}: out holds {len(keys[1])} rows, fewer than the {len(keys[0])} "
                         "keys")


def index_find(slots: np.ndarray, row_keys: np.ndarray, keys: np.ndarray,
               out: np.ndarray) -> int:
    """Rows of ``keys`` into ``out`` (-1 where missing); returns how many are missing.

    Raises:
        TypeError: ``slots`` is not a contiguous 1-D uint32 array, or another argument not a
            contiguous 1-D int64 array.
        ValueError: no slots, ``out`` shorter than ``keys``, a full index lacking a key, or a
            slot naming a row outside ``row_keys``.
    """
    _check_index("index_find", slots, row_keys, keys, out)
    if _use_c:
        return _c.index_find(slots, row_keys, keys, out)
    out[:len(keys)] = _np_probe(slots, row_keys, keys, "index_find")[1]
    return int(np.count_nonzero(out[:len(keys)] < 0))


def index_insert(slots, row_keys, keys, out, next_row: int) -> int:
    """Rows of ``keys`` into ``out``, giving missing keys new rows from ``next_row`` on in order
    of first occurrence (``row_keys[row] = key``); returns the next free row. Rows from
    ``next_row`` on are free: no slot may name them.

    Raises:
        TypeError, ValueError: as :func:`index_find`; also when ``row_keys`` or the slots lack
            room for every key to be new (one slot always stays free; nothing is written then).
    """
    _check_index("index_insert", slots, row_keys, keys, out)
    if next_row < 0 or next_row + len(keys) > len(row_keys) or \
            next_row + len(keys) >= len(slots):
        raise ValueError(f"index_insert: not enough room for {len(keys)} keys from row {next_row} "
                         f"(row_keys holds {len(row_keys)}, the slots {len(slots)})")
    if _use_c:
        return _c.index_insert(slots, row_keys, keys, out, next_row)
    return _np_insert(slots, row_keys, keys, out, next_row)


def index_rebuild(slots: np.ndarray, row_keys: np.ndarray, n: int) -> None:
    """Index rows ``0 .. n-1`` (distinct keys ``row_keys[:n]``) in ``slots``, all free.

    Raises:
        TypeError, ValueError: as :func:`index_find`; ``n`` rows do not fit.
    """
    _check_index("index_rebuild", slots, row_keys)
    if not 0 <= n <= len(row_keys) or n >= len(slots):
        raise ValueError(f"index_rebuild: {n} rows do not fit (row_keys holds {len(row_keys)}, "
                         f"the slots {len(slots)})")
    if _use_c:
        return _c.index_rebuild(slots, row_keys, n)
    _np_place(slots, row_keys[:n], np.arange(n, dtype=np.int64))


def index_remove(slots: np.ndarray, row_keys: np.ndarray, keys: np.ndarray) -> int:
    """Remove ``keys`` (distinct; absent ones are skipped) from the slots by backward-shift
    deletion (no tombstones); ``row_keys`` is only read. Returns how many were removed.

    Raises:
        TypeError, ValueError: as :func:`index_find`.
    """
    _check_index("index_remove", slots, row_keys, keys)
    if _use_c:
        return _c.index_remove(slots, row_keys, keys)
    return _np_remove(slots, row_keys, keys)


def index_relink(slots: np.ndarray, row_keys: np.ndarray, keys: np.ndarray,
                 rows: np.ndarray) -> None:
    """Make the slot of each ``keys[j]`` name ``rows[j]`` (after the caller moved rows;
    ``row_keys`` still holds each key at its old row).

    Raises:
        TypeError, ValueError: as :func:`index_find`; rows outside ``row_keys``.
        KeyError: a key is not in the index.
    """
    _check_index("index_relink", slots, row_keys, keys, rows)
    if len(rows) != len(keys) or (len(rows) and (rows.min() < 0 or rows.max() >= len(row_keys))):
        raise ValueError("index_relink: rows must be one per key and inside row_keys")
    if _use_c:
        return _c.index_relink(slots, row_keys, keys, rows)
    slot, row = _np_probe(slots, row_keys, keys, "index_relink")
    if (row < 0).any():
        raise KeyError("index_relink: a key is not in the index")
    lay = _Layout(len(slots))
    slots[slot] = (slots[slot] & ~lay.rmask) | rows.astype(np.uint32)


# ---------------------------------------------------------------------------- rows


def gather(slab: np.ndarray, rows: np.ndarray, ncols: int) -> np.ndarray:
    """``slab[rows, :ncols]`` as a new contiguous array."""
    if _use_c:
        out = np.empty((len(rows), ncols), np.float32)
        _c.gather(slab, slab.shape[1], rows, out, ncols)
        return out
    return np.ascontiguousarray(slab[rows, :ncols])


def segment_sum(inverse: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Rows of ``values`` summed by ``inverse`` into ``n`` rows (the dedup of gradients)."""
    dim = values.shape[1]
    out = np.zeros((n, dim), np.float32)
    if _use_c:
        _c.segment_sum(out, inverse, np.ascontiguousarray(values, np.float32), dim)
    else:
        np.add.at(out, inverse, values)
    return out


def unique_inverse(ids: np.ndarray):
    """``(unique ids, inverse)`` with ``ids == unique[inverse]``, the unique ids sorted (as
    ``np.unique``). The C backend de-duplicates with a hash table and sorts only the unique
    ids, not every id."""
    uniq, inverse = unique_first(ids)
    if not _use_c:  # np.unique sorted them already
        return uniq, inverse
    order = np.argsort(uniq)
    rank = np.empty(len(uniq), np.int64)
    rank[order] = np.arange(len(uniq))
    return uniq[order], rank[inverse]


def unique_first(ids: np.ndarray):
    """``(unique ids, inverse)`` with ``ids == unique[inverse]`` (flattened), in an order that
    suits the backend: first occurrence in C (one hash pass, no sort), sorted in numpy."""
    flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
    if not _use_c:
        uniq, inverse = np.unique(flat, return_inverse=True)
        return uniq, inverse.reshape(-1)
    uniq, inverse = np.empty(len(flat), np.int64), np.empty(len(flat), np.int64)
    count = _c.unique_first(flat, uniq, inverse)
    return uniq[:count], inverse


def all_finite(values: np.ndarray) -> bool:
    """True when no value of the float32 array is NaN or infinite (one pass, no temporary in
    C)."""
    if _use_c and values.dtype == np.float32 and values.flags.c_contiguous:
        return _c.all_finite(values)
    return bool(np.isfinite(values).all())


def _np_rule(slab, rows, fn):
    block = slab[rows]
    fn(block)
    slab[rows] = block


def apply_sgd(slab, rows, grads, dim, lr, weight_decay=0.0, momentum=0.0, nesterov=False):
    """SGD on the rows (torch.optim.SGD with dampening 0; the buffer starts at zero)."""
    if _use_c:
        return _c.apply_sgd(slab, slab.shape[1], rows, grads, dim, lr, weight_decay, momentum,
                            nesterov)
    f32 = np.float32

    def fn(b):
        w, d = b[:, :dim], grads.astype(f32, copy=True)
        if weight_decay:
            d += f32(weight_decay) * w
        if momentum > 0:
            buf = b[:, dim:2 * dim]
            buf *= f32(momentum)
            buf += d
            d = d + f32(momentum) * buf if nesterov else buf
        w -= f32(lr) * d
    _np_rule(slab, rows, fn)


def apply_adagrad(slab, rows, grads, dim, lr, weight_decay=0.0, eps=1e-10):
    """Adagrad on the rows (torch.optim.Adagrad with lr_decay 0)."""
    if _use_c:
        return _c.apply_adagrad(slab, slab.shape[1], rows, grads, dim, lr, weight_decay, eps)
    f32 = np.float32

    def fn(b):
        w, s, d = b[:, :dim], b[:, dim:2 * dim], grads.astype(f32, copy=True)
        if weight_decay:
            d += f32(weight_decay) * w
        s += d * d
        w -= f32(lr) * d / (np.sqrt(s) + f32(eps))
    _np_rule(slab, rows, fn)


def apply_adam(slab, rows, grads, dim, lr, beta1, beta2, eps, weight_decay=0.0,
               decoupled=False):
    """Adam (or AdamW) on the rows, with a step counter per row for the bias correction."""
    if _use_c:
        return _c.apply_adam(slab, slab.shape[1], rows, grads, dim, lr, beta1, beta2, eps,
                             weight_decay, decoupled)
    f32 = np.float32

    def fn(b):
        w, m, v = b[:, :dim], b[:, dim:2 * dim], b[:, 2 * dim:3 * dim]
        step = b[:, 3 * dim:3 * dim + 1]
        d = grads.astype(f32, copy=True)
        if weight_decay:
            if decoupled:
                w *= f32(1.0 - lr * weight_decay)
            else:
                d += f32(weight_decay) * w
        step += f32(1)
        s64 = step.astype(np.float64)
        step_size = (lr / (1.0 - beta1 ** s64)).astype(f32)
        bc2_sqrt = np.sqrt(1.0 - beta2 ** s64).astype(f32)
        m += f32(1.0 - beta1) * (d - m)
        v *= f32(beta2)
        v += f32(1.0 - beta2) * d * d
        w -= step_size * m / (np.sqrt(v) / bc2_sqrt + f32(eps))
    _np_rule(slab, rows, fn)


def apply_sum(slab, rows, grads, dim):
    """``w += delta`` on the rows (GEO)."""
    if _use_c:
        return _c.apply_sum(slab, slab.shape[1], rows, grads, dim)
    _np_rule(slab, rows, lambda b: b[:, :dim].__iadd__(grads))
