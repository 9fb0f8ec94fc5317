"""Samples held in columns: per slot one flat array of values and, for sparse slots, one length
per sample. Shuffles, batches and the exchange between workers are array operations on these
columns, never a Python loop over samples.

A block packs into one flat byte buffer (:meth:`SampleBlock.pack`) for the exchange between
workers and between a reader process and the dataset: a header of int64 words, then each
slot's lengths (int32) and values, raw. No pickle.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

from fleetx.data.api import DataError, Slot

__all__ = ["SampleBlock", "schema_fingerprint"]

_MAGIC = 0x46584442  # "FXDB"
_NUMPY = {"int64": np.int64, "float32": np.float32}


def schema_fingerprint(slots: Sequence[Slot]) -> int:
    """A 62-bit number that differs when slot names, dtypes, widths or their order differ."""
    text = ";".join(f"{s.name}:{s.dtype}:{s.dense_width}" for s in slots).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 2


def _exclusive_cumsum(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


class SampleBlock:
    """``size`` samples of the slots ``slots``, column by column.

    Attributes:
        slots: the slot declarations, in order.
        size: the number of samples.
        values: slot name -> every sample's values, concatenated (int64 or float32, 1-D).
        lengths: slot name -> values per sample (int32), for sparse slots; dense slots have
            ``dense_width`` values per sample and no entry.
    """

    def __init__(self, slots: Sequence[Slot], size: int, values: dict,
                 lengths: dict) -> None:
        self.slots, self.size, self.values, self.lengths = tuple(slots), int(size), values, \
            lengths
        self._starts: dict = {}

    @classmethod
    def empty(cls, slots: Sequence[Slot]) -> "SampleBlock":
        return cls(slots, 0, {s.name: np.empty(0, _NUMPY[s.dtype]) for s in slots},
                   {s.name: np.empty(0, np.int32) for s in slots if not s.dense})

    def __len__(self) -> int:
        return self.size

    def starts(self, name: str) -> np.ndarray:
        """Where each sample's values start in ``values[name]``, plus the total at the end."""
        if name not in self._starts:
            slot = next(s for s in self.slots if s.name == name)
            if slot.dense:
                self._starts[name] = np.arange(self.size + 1, dtype=np.int64) * slot.dense_width
            else:
                self._starts[name] = _exclusive_cumsum(self.lengths[name])
        return self._starts[name]

    def slice(self, start: int, stop: int) -> "SampleBlock":
        """Samples ``start`` to ``stop`` (views of this block's arrays)."""
        start, stop = max(0, start), min(self.size, stop)
        values, lengths = {}, {}
        for s in self.slots:
            bounds = self.starts(s.name)
            values[s.name] = self.values[s.name][bounds[start]:bounds[max(start, stop)]]
            if not s.dense:
                lengths[s.name] = self.lengths[s.name][start:stop]
        return SampleBlock(self.slots, max(0, stop - start), values, lengths)

    def take(self, index: np.ndarray) -> "SampleBlock":
        """The samples at ``index``, in that order (a copy)."""
        index = np.asarray(index, np.int64)
        values, lengths = {}, {}
        for s in self.slots:
            if s.dense:
                values[s.name] = self.values[s.name].reshape(self.size, s.dense_width)[
                    index].reshape(-1)
                continue
            counts = self.lengths[s.name][index]
            first = self.starts(s.name)[index]
            # positions of the chosen samples' values: each run first[i] .. first[i]+counts[i]
            within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
                _exclusive_cumsum(counts)[:-1], counts)
            values[s.name] = self.values[s.name][np.repeat(first, counts) + within]
            lengths[s.name] = counts
        return SampleBlock(self.slots, len(index), values, lengths)

    @classmethod
    def concat(cls, slots: Sequence[Slot], blocks: Iterable["SampleBlock"]) -> "SampleBlock":
        """One block holding ``blocks``' samples in order."""
        blocks = [b for b in blocks if b.size]
        if not blocks:
            return cls.empty(slots)
        if len(blocks) == 1:
            return blocks[0]
        values = {s.name: np.concatenate([b.values[s.name] for b in blocks]) for s in slots}
        lengths = {s.name: np.concatenate([b.lengths[s.name] for b in blocks])
                   for s in slots if not s.dense}
        return cls(slots, sum(b.size for b in blocks), values, lengths)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.values.values()) + sum(
            a.nbytes for a in self.lengths.values())

    def pack(self) -> np.ndarray:
        """This block as one flat uint8 buffer (see the module docstring)."""
        header = [_MAGIC, schema_fingerprint(self.slots), self.size, len(self.slots)]
        header += [len(self.values[s.name]) for s in self.slots]
        parts = [np.asarray(header, np.int64).view(np.uint8)]
        for s in self.slots:
            if not s.dense:
                parts.append(_padded(self.lengths[s.name].view(np.uint8)))
            parts.append(_padded(self.values[s.name].view(np.uint8)))
        return np.concatenate(parts)

    @classmethod
    def unpack(cls, slots: Sequence[Slot], buffer: np.ndarray,
               source: Optional[str] = None) -> "SampleBlock":
        """The block :meth:`pack` wrote into ``buffer`` (views into it).

        Raises:
            DataError: the buffer is not a packed block of these slots (``source`` names where
                it came from).
        """
        buffer = np.asarray(buffer, np.uint8)
        where = f" from {source}" if source else ""
        words = len(slots) + 4
        if buffer.nbytes < 8 * words:
            raise DataError(f"a packed block{where} is too short ({buffer.nbytes} bytes)")
        header = buffer[:8 * words].view(np.int64)
        if header[0] != _MAGIC or header[3] != len(slots):
            raise DataError(f"not a packed block of {len(slots)} slots{where}")
        if header[1] != schema_fingerprint(slots):
            raise DataError(f"the block{where} was made with other slots (names, dtypes or "
                            f"widths differ from {[s.name for s in slots]})")
        size, at = int(header[2]), 8 * words
        if size < 0:
            raise DataError(f"a packed block{where} announces {size} samples")
        values, lengths = {}, {}
        for s, count in zip(slots, header[4:]):
            if not s.dense:
                lengths[s.name], at = _take(buffer, at, size, np.int32, where)
                if size and int(lengths[s.name].min()) < 0:  # offsets must never fall
                    raise DataError(f"a packed block{where} is inconsistent: slot {s.name!r} "
                                    f"has a sample of {int(lengths[s.name].min())} values")
            values[s.name], at = _take(buffer, at, int(count), _NUMPY[s.dtype], where)
            expected = size * s.dense_width if s.dense else int(lengths[s.name].sum())
            if expected != count:
                raise DataError(f"a packed block{where} is inconsistent: slot {s.name!r} holds "
                                f"{count} values, its lengths add up to {expected}")
        return cls(slots, size, values, lengths)


def _padded(raw: np.ndarray) -> np.ndarray:
    """``raw`` followed by zeros up to a multiple of 8 bytes (keeps every array aligned)."""
    pad = -raw.nbytes % 8
    return raw if not pad else np.concatenate([raw, np.zeros(pad, np.uint8)])


def _take(buffer: np.ndarray, at: int, count: int, dtype: type, where: str) -> tuple:
    size = count * np.dtype(dtype).itemsize
    end = at + size
    if count < 0 or end > buffer.nbytes:
        raise DataError(f"a packed block{where} is truncated")
    return buffer[at:end].view(dtype), end + (-size % 8)
