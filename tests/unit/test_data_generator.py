"""Data generators: the exact bytes they write, batching, and every error message."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fleetx import fleet
from fleetx.data import (MultiSlotDataGenerator, MultiSlotStringDataGenerator, SampleError)

ROOT = Path(__file__).resolve().parents[2]


def gen(samples, cls=MultiSlotDataGenerator, batch=None, generate_batch=None):
    """A generator yielding ``samples`` from run_from_memory (which passes line=None)."""
    seen = []

    class G(cls):
        def generate_sample(self, line):
            seen.append(line)

            def local_iter():
                yield from samples
            return local_iter

    if generate_batch is not None:
        G.generate_batch = generate_batch
    g = G()
    if batch:
        g.set_batch(batch)
    g.seen = seen
    return g


def run(g, capsys):
    g.run_from_memory()
    out = capsys.readouterr()
    return out.out, out.err


def test_reference_example_bytes(capsys):
    g = gen([(("words", [1, 2, 3, 4]), ("label", [0]))])
    assert run(g, capsys)[0] == "4 1 2 3 4 1 0\n"
    assert g.seen == [None]  # run_from_memory calls generate_sample(None)


def test_values_use_python_str_in_slot_order(capsys):
    samples = [[("dense", [0.5, 1.0, -2.25, 1e-07]), ("ids", [7, 2**63 + 5, -3]),
                ("label", [1])],
               (("dense", [np.float32(0.25), np.float64(3.0), 0.1, 2.0]),
                ("ids", [np.int64(9)]), ("label", [np.uint8(0)])),
               zip(["dense", "ids", "label"], [[1.5, 2.5, 3.5, 4.5], [1, 2], [0]])]
    out, _ = run(gen(samples), capsys)
    assert out == ("4 0.5 1.0 -2.25 1e-07 3 7 9223372036854775813 -3 1 1\n"
                   "4 0.25 3.0 0.1 2.0 1 9 1 0\n"
                   "4 1.5 2.5 3.5 4.5 2 1 2 1 0\n")


def test_string_generator_bytes(capsys):
    g = gen([[("words", ["1926", "08", "17"]), ("label", ["1"])]], MultiSlotStringDataGenerator)
    assert run(g, capsys)[0] == "3 1926 08 17 1 1\n"


def test_none_samples_are_skipped_and_batches_flushed(capsys):
    def generate_batch(self, samples):
        def local_iter():
            longest = max(len(s[0][1]) for s in samples)
            for s in samples:  # pad to the batch's longest, as a generate_batch would
                yield [("w", s[0][1] + [0] * (longest - len(s[0][1])))]
        return local_iter
    samples = [[("w", [1])], None, [("w", [2, 3])], [("w", [4])], [("w", [5, 6, 7])],
               [("w", [8])]]
    out, _ = run(gen(samples, batch=2, generate_batch=generate_batch), capsys)
    # batches [1],[2,3] | [4],[5,6,7] | [8] (the last, partial batch is flushed)
    assert out == "2 1 0\n2 2 3\n3 4 0 0\n3 5 6 7\n1 8\n"


def test_stdout_carries_only_samples(capsys):
    class Noisy(MultiSlotDataGenerator):
        def generate_sample(self, line):
            print("debugging", line)

            def local_iter():
                print("inside")
                yield [("w", [1])]
            return local_iter
    out, err = run(Noisy(), capsys)
    assert out == "1 1\n"
    assert "debugging None" in err and "inside" in err


def test_run_from_stdin_exact_bytes_in_a_subprocess(tmp_path):
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent("""
        from fleetx.data import MultiSlotDataGenerator

        class Reader(MultiSlotDataGenerator):
            def generate_sample(self, line):
                def local_iter():
                    fields = line.split(",")
                    print("noise")  # goes to stderr
                    yield [("ids", [int(x) for x in fields[1:]]), ("label", [float(fields[0])])]
                return local_iter

        Reader().run_from_stdin()
    """))
    res = subprocess.run([sys.executable, str(script)], input=b"1,5,6\n0,7\n", capture_output=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"2 5 6 1 1.0\n1 7 1 0.0\n"
    assert res.stderr.count(b"noise") == 2


def test_generators_and_readers_start_without_torch():
    code = ("import sys, fleetx.data, fleetx.data.readers, fleetx.data.reader_process; "
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_fleet_exports_the_generators():
    assert fleet.MultiSlotDataGenerator is MultiSlotDataGenerator
    assert fleet.MultiSlotStringDataGenerator is MultiSlotStringDataGenerator


@pytest.mark.parametrize("samples, message", [
    ([{"w": [1]}], "the output of process() must be in list or tuple type: sample 1 is a dict; "
                   "expected [(slot_name, [values...]), ...], e.g. [('words', [1926, 8, 17]), "
                   "('label', [1])]"),
    ([[("w", [1], 2)]], "item 0 of sample 1 is not a (slot_name, [values...]) pair: "
                        "('w', [1], 2)"),
    ([[("w", [1]), (3, [1])]], "name<class 'int'> must be in str type: item 1 of sample 1 has "
                               "the slot name 3"),
    ([[("w", (1, 2))]], "elements<class 'tuple'> must be in list type: slot 'w' of sample 1 "
                        "holds (1, 2)"),
    ([[("w", [1])], [("w", [])]], "the elements of each field can not be empty, you need padding "
                                  "it in process(): slot 'w' of sample 2 has no values"),
    ([[("a", [1]), ("b", [2])], [("a", [1])]],
     "the complete field set of two given line are inconsistent: sample 2 has 1 slots ['a'], "
     "the first sample had 2 ['a', 'b']"),
    ([[("a", [1]), ("b", [2])], [("a", [1]), ("c", [2])]],
     "the field name of two given line are not match: require<b>, get<c>: slot 1 of sample 2"),
    ([[("w", [1, "2"])]], "the type of element<class 'str'> must be in int or float: slot 'w' "
                          "of sample 1 holds '2'"),
    ([[("w", [0.5])], [("w", [0.5, None])]],  # a float slot is still checked (not in Paddle)
     "the type of element<class 'NoneType'> must be in int or float: slot 'w' of sample 2 "
     "holds None"),
    ([[("w", [True])]], "the type of element<class 'bool'> must be in int or float: slot 'w' of "
                        "sample 1 holds True"),
    ([[("w", [np.array([1, 2])])]], "the type of element<class 'numpy.ndarray'> must be in int or "
                                    "float: slot 'w' of sample 1 holds array([1, 2])"),
])
def test_malformed_samples_name_the_slot(samples, message, capsys):
    with pytest.raises(SampleError) as err:
        gen(samples).run_from_memory()
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)  # the reference raises ValueError


@pytest.mark.parametrize("samples, message", [
    (["1 1"], "the output of process() must be in list or tuple type: sample 1 is a str"),
    ([[("w", ["1", 2])]], "MultiSlotStringDataGenerator writes str values: slot 'w' of sample 1 "
                          "holds 2 (int); use MultiSlotDataGenerator for numbers"),
    ([[("w", [])]], "the elements of each field can not be empty"),
    ([[("a", ["1"])], [("b", ["1"])]], "the field name of two given line are not match: "
                                       "require<a>, get<b>: slot 0 of sample 2"),
])
def test_string_generator_errors(samples, message):
    with pytest.raises(SampleError) as err:
        gen(samples, MultiSlotStringDataGenerator).run_from_memory()
    assert str(err.value).startswith(message)


def test_generate_sample_must_return_a_callable():
    class Bad(MultiSlotDataGenerator):
        def generate_sample(self, line):
            return [[("w", [1])]]
    with pytest.raises(TypeError, match=r"generate_sample\(line\) must return a callable \(an "
                                        r"inner generator function\) that yields samples; got "
                                        r"list"):
        Bad().run_from_memory()


def test_set_batch_and_base_class_errors():
    g = MultiSlotDataGenerator()
    with pytest.raises(ValueError, match="set_batch: batch_size must be an int >= 1, got 0"):
        g.set_batch(0)
    with pytest.raises(NotImplementedError, match="Please rewrite this function"):
        g.run_from_memory()
