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
           "index_find", "index_insert", "gather", "segment_sum", "apply_sgd", "apply_adagrad",
           "apply_adam", "apply_sum", "unique_inverse"]

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


def _slot_of(keys: np.ndarray, mask: int) -> np.ndarray:
    return (mix64(keys.view(np.uint64) + INDEX_SALT) & np.uint64(mask)).astype(np.int64)


def _index_full(fn: str, cap: int) -> ValueError:
    return ValueError(f"{fn}: the index is full (all {cap} slots taken) and a key is absent; "
                      "grow the slots before inserting")


def _np_find(slots: np.ndarray, keys: np.ndarray, out: np.ndarray, fn: str = "index_find") -> int:
    pairs = slots.reshape(-1, 2)
    mask = len(pairs) - 1
    pending = np.arange(len(keys))
    h = _slot_of(keys, mask)
    for _ in range(len(pairs)):  # one vectorised probe round each; a key visits every slot
        if not pending.size:
            break
        k, r = pairs[h, 0], pairs[h, 1]
        empty = r < 0
        hit = ~empty & (k == keys[pending])
        out[pending[empty]] = -1
        out[pending[hit]] = r[hit]
        cont = ~(empty | hit)
        pending, h = pending[cont], (h[cont] + 1) & mask
    if pending.size:
        raise _index_full(fn, len(pairs))
    return int(np.count_nonzero(out[:len(keys)] < 0))


def _np_insert(slots, row_keys, keys, out, next_row: int) -> int:
    if _np_find(slots, keys, out, "index_insert") == 0:
        return next_row
    pairs = slots.reshape(-1, 2)
    mask = len(pairs) - 1
    miss = np.flatnonzero(out[:len(keys)] < 0)
    uniq, first, inv = np.unique(keys[miss], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # rows in first-occurrence order, as in C
    new_keys = uniq[order]
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    rows = next_row + np.arange(len(new_keys), dtype=np.int64)
    out[miss] = rows[rank[inv]]
    row_keys[rows] = new_keys
    pending, h = np.arange(len(new_keys)), _slot_of(new_keys, mask)
    # A key moves on when its slot is taken and stays when it lost a free slot to another key,
    # which then holds it: each round either places a key or moves every other one on, so
    # len(new_keys) + capacity rounds place them all unless the table is full.
    for _ in range(len(new_keys) + len(pairs)):
        if not pending.size:
            break
        free = pairs[h, 1] < 0
        cand, hs = pending[free], h[free]
        _, win = np.unique(hs, return_index=True)  # one key per free slot per round
        pairs[hs[win], 0] = new_keys[cand[win]]
        pairs[hs[win], 1] = rows[cand[win]]
        placed = np.zeros(len(pending), bool)
        placed[np.flatnonzero(free)[win]] = True
        pending, h = pending[~placed], h[~placed]
        h[~free[~placed]] += 1  # occupied slots: probe on; losers retry the same slot
        h &= mask
    if pending.size:
        raise _index_full("index_insert", len(pairs))
    return next_row + len(new_keys)


def _check_index(fn: str, slots: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    """The preconditions both backends need (an empty ``slots`` crashed the C probe)."""
    for name, a in (("slots", slots), ("keys", keys), ("out", out)):
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1 \
                or not a.flags.c_contiguous:
            raise TypeError(f"{fn}: {name} must be a contiguous 1-D int64 array; got "
                            f"{getattr(a, 'dtype', type(a).__name__)} of shape "
                            f"{getattr(a, 'shape', '?')}")
    cap = len(slots) // 2
    if len(slots) < 2 or len(slots) % 2 or cap & (cap - 1):
        raise ValueError(f"{fn}: slots must hold 2 * capacity int64 entries with the capacity a "
                         f"power of two >= 1; got {len(slots)} entries")
    if len(out) < len(keys):
        raise ValueError(f"{fn}: out holds {len(out)} rows, fewer than the {len(keys)} keys")


def index_find(slots: np.ndarray, keys: np.ndarray, out: np.ndarray) -> int:
    """Rows of ``keys`` into ``out`` (-1 where missing); returns how many are missing.

    Raises:
        TypeError: an argument is not a contiguous 1-D int64 array.
        ValueError: ``slots`` is not 2 * a power of two long, ``out`` is shorter than ``keys``,
            or the index is full and a key is absent.
    """
    _check_index("index_find", slots, keys, out)
    return _c.index_find(slots, keys, out) if _use_c else _np_find(slots, keys, out)


def index_insert(slots, row_keys, keys, out, next_row: int) -> int:
    """Rows of ``keys`` into ``out``, giving missing keys new rows from ``next_row`` on in order
    of first occurrence (``row_keys[row] = key``); returns the next free row.

    Raises:
        TypeError, ValueError: as :func:`index_find`; also when ``row_keys`` or the slots lack
            room for every key to be new (nothing is written then).
    """
    _check_index("index_insert", slots, keys, out)
    room = min(len(row_keys), len(slots) // 2)
    if next_row < 0 or next_row + len(keys) > room:
        raise ValueError(f"index_insert: not enough room for {len(keys)} keys from row {next_row} "
                         f"(row_keys holds {len(row_keys)}, the slots {len(slots) // 2})")
    if _use_c:
        return _c.index_insert(slots, row_keys, keys, out, next_row)
    return _np_insert(slots, row_keys, keys, out, next_row)


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
    """``(unique ids, inverse)`` with ``ids == unique[inverse]``."""
    flat = np.ascontiguousarray(ids, np.int64).reshape(-1)
    return np.unique(flat, return_inverse=True)


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
