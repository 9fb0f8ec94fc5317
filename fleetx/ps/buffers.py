"""Receive buffers that are used again once nothing holds them.

A worker step moves a few megabytes each way (a dense gradient, the dense weights back, a
batch's rows). Allocating a fresh array of that size for every message and dropping it after
costs more than the copy into it: the allocator hands the pages back to the operating system
and takes them again, one page fault per 4 KiB. A :class:`BufferPool` keeps a few large arrays
per size class and hands one out again only when its reference count shows that the pool alone
holds it: a message, a view of it, a tensor made from it (``torch.from_numpy``) or a table that
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
#: references to a pooled array that only the pool holds, as counted inside ``_free``: the
#: size class's list, the loop variable and ``sys.getrefcount``'s own argument
_ONLY_POOL = 3


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
        for block in held:
            if sys.getrefcount(block) <= _ONLY_POOL:
                return block
        return None
