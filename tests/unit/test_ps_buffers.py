"""BufferPool: large receive buffers reused only when nothing else holds them."""
import threading

import numpy as np
import pytest

from fleetx.ps import buffers
from fleetx.ps.buffers import BufferPool

F32 = np.dtype(np.float32)


def test_a_held_buffer_is_never_handed_out_again():
    pool = BufferPool(min_bytes=1024)
    a = pool.take(F32, 4000)
    view = a[10:20]
    del a
    b = pool.take(F32, 4000)
    assert not np.shares_memory(b, view)  # a view still holds the first buffer
    where = b.ctypes.data
    del view, b
    c = pool.take(F32, 4000)
    assert c.shape == (1000,) and c.dtype == F32 and c.flags.writeable
    assert c.flags.c_contiguous and c.ctypes.data % 64 == 0
    d = pool.take(F32, 4000)
    assert where in (c.ctypes.data, d.ctypes.data) and not np.shares_memory(c, d)


def test_sizes_share_a_power_of_two_class_and_small_or_huge_ones_are_not_kept():
    pool = BufferPool(min_bytes=1024, max_bytes=1 << 16)
    a = pool.take(np.dtype(np.int64), 3000)
    where = a.ctypes.data
    del a
    b = pool.take(F32, 4000)  # same class (4096 bytes): the same memory, another dtype
    assert b.ctypes.data == where and b.dtype == F32 and b.size == 1000
    small, huge = pool.take(F32, 512), pool.take(F32, 1 << 17)
    assert small.size == 128 and huge.size == 1 << 15
    assert pool._classes.keys() == {4096}  # neither small nor huge ones are kept


def test_only_keep_arrays_per_class_are_kept():
    pool = BufferPool(min_bytes=1024, keep=2)
    held = [pool.take(F32, 2048) for _ in range(5)]
    assert len({h.ctypes.data for h in held}) == 5 and len(pool._classes[2048]) == 2


def test_threads_never_get_the_same_buffer():
    pool = BufferPool(min_bytes=1024, keep=8)
    got, lock = [], threading.Lock()

    def take():
        for _ in range(200):
            a = pool.take(F32, 8192)
            a[:] = threading.get_ident() % 1000
            with lock:
                got.append(a)  # held: must never be handed out again
    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({a.ctypes.data for a in got}) == len(got)


def test_the_baseline_is_measured_and_tells_a_held_block_from_a_free_one():
    """The count of a block only the pool holds is measured at import (it depends on the
    interpreter); a block held elsewhere, whole or through a view, counts above it."""
    assert buffers._ONLY_POOL is not None
    held = [np.empty(64, np.uint8)]
    assert buffers._refs(held, 0) == buffers._ONLY_POOL
    other = held[0]
    assert buffers._refs(held, 0) > buffers._ONLY_POOL
    view = other[8:]
    del other
    assert buffers._refs(held, 0) > buffers._ONLY_POOL
    assert BufferPool._free(held) is None  # held through the view: not handed out
    del view
    assert BufferPool._free(held) is held[0]


def test_without_a_usable_baseline_nothing_is_handed_out_again(monkeypatch):
    monkeypatch.setattr(buffers, "_ONLY_POOL", None)
    pool = BufferPool(min_bytes=1024)
    a = pool.take(F32, 4000)
    where = a.ctypes.data
    del a
    b = pool.take(F32, 4000)
    assert b.ctypes.data != where and not np.shares_memory(b, pool._classes[4096][0])
