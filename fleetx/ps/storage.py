"""Row arrays that grow in place: the memory under a table's index, slab and per-row columns.

A :class:`RowArray` is a numpy array of ``capacity`` rows over an anonymous memory mapping.
Growing it remaps the pages (``mremap``): the rows already there are neither copied nor
touched, and pages past the rows in use are never touched either, so the operating system
backs only the rows a table holds. Doubling a plain numpy array instead copies every row and,
while it copies, holds both the old and the new array (three times the rows at the peak).

If the mapping cannot be remapped because a view of the array is still held somewhere (numpy
forbids moving memory under a live view), growth falls back to a new mapping and a copy of
the rows in use; nothing is ever left pointing at freed memory.

Example:
    >>> a = RowArray(4, np.float32)
    >>> a.reserve(10_000, used=0)
    >>> a.array.shape[0] >= 10_000
    True
"""
from __future__ import annotations

import mmap
from typing import Optional

import numpy as np

__all__ = ["RowArray"]

_PAGE = mmap.PAGESIZE
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def _bytes_for(rows: int, row_bytes: int) -> int:
    return max(_PAGE, -(-rows * row_bytes // _PAGE) * _PAGE)


def _huge_pages(m: mmap.mmap) -> None:
    """Ask for transparent huge pages, as numpy does for its large arrays: rows are read at
    random, and with 4 KiB pages most reads of a large table would also miss the TLB. A page
    is still only backed once touched (2 MiB at a time, so at most that much per array)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # a kernel without transparent huge pages
            pass


def _mapping(size: int) -> mmap.mmap:
    m = mmap.mmap(-1, size, flags=_FLAGS)
    _huge_pages(m)
    return m


class RowArray:
    """A ``(capacity, width)`` array (1-D when ``width`` is None) whose capacity grows in place.

    Args:
        width: values per row, or None for a 1-D array of scalars.
        dtype: the element type.
        rows: rows to reserve at once.

    Raises:
        MemoryError: the operating system refused the mapping.
    """

    def __init__(self, width: Optional[int], dtype, rows: int = 0) -> None:
        self.width, self.dtype = width, np.dtype(dtype)
        self.row_bytes = self.dtype.itemsize * (width or 1)
        self._map = _mapping(_bytes_for(rows, self.row_bytes))
        self.array = self._view()

    @property
    def capacity(self) -> int:
        """Rows that fit before the next growth."""
        return len(self.array)

    def nbytes(self, rows: int) -> int:
        """Bytes the first ``rows`` rows occupy (what the operating system backs)."""
        return rows * self.row_bytes

    def reserve(self, rows: int, used: int) -> None:
        """Room for ``rows`` rows; ``used``: rows holding data (kept, in place when possible).

        Grows at least by doubling, so that appending n rows one batch at a time remaps
        O(log n) times.
        """
        if rows <= self.capacity:
            return
        size = _bytes_for(max(rows, 2 * self.capacity), self.row_bytes)
        self.array = None  # drop our own view, or the mapping cannot move
        try:
            self._map.resize(size)
            _huge_pages(self._map)
        except (BufferError, OSError, ValueError):  # a view is alive elsewhere: copy instead
            old = self._view()
            new = _mapping(size)
            fresh = self._view(new)
            fresh[:used] = old[:used]
            del old, fresh
            self._map = new
        self.array = self._view()

    def release(self, rows: int) -> None:
        """Give the pages past the first ``rows`` rows back to the operating system (after
        rows were removed); they read as zeros when used again."""
        start = -(-rows * self.row_bytes // _PAGE) * _PAGE
        if start < len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED, start, len(self._map) - start)

    def _view(self, m: Optional[mmap.mmap] = None) -> np.ndarray:
        m = self._map if m is None else m
        flat = np.frombuffer(m, self.dtype, len(m) // self.dtype.itemsize)
        if self.width is None:
            return flat
        rows = len(flat) // self.width
        return flat[:rows * self.width].reshape(rows, self.width)
