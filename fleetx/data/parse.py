"""Parsing the slot text format into a :class:`~fleetx.data.block.SampleBlock`, vectorised.

One line is one sample: for each declared slot, in order, ``<count> v1 ... v<count>``, tokens
separated by whitespace. Blank lines are skipped (they are not samples).

Two implementations give the same samples (a unit test compares them, and the plain
line-by-line definition below, on random and malformed data):

* ``_slots.c`` (built by ``pip install -e .``): two passes in C without the GIL, structure then
  numbers straight into one array per slot; so parallel reader threads really run in parallel.
* numpy, when the extension is not built: a chunk of lines takes a handful of numpy calls
  whatever its size. Numbers are read by numpy's C text parser (``np.fromstring(..., sep=" ")``)
  over long runs of tokens; the structure (where each slot's count sits on each line) is walked
  one slot at a time for all lines at once. When no slot is float32 the whole chunk is read as
  integers in one call; otherwise the tokens are split once and each slot's tokens are gathered
  and read per dtype. On mixed int/float data this is no faster than a plain Python loop
  (``benchmarks/dataset.py`` measures both), which is why the C parser exists.

Where a chunk holds a malformed line (a count that does not fit the line, a token that is no
number, an integer outside 64 bits) :func:`parse_line`, the plain definition of the format, says
what is wrong; the line is then skipped and counted, or named in a :class:`BadLineError`.

Integers are read as the reference reads feasigns, unsigned 64-bit; those above 2**63 - 1 keep
their bits as negative int64 (``18446744073709551615`` is ``-1``). Negative integers are read as
themselves.
"""
from __future__ import annotations

import re
import warnings
from itertools import repeat
from typing import Optional, Sequence

import numpy as np

from fleetx.data.api import BadLineError, Slot
from fleetx.data.block import SampleBlock

__all__ = ["parse_lines", "parse_line", "parse_line_by_line", "backend", "set_backend"]

try:  # built by ``pip install -e .`` (setup.py); optional
    from fleetx.data import _slots as _c
except ImportError:  # pragma: no cover - depends on the build
    _c = None
_use_c = _c is not None

_U64_MAX = np.iinfo(np.uint64).max
_I64 = np.iinfo(np.int64)
_INT_TOKEN = re.compile(rb"[+-]?[0-9]+")
_LONE_SIGN = re.compile(rb"[+-](?![0-9])")
_IRREGULAR = (b"  ", b" \n", b"\n ", b"\t", b"\r", b"\x0b", b"\x0c")


class _Malformed(Exception):
    """Something in the chunk is off: let the line-by-line parser say what and where."""


def parse_lines(data: bytes, slots: Sequence[Slot], file: str, first_line: int = 1,
                skip_bad_lines: bool = False, parser: Optional[str] = None) -> tuple:
    """Parse whole lines of slot text.

    Args:
        data: one or more lines (the last may lack its newline).
        slots: the declared slots, in the order the lines hold them.
        file: named in errors (the file whose pipe output this is).
        first_line: the number of ``data``'s first line in that output (from 1).
        skip_bad_lines: skip malformed lines (and count them) instead of raising.
        parser: ``"c"`` or ``"numpy"``; None: :func:`backend`'s.

    Returns:
        ``(block, skipped)``: the samples, and how many malformed lines were skipped.

    Raises:
        BadLineError: a malformed line, naming the file, the line number and what is wrong.
    """
    if not data.endswith(b"\n"):
        data += b"\n"
    if _c_chosen(parser):
        return _parse_c(data, tuple(slots), file, first_line, skip_bad_lines)
    lines = data.split(b"\n")[:-1]
    try:
        return _vectorised(data, lines, tuple(slots)), 0
    except _Malformed:
        return parse_line_by_line(lines, slots, file, first_line, skip_bad_lines)


def _c_chosen(parser: Optional[str]) -> bool:
    if parser is None:
        return _use_c
    _check_backend(parser)
    return parser == "c"


def _check_backend(name: str) -> None:
    if name not in ("c", "numpy"):
        raise ValueError(f"parser backend must be 'c' or 'numpy', got {name!r}")
    if name == "c" and _c is None:
        raise ValueError("the C slot parser (fleetx/data/_slots.c) is not built; reinstall "
                         "fleetx with a C compiler (pip install -e .)")


def backend() -> str:
    """``"c"`` or ``"numpy"``: which parser :func:`parse_lines` runs."""
    return "c" if _use_c else "numpy"


def set_backend(name: str) -> None:
    """Choose the parser (tests and benchmarks compare them).

    Raises:
        ValueError: an unknown name, or ``"c"`` while the extension is not built.
    """
    global _use_c
    _check_backend(name)
    _use_c = name == "c"


def _c_run(data: memoryview, slots: tuple) -> tuple:
    """One C parse of ``data`` up to its first malformed line: ``(block, stop_line,
    stop_byte)``, stop_line -1 when every line was good."""
    lines = bytes(data).count(b"\n") if len(data) < 1 << 16 else _newlines(data)
    counts = np.empty((lines, len(slots)), np.int64)
    where = np.empty(lines, np.int64)
    widths = np.array([s.dense_width for s in slots], np.int64)
    samples, stop_line, stop_byte = _c.slot_counts(data, widths, counts, where)
    counts = counts[:samples]
    outs = tuple(np.empty(int(counts[:, i].sum()), np.float32 if s.dtype == "float32"
                          else np.int64) for i, s in enumerate(slots))
    kinds = "".join("f" if s.dtype == "float32" else "i" for s in slots).encode()
    bad_line, bad_byte = _c.slot_values(data, kinds, counts, samples, outs)
    if bad_line >= 0:  # a token that is no number, on a line before the structural stop
        samples = int(np.searchsorted(where[:samples], bad_line))
        counts, stop_line, stop_byte = counts[:samples], bad_line, bad_byte
    values, lengths = {}, {}
    for i, slot in enumerate(slots):
        values[slot.name] = outs[i][:int(counts[:, i].sum())]
        if not slot.dense:
            lengths[slot.name] = counts[:, i].astype(np.int32)
    return SampleBlock(slots, samples, values, lengths), stop_line, stop_byte


def _newlines(data: memoryview) -> int:
    return int(np.count_nonzero(np.frombuffer(data, np.uint8) == 10))


def _parse_c(data: bytes, slots: tuple, file: str, first_line: int, skip: bool) -> tuple:
    view, blocks, skipped, at, line = memoryview(data), [], 0, 0, first_line
    while at < len(data):
        block, stop_line, stop_byte = _c_run(view[at:], slots)
        blocks.append(block)
        if stop_line < 0:
            break
        start = at + stop_byte
        end = data.index(b"\n", start)
        try:
            parse_line(data[start:end].split(), slots)
            reason = "not in the slot format"  # pragma: no cover - the parsers agree (tested)
        except ValueError as exc:
            reason = str(exc)
        if not skip:
            raise BadLineError(file, line + stop_line, reason)
        skipped, at, line = skipped + 1, end + 1, line + stop_line + 1
    return SampleBlock.concat(slots, blocks), skipped


def _tokens_per_line(data: bytes, lines: list) -> np.ndarray:
    count = len(lines)
    if data[:1] != b" " and not any(sep in data for sep in _IRREGULAR):
        # one space between tokens (what generators write): tokens = spaces + 1
        spaces = np.fromiter(map(bytes.count, lines, repeat(b" ")), np.int64, count)
        return spaces + np.fromiter(map(bool, lines), np.int64, count)
    return np.fromiter(map(len, map(bytes.split, lines)), np.int64, count)


def _read(text: bytes, dtype: str, count: int) -> np.ndarray:
    """The ``count`` numbers of a whitespace-separated byte string, as int64 or float32."""
    numbers = _read_any(text, dtype)
    if len(numbers) != count:
        raise _Malformed
    return numbers


def _read_any(text: bytes, dtype: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            if dtype == "float32":
                if b"(" in text:  # numpy reads "nan(1)"; Python's float() refuses it
                    raise _Malformed
                with np.errstate(over="ignore"):  # beyond float32: inf, as float() then cast
                    return np.fromstring(text, np.float64, sep=" ").astype(np.float32)
            try:
                raw = np.fromstring(text, np.uint64, sep=" ")
            except ValueError:  # a negative number: read signed instead
                if _LONE_SIGN.search(text):  # numpy's signed reader takes "-" for 0
                    raise _Malformed
                signed = np.fromstring(text, np.int64, sep=" ")
                if ((signed == _I64.max) | (signed == _I64.min)).any():
                    raise _Malformed  # saturated, perhaps: decide exactly, line by line
                return signed
        except ValueError:
            raise _Malformed from None
        if (raw == _U64_MAX).any():
            raise _Malformed
        return raw.view(np.int64)


def _runs(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Token indices ``first[i] .. first[i] + counts[i] - 1`` for every i, concatenated."""
    ends = np.cumsum(counts)
    return np.repeat(first - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends)
                                                                  else 0, dtype=np.int64)


def _vectorised(data: bytes, lines: list, slots: tuple) -> SampleBlock:
    ntok = _tokens_per_line(data, lines)
    ends = np.cumsum(ntok)
    starts, ends = (ends - ntok)[ntok > 0], ends[ntok > 0]
    all_ints = all(s.dtype == "int64" for s in slots)
    if all_ints:
        numbers = _read(data, "int64", int(ntok.sum()))
        ints_at = numbers.__getitem__
    else:
        tokens = data.split()

        def ints_at(index: np.ndarray) -> np.ndarray:
            return _read(b" ".join([tokens[i] for i in index.tolist()]), "int64", len(index))
    pos, layout = starts, []
    for slot in slots:
        if (pos >= ends).any():
            raise _Malformed
        counts = ints_at(pos)
        room = ends - pos - 1
        if (counts < 1).any() or (counts > room).any() or (
                slot.dense and (counts != slot.dense_width).any()):
            raise _Malformed
        layout.append((pos + 1, counts))
        pos = pos + 1 + counts
    if (pos != ends).any():
        raise _Malformed
    values, lengths = {}, {}
    for slot, (first, counts) in zip(slots, layout):
        index = _runs(first, counts)
        values[slot.name] = numbers[index] if all_ints else _read(
            b" ".join([tokens[i] for i in index.tolist()]), slot.dtype, len(index))
        if not slot.dense:
            lengths[slot.name] = counts.astype(np.int32)
    return SampleBlock(slots, len(starts), values, lengths)


def _int(token: bytes) -> int:
    if not _INT_TOKEN.fullmatch(token):
        raise ValueError
    value = int(token)
    if not _I64.min <= value <= int(_U64_MAX):
        raise OverflowError
    return value - (1 << 64) if value > _I64.max else value


def _number(token: bytes, slot: Slot, what: str) -> float:
    try:
        if slot.dtype == "int64":
            return _int(token)
        if b"_" in token:  # Python's float() reads 1_0; the format has no such numbers
            raise ValueError
        return float(token)
    except OverflowError:
        raise ValueError(f"slot {slot.name!r}: {what} {token.decode(errors='replace')!r} is "
                         f"outside the 64-bit integer range") from None
    except ValueError:
        kind = "an integer" if slot.dtype == "int64" else "a number"
        raise ValueError(f"slot {slot.name!r}: {what} {token.decode(errors='replace')!r} is "
                         f"not {kind}") from None


def parse_line(tokens: list, slots: Sequence[Slot]) -> list:
    """The values of each slot on one line, or ``ValueError`` saying what is wrong."""
    pos, out = 0, []
    for index, slot in enumerate(slots):
        if pos >= len(tokens):
            raise ValueError(f"the line ends before slot {slot.name!r} (slot {index + 1} of "
                             f"{len(slots)})")
        count = _number(tokens[pos], Slot(slot.name), "count")
        if count < 1:
            raise ValueError(f"slot {slot.name!r} has count {count}; every slot needs at least "
                             f"one value (pad it in the data generator)")
        if slot.dense and count != slot.dense_width:
            raise ValueError(f"slot {slot.name!r} is dense with {slot.dense_width} values per "
                             f"sample; the line gives {count}")
        if pos + 1 + count > len(tokens):
            raise ValueError(f"slot {slot.name!r} announces {count} values; the line has "
                             f"{len(tokens) - pos - 1} left")
        out.append([_number(t, slot, "value") for t in tokens[pos + 1:pos + 1 + count]])
        pos += 1 + count
    if pos != len(tokens):
        raise ValueError(f"{len(tokens) - pos} token(s) after the last slot {slots[-1].name!r}; "
                         f"the line holds more than the {len(slots)} declared slots "
                         f"{[s.name for s in slots]}")
    return out


def parse_line_by_line(lines: list, slots: Sequence[Slot], file: str, first_line: int = 1,
                       skip_bad_lines: bool = False) -> tuple:
    """:func:`parse_lines` without vectorisation: the definition of the format (slow)."""
    rows, skipped = [], 0
    for number, line in enumerate(lines, first_line):
        tokens = line.split()
        if not tokens:
            continue
        try:
            rows.append(parse_line(tokens, slots))
        except ValueError as exc:
            if not skip_bad_lines:
                raise BadLineError(file, number, str(exc)) from None
            skipped += 1
    return _block_of(rows, slots), skipped


def _block_of(rows: list, slots: Sequence[Slot]) -> SampleBlock:
    values, lengths = {}, {}
    for index, slot in enumerate(slots):
        column = [row[index] for row in rows]
        flat = [v for sample in column for v in sample]
        dtype = np.float32 if slot.dtype == "float32" else np.int64
        with np.errstate(over="ignore"):  # beyond float32: inf, as the other parsers
            values[slot.name] = np.array(flat, np.float64 if dtype is np.float32 else np.int64
                                         ).astype(dtype) if flat else np.empty(0, dtype)
        if not slot.dense:
            lengths[slot.name] = np.array([len(s) for s in column], np.int32)
    return SampleBlock(slots, len(rows), values, lengths)
