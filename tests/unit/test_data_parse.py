"""The slot text parser: slot declarations, the C and numpy parsers against the line-by-line
definition of the format, and every bad-line message."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetx.data import BadLineError, Slot
from fleetx.data import parse
from fleetx.data.api import as_slots
from fleetx.data.block import SampleBlock

BACKENDS = ["c", "numpy"]
MIXED = (Slot("dense", "float32", dense_width=3), Slot("ids"), Slot("weights", "float32"),
         Slot("label", "int64", dense_width=1))
INTS = (Slot("ids"), Slot("more"), Slot("label", "int64", dense_width=1))


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "c" and parse._c is None:
        pytest.skip("the C slot parser (fleetx/data/_slots.c) is not built: pip install -e .")
    before = parse.backend()
    parse.set_backend(request.param)
    yield request.param
    parse.set_backend(before)


def same(a: SampleBlock, b: SampleBlock) -> None:
    assert a.size == b.size and a.slots == b.slots
    for s in a.slots:
        assert a.values[s.name].dtype == b.values[s.name].dtype
        np.testing.assert_array_equal(a.values[s.name], b.values[s.name])
        if not s.dense:
            np.testing.assert_array_equal(a.lengths[s.name], b.lengths[s.name])


def random_lines(rng, slots, n, sep=" ") -> list:
    ints = [0, 1, 7, -1, -2**63, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567]
    lines = []
    for _ in range(n):
        parts = []
        for s in slots:
            k = s.dense_width or int(rng.integers(1, 5))
            if s.dtype == "int64":
                vals = [str(ints[i]) if rng.random() < 0.3 else str(int(rng.integers(-9, 2**62)))
                        for i in rng.integers(0, len(ints), k)]
            else:
                vals = [rng.choice(["0.5", "1e-3", "-2.25", "nan", "inf", "3", "1.0000001",
                                    str(rng.standard_normal())]) for _ in range(k)]
            parts.append(sep.join([str(k)] + vals))
        lines.append(sep.join(parts))
    return lines


@pytest.mark.parametrize("slots", [MIXED, INTS], ids=["mixed", "ints"])
@pytest.mark.parametrize("sep", [" ", "\t", "  "])
def test_parsers_agree_with_the_definition(backend, slots, sep):
    rng = np.random.default_rng(len(sep))
    lines = random_lines(rng, slots, 300, sep)
    lines[5] = ""                      # blank lines are no samples
    lines[9] = "  " + lines[9] + "\r"  # stray whitespace around a line
    data = ("\n".join(lines)).encode()  # no final newline
    block, skipped = parse.parse_lines(data, slots, "f")
    expected, _ = parse.parse_line_by_line(data.split(b"\n"), slots, "f")
    assert skipped == 0 and block.size == 299
    same(block, expected)


def test_values_are_read_exactly(backend):
    slots = (Slot("ids"), Slot("x", "float32"))
    data = (b"4 18446744073709551615 9223372036854775808 -9223372036854775808 +7 "
            b"3 0.1 -1e39 nan\n")
    block, _ = parse.parse_lines(data, slots, "f")
    assert block.values["ids"].tolist() == [-1, -2**63, -2**63, 7]
    x = block.values["x"]
    assert x.dtype == np.float32 and x[0] == np.float32(0.1) and x[1] == -np.inf
    assert np.isnan(x[2])


def test_a_block_becomes_batches_of_tensors(backend):
    from fleetx.data.batches import to_batch
    block, _ = parse.parse_lines(b"3 0.5 1 2 2 11 12 1 0.5 1 1\n3 0 0 0 1 13 2 1 2 1 0\n",
                                 MIXED, "f")
    batch = to_batch(block)
    assert batch["dense"].dtype == torch.float32 and batch["dense"].shape == (2, 3)
    assert batch["label"].tolist() == [[1], [0]]
    ids = batch["ids"]
    assert ids.values.tolist() == [11, 12, 13] and ids.offsets.tolist() == [0, 2]
    assert ids.lengths.tolist() == [2, 1] and ids.values.dtype == torch.int64
    bag = torch.nn.EmbeddingBag(20, 4, mode="sum")
    assert bag(ids.values, ids.offsets).shape == (2, 4)
    assert batch["weights"].values.tolist() == [0.5, 1.0, 2.0]


BAD = [
    (b"3 1 2\n", "slot 'ids' announces 3 values; the line has 2 left"),
    (b"2 1 2 2 5 6\n", "the line ends before slot 'label' (slot 3 of 3)"),
    (b"2 1 2 2 5 6 1 1 9\n", "1 token(s) after the last slot 'label'; the line holds more than "
                             "the 3 declared slots ['ids', 'more', 'label']"),
    (b"0 2 5 6 1 1\n", "slot 'ids' has count 0; every slot needs at least one value (pad it in "
                       "the data generator)"),
    (b"2 1 2 1 5 2 1 1\n", "slot 'label' is dense with 1 values per sample; the line gives 2"),
    (b"x 1 1 5 1 1\n", "slot 'ids': count 'x' is not an integer"),
    (b"1 1.5 1 5 1 1\n", "slot 'ids': value '1.5' is not an integer"),
    (b"1 1_0 1 5 1 1\n", "slot 'ids': value '1_0' is not an integer"),
    (b"1 18446744073709551616 1 5 1 1\n", "slot 'ids': value '18446744073709551616' is outside "
                                          "the 64-bit integer range"),
    (b"1 -9223372036854775809 1 5 1 1\n", "slot 'ids': value '-9223372036854775809' is outside "
                                          "the 64-bit integer range"),
    (b"-1 5 1 5 1 1\n", "slot 'ids' has count -1; every slot needs at least one value"),
]


@pytest.mark.parametrize("line, reason", BAD)
def test_a_bad_line_is_named_with_file_line_and_reason(backend, line, reason):
    good = b"1 1 1 2 1 0\n"
    with pytest.raises(BadLineError) as err:
        parse.parse_lines(good * 4 + b"\n" + line + good, INTS, "part-7", first_line=11)
    assert err.value.file == "part-7" and err.value.line == 16  # 11 + 4 good + 1 blank
    assert err.value.reason.startswith(reason)
    assert str(err.value).startswith(f"part-7, line 16 of its pipe output: {reason}")
    assert str(err.value).endswith("(init(..., skip_bad_lines=True) skips such lines and counts "
                                   "them)")


@pytest.mark.parametrize("token, reason", [
    (b"0x1p3", "slot 'x': value '0x1p3' is not a number"),
    (b"nan(1)", "slot 'x': value 'nan(1)' is not a number"),
    (b"1,5", "slot 'x': value '1,5' is not a number"),
    (b"1e", "slot 'x': value '1e' is not a number"),
])
def test_float_tokens_python_refuses_are_refused(backend, token, reason):
    with pytest.raises(BadLineError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse.parse_lines(b"1 " + token + b"\n", (Slot("x", "float32"),), "f")


WEIRD = [b".", b"-", b"+", b"e5", b"1.2.3", b"--1", b"1e+", b"in", b"nana", b"infinit", b"0x",
         b"1d5", b"+nan", b"-inf", b"NAN", b"iNf", b"1E5", b"0X1", b"nan()", b"1.e5", b".e5",
         b"1..", b"+-1", b"1e400", b"-1e-400", b"007", b"-0", b"+5", b"5+", b"1_000", b"\xff",
         b"infinity", b"-Infinity", b"0.1e-3", b"12345678901234567890123"]


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_odd_tokens_read_alike_by_every_parser(backend, dtype):
    slots = (Slot("x", dtype),)
    for token in WEIRD:
        line = [b"1 " + token]
        try:
            expected = parse.parse_line_by_line(line, slots, "f")[0].values["x"]
        except BadLineError:
            with pytest.raises(BadLineError):
                parse.parse_lines(line[0], slots, "f")
            continue
        got = parse.parse_lines(line[0], slots, "f")[0].values["x"]
        np.testing.assert_array_equal(got, expected, err_msg=repr(token))


def test_bad_lines_are_skipped_and_counted_identically(backend):
    rng = np.random.default_rng(3)
    lines = random_lines(rng, MIXED, 400)
    bad_rows = sorted(rng.choice(400, 40, replace=False).tolist())
    corruptions = [b"1 2 3", b"3 a b c", b"", b"9", b"3 1 2 3 1 5 1 0.5 1 1 1"]
    raw = [line.encode() for line in lines]
    for i, row in enumerate(bad_rows):
        raw[row] = corruptions[i % len(corruptions)]
    data = b"\n".join(raw) + b"\n"
    block, skipped = parse.parse_lines(data, MIXED, "f", skip_bad_lines=True)
    expected, expected_skipped = parse.parse_line_by_line(data.split(b"\n")[:-1], MIXED, "f",
                                                          skip_bad_lines=True)
    assert skipped == expected_skipped == 32  # the 8 blank "corruptions" are no samples
    same(block, expected)
    assert block.size == 400 - 40


def test_backend_choice_is_checked():
    with pytest.raises(ValueError, match="parser backend must be 'c' or 'numpy', got 'fast'"):
        parse.set_backend("fast")


@pytest.mark.parametrize("dtype, canonical", [
    ("int64", "int64"), ("uint64", "int64"), (np.int64, "int64"), (torch.int64, "int64"),
    ("float32", "float32"), ("float", "float32"), (np.float32, "float32"),
    (torch.float32, "float32"), (np.dtype("float32"), "float32")])
def test_slot_dtypes(dtype, canonical):
    assert Slot("s", dtype).dtype == canonical


def test_slot_declaration_errors():
    with pytest.raises(ValueError, match=r"^Currently, fleetx datasets only support "
                                         r"dtype=float32 and dtype=int64: slot 'x' has dtype "
                                         r"'int32' \(valid: 'int64', 'float32', or the "
                                         r"reference's 'uint64', 'float'\)$"):
        Slot("x", "int32")
    with pytest.raises(ValueError, match="Currently, fleetx datasets only support"):
        Slot("x", torch.float64)
    with pytest.raises(ValueError, match="a slot name must be a non-empty string without "
                                         "whitespace, got 'a b'"):
        Slot("a b")
    with pytest.raises(ValueError, match=r"slot 'x': dense_width must be an int >= 0 \(0: a "
                                         r"sparse slot\), got -1"):
        Slot("x", dense_width=-1)
    with pytest.raises(ValueError, match=r"slot names must be unique; declared more than once: "
                                         r"\['a'\]"):
        as_slots(["a", Slot("a", "float32")])
    with pytest.raises(TypeError, match="use_var / slots items must be fleetx.data.Slot or str, "
                                        "got int"):
        as_slots([3])
    with pytest.raises(TypeError, match="use_var / slots must be a list"):
        as_slots("abc")


@pytest.mark.parametrize("slots", [MIXED, INTS], ids=["mixed", "ints"])
def test_mutated_lines_fuzz(backend, slots):
    """Random edits of valid lines: every parser keeps and skips the same lines."""
    rng = np.random.default_rng(11)
    alphabet = list(b" 0123456789-+.e\tn(x")
    raw = []
    for line in random_lines(rng, slots, 600):
        b = bytearray(line.encode())
        for _ in range(int(rng.integers(0, 3))):
            at = int(rng.integers(0, len(b) + 1))
            op = rng.integers(0, 3)
            if op == 0 and at < len(b):
                del b[at]
            elif op == 1:
                b.insert(at, alphabet[int(rng.integers(len(alphabet)))])
            elif at < len(b):
                b[at] = alphabet[int(rng.integers(len(alphabet)))]
        raw.append(bytes(b))
    data = b"\n".join(raw) + b"\n"
    block, skipped = parse.parse_lines(data, slots, "f", skip_bad_lines=True)
    expected, expected_skipped = parse.parse_line_by_line(raw, slots, "f", skip_bad_lines=True)
    assert skipped == expected_skipped and 50 < skipped < 550
    same(block, expected)
