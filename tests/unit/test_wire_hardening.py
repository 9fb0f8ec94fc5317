"""Decoders fed by peers refuse what would make them allocate or index on a claimed length:
negative or overflowing lengths, lengths beyond the message, garbage (the heter tensors' shapes,
packed sample blocks, the reader processes' frames, fleet.util.all_to_all's length table)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from fleetx.data import DataError, Slot
from fleetx.data.block import SampleBlock
from fleetx.fleet.util import MAX_EXCHANGE_BYTES, check_exchange
from fleetx.ps.api import ProtocolError
from fleetx.ps_torch.heter import pack, unpack

SLOTS = (Slot("ids"), Slot("label", "int64", dense_width=1))


@pytest.mark.parametrize("shape", [[2 ** 32, 2 ** 32], [2 ** 62, 4], [2 ** 62 + 1, 4],
                                   [2 ** 70], [True, 4], [-1, -4], [4.0]])
def test_heter_shapes_that_overflow_or_lie_are_refused(shape):
    with pytest.raises(ProtocolError, match=r"input 0: (\d+ values of float32 do not make shape|"
                                            r"shape .* is not a list of at most 16 sizes >= 0)"):
        unpack([shape], [np.zeros(4, np.float32)], "input")


def test_heter_shapes_garbage_and_counts():
    shapes, bufs = pack([torch.ones(2, 2)], "input")
    for bad in (None, {}, "[[2, 2]]", [[2, 2], [1]], [[[2], 2]]):
        with pytest.raises(ProtocolError):
            unpack(bad, bufs, "input")
    assert unpack(shapes, bufs, "input")[0].shape == (2, 2)


def packed(n: int = 3) -> np.ndarray:
    values = {"ids": np.arange(n, dtype=np.int64), "label": np.zeros(n, np.int64)}
    lengths = {"ids": np.ones(n, np.int32)}
    return np.frombuffer(bytes(SampleBlock(SLOTS, n, values, lengths).pack()), np.uint8).copy()


def test_sample_blocks_with_bad_lengths_are_refused():
    good = packed()
    assert SampleBlock.unpack(SLOTS, good).size == 3
    words = good[:8 * (len(SLOTS) + 4)].view(np.int64)
    cases = []
    for index, value in ((2, -1), (2, 2 ** 62), (4, -8), (4, 2 ** 61), (5, 2 ** 62)):
        bad = good.copy()
        bad[:len(words) * 8].view(np.int64)[index] = value
        cases.append(bad)
    truncated = good[:-8]
    negative = good.copy()  # lengths -1 and 2 add up like 1 and 1, but offsets would fall
    lengths = negative[8 * len(words):8 * len(words) + 12].view(np.int32)
    lengths[:2] = [-1, 3]
    for bad in cases + [truncated, negative, good[:7], np.zeros(64, np.uint8)]:
        with pytest.raises(DataError):
            SampleBlock.unpack(SLOTS, bad, "worker 1")


def test_reader_frames_with_bad_lengths_are_refused():
    import tracemalloc
    from fleetx.data.reader_process import _frame_size, _read_exact
    for size in (-1, -2 ** 63, 2 ** 62):
        with pytest.raises(DataError, match=r"reading part-0: the reader process sent a "
                                            r"malformed frame \(payload of -?\d+ bytes\)"):
            _frame_size(size, "part-0")
    assert _frame_size(100, "part-0") == 100
    tracemalloc.start()
    try:  # 1 TiB announced, 10 bytes sent: the end of the stream, not a 1 TiB buffer
        assert _read_exact(io.BytesIO(b"x" * 10), 1 << 40) is None
        assert tracemalloc.get_traced_memory()[1] < 8 << 20
    finally:
        tracemalloc.stop()
    data = bytes(range(256)) * 20000  # 5 MB: grown in steps, whole
    assert bytes(_read_exact(io.BytesIO(data), len(data))) == data


def test_all_to_all_length_tables_are_checked():
    check_exchange([[1, 2], [3, 4]], 8, 100)
    with pytest.raises(ValueError, match=r"worker 1 announces -5 items for worker 0; a length "
                                         r"cannot be negative"):
        check_exchange([[1, 2], [-5, 4]], 8, 100)
    with pytest.raises(ValueError, match=r"worker 0 sends 2400 bytes in one exchange, more than "
                                         r"max_bytes=2000; exchange in several parts"):
        check_exchange([[100, 200], [0, 0]], 8, 2000)
    with pytest.raises(ValueError, match=r"worker 1 receives 2400 bytes in one exchange"):
        check_exchange([[0, 150], [0, 150]], 8, 2000)
    with pytest.raises(ValueError, match="sends"):  # no overflow: Python integers
        check_exchange([[2 ** 62, 2 ** 62], [0, 0]], 8, MAX_EXCHANGE_BYTES)
