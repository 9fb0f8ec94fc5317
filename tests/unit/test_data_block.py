"""Samples in columns: take, slice, concat, and the packed buffer the exchange sends."""
from __future__ import annotations

import numpy as np
import pytest

from fleetx.data import DataError, Slot
from fleetx.data.block import SampleBlock, schema_fingerprint

SLOTS = (Slot("ids"), Slot("dense", "float32", dense_width=2), Slot("w", "float32"))


def block_of(samples) -> SampleBlock:
    """A block from a list of (ids list, dense pair, weights list)."""
    values = {"ids": np.array([v for s in samples for v in s[0]], np.int64),
              "dense": np.array([v for s in samples for v in s[1]], np.float32),
              "w": np.array([v for s in samples for v in s[2]], np.float32)}
    lengths = {"ids": np.array([len(s[0]) for s in samples], np.int32),
               "w": np.array([len(s[2]) for s in samples], np.int32)}
    return SampleBlock(SLOTS, len(samples), values, lengths)


def rows(block: SampleBlock) -> list:
    out = []
    for i in range(block.size):
        one = block.slice(i, i + 1)
        out.append((one.values["ids"].tolist(), one.values["dense"].tolist(),
                    one.values["w"].tolist()))
    return out


SAMPLES = [([1, 2, 3], [0.5, 1.5], [1.0]), ([4], [2.5, 3.5], [2.0, 3.0]),
           ([5, 6], [4.5, 5.5], [4.0]), ([7], [6.5, 7.5], [5.0, 6.0, 7.0])]


def test_take_slice_concat():
    block = block_of(SAMPLES)
    assert rows(block) == SAMPLES
    assert rows(block.take(np.array([3, 0, 0, 2]))) == [SAMPLES[3], SAMPLES[0], SAMPLES[0],
                                                        SAMPLES[2]]
    assert rows(block.slice(1, 3)) == SAMPLES[1:3]
    assert rows(SampleBlock.concat(SLOTS, [block.slice(2, 4), SampleBlock.empty(SLOTS),
                                           block.slice(0, 2)])) == SAMPLES[2:] + SAMPLES[:2]
    assert block.take(np.array([], np.int64)).size == 0


def test_pack_round_trip_without_pickle():
    block = block_of(SAMPLES).take(np.array([2, 1]))
    buffer = block.pack()
    assert buffer.dtype == np.uint8 and buffer.nbytes % 8 == 0
    back = SampleBlock.unpack(SLOTS, buffer)
    assert rows(back) == [SAMPLES[2], SAMPLES[1]]
    assert rows(SampleBlock.unpack(SLOTS, SampleBlock.empty(SLOTS).pack())) == []


def test_unpack_refuses_other_slots_and_damage():
    buffer = block_of(SAMPLES).pack()
    other = (Slot("ids"), Slot("dense", "float32", dense_width=3), Slot("w", "float32"))
    assert schema_fingerprint(other) != schema_fingerprint(SLOTS)
    with pytest.raises(DataError, match=r"the block from worker 1 was made with other slots "
                                        r"\(names, dtypes or widths differ from \['ids', "
                                        r"'dense', 'w'\]\)"):
        SampleBlock.unpack(other, buffer, "worker 1")
    with pytest.raises(DataError, match="a packed block from w is truncated"):
        SampleBlock.unpack(SLOTS, buffer[:-16], "w")
    with pytest.raises(DataError, match="not a packed block of 3 slots"):
        SampleBlock.unpack(SLOTS, np.zeros(100, np.uint8))
    with pytest.raises(DataError, match="too short"):
        SampleBlock.unpack(SLOTS, np.zeros(8, np.uint8))
    damaged = buffer.copy()
    damaged[8 * 7:8 * 7 + 4] = 0  # the first sample's length of 'ids'
    with pytest.raises(DataError, match="inconsistent: slot 'ids' holds 7 values, its lengths add up "
                                        "to 4"):
        SampleBlock.unpack(SLOTS, damaged)
