"""Deterministic per-id initial rows: the value of row ``id`` depends only on ``(seed, id)``.

A counter-based generator: ``base = mix64(id ^ mix64(seed))``, element ``c`` draws
``u_c = mix64(base + (c + 1) * golden)``; its top 24 bits give a float32 in [0, 1) (uniform),
and pairs of them give normals through Box-Muller. No state, no order dependence: whichever
server creates a row, whenever, with any number of servers, it gets the same values. Readers
can regenerate any row from the spec alone (which also makes read-only pulls of unknown ids
return what the row would be).
"""
from __future__ import annotations

import numpy as np

from fleetx.ps.api import InitConfig
from fleetx.ps.kernels import mix64

__all__ = ["initial_rows", "sighting_draws"]

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_TOP24 = np.uint64(40)


def _uniform01(ids: np.ndarray, seed: int, ncols: int, open_low: bool = False) -> np.ndarray:
    base = mix64(np.ascontiguousarray(ids, np.int64).view(np.uint64)
                 ^ mix64(np.array([seed], np.uint64)))
    cols = (np.arange(1, ncols + 1, dtype=np.uint64) * _GOLD)[None, :]
    bits = (mix64(base[:, None] + cols) >> _TOP24).astype(np.float64)
    if open_low:  # (0, 1): log() below must not see 0
        bits += 0.5
    return bits * (1.0 / (1 << 24))


def initial_rows(ids: np.ndarray, dim: int, init: InitConfig) -> np.ndarray:
    """The initial ``(len(ids), dim)`` float32 rows of ``ids`` under ``init``.

    Example:
        >>> a = initial_rows(np.array([5, 9]), 4, InitConfig("uniform", seed=1))
        >>> b = initial_rows(np.array([9]), 4, InitConfig("uniform", seed=1))
        >>> bool((a[1] == b[0]).all())
        True
    """
    n = len(ids)
    if init.kind == "constant":
        return np.full((n, dim), init.value, np.float32)
    if init.kind == "uniform":
        u = _uniform01(ids, init.seed, dim)
        return (init.low + (init.high - init.low) * u).astype(np.float32)
    pairs = (dim + 1) // 2
    u = _uniform01(ids, init.seed, 2 * pairs, open_low=True)
    radius = np.sqrt(-2.0 * np.log(u[:, 0::2]))
    angle = 2.0 * np.pi * u[:, 1::2]
    z = np.empty((n, 2 * pairs))
    z[:, 0::2] = radius * np.cos(angle)
    z[:, 1::2] = radius * np.sin(angle)
    return (init.mean + init.std * z[:, :dim]).astype(np.float32)


_DRAW_SALT = np.uint64(0xA0761D6478BD642F)  # admission draws never repeat a row's init values


def sighting_draws(ids: np.ndarray, seed: int, sightings: np.ndarray) -> np.ndarray:
    """One uniform float64 in [0, 1) per id: the draw of its ``sightings``-th sighting, a pure
    function of ``(seed, id, sightings)`` (what :class:`~fleetx.ps.api.ProbabilityEntry`
    admits by).

    Example:
        >>> d = sighting_draws(np.array([5, 9]), 0, np.array([1, 1]))
        >>> bool((d == sighting_draws(np.array([9, 5]), 0, np.array([1, 1]))[::-1]).all())
        True
    """
    base = mix64(np.ascontiguousarray(ids, np.int64).view(np.uint64)
                 ^ mix64(np.array([seed], np.uint64) ^ _DRAW_SALT))
    k = np.asarray(sightings).astype(np.uint64)
    return (mix64(base + k * _GOLD) >> _TOP24).astype(np.float64) * (1.0 / (1 << 24))
