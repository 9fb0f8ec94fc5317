"""Receive buffers that are used again once nothing holds them.

A worker step moves a few megabytes each way (a dense gradient, the dense weights back, a
batch's rows). Allocating a fresh array of that size for every message and dropping it after
costs more than the copy into it: the allocator hands the pages back to the operating system
and takes them again, one page fault per 4 KiB. A :class:`BufferPool` keeps a few large arrays
per size class and hands one out again only when its reference count shows that the pool alone
holds it (that count, which depends on the interpreter, is measured once at import on a fresh
block): a message, a view of it, a tensor made from it (``torch.from_numpy``) or a table that
kept its ids all hold a reference, so a buffer still in use is never written into. Arrays below
``min_bytes`` are allocated as usual.

Example:
    >>> pool = BufferPool(min_bytes=1024)
    >>> a = pool.take(np.dtype(np.float32), 4096)
    >>> b = pool.take(np.dtype(np.float32), 4096)    # a is still held: another array
    >>> np.shares_memory(a, b)
    False
    >>> where = a.ctypes.data
    >>> del a                                          # free again: its memory comes back
    >>> pool.take(np.dtype(np.float32), 4096).ctypes.data == where
    True
"""
from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["BufferPool"]

_ALIGN = 64


def _refs(held: list, i: int) -> int:
    """The reference count of ``held[i]``, counted always here, the same way: what the count
    of a block only the pool holds is depends on the interpreter (its version counts the
    argument and temporaries differently), so it is measured, not assumed."""
    return sys.getrefcount(held[i])


def _measure_baseline():
    """The count :func:`_refs` gives a pooled block nothing else holds, measured on a fresh
    one; None when the counts cannot tell a held block from a free one (then nothing is
    handed out again)."""
    held = [np.empty(_ALIGN, np.uint8)]
    alone = _refs(held, 0)
    other = held[0]
    seen = _refs(held, 0)
    view = other[1:]
    del other
    seen_view = _refs(held, 0)
    del view
    tells = seen > alone and seen_view > alone and _refs(held, 0) == alone
    return alone if tells else None


#: the count of a pooled block that only the pool holds (measured once, at import)
_ONLY_POOL = _measure_baseline()


class BufferPool:
    """Large arrays handed out again once free (thread-safe).

    Args:
        min_bytes: smaller arrays are plain ``np.empty``.
        max_bytes: so are larger ones (a rare huge message must not stay allocated).
        keep: arrays kept per size class (size classes are powers of two); beyond that, new
            arrays are not kept.
    """

    def __init__(self, min_bytes: int = 1 << 16, max_bytes: int = 1 << 24,
                 keep: int = 4) -> None:
        self.min_bytes, self.max_bytes, self.keep = min_bytes, max_bytes, keep
        self._classes: dict[int, list] = {}
        self._lock = threading.Lock()

    def take(self, dtype: np.dtype, nbytes: int) -> np.ndarray:
        """A writable, contiguous 1-D array of ``nbytes // dtype.itemsize`` elements starting
        on a 64-byte boundary (its contents are whatever was there)."""
        dtype = np.dtype(dtype)
        if not self.min_bytes <= nbytes <= self.max_bytes:
            return np.empty(nbytes // dtype.itemsize, dtype)
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            held = self._classes.setdefault(size, [])
            block = self._free(held)
            if block is None:
                block = np.empty(size + _ALIGN, np.uint8)  # owns its memory: views count on it
                if len(held) < self.keep:
                    held.append(block)
        start = -block.ctypes.data % _ALIGN  # a cache line: what vector loads and BLAS like
        return block[start:start + nbytes].view(dtype)

    @staticmethod
    def _free(held: list):
        if _ONLY_POOL is None:
            return None
        for i in range(len(held)):
            if _refs(held, i) <= _ONLY_POOL:
                return held[i]
        return None
