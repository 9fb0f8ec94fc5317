"""Data generators: user code that turns raw lines into the slot text a dataset reads.

A generator runs as a dataset's ``pipe_command`` (``python my_reader.py``): it reads raw lines
on stdin and writes one sample per line on stdout, each slot as ``<count> v1 v2 ...`` in slot
order. The user overrides ``generate_sample(line)``, which returns a callable (usually an inner
generator function) yielding samples ``[(slot_name, [values...]), ...]``.

stdout carries nothing but sample lines: while user code runs, ``print()`` goes to stderr (in
the reference it would corrupt the data).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Optional, TextIO

from fleetx.data.api import SampleError

__all__ = ["DataGenerator", "MultiSlotDataGenerator", "MultiSlotStringDataGenerator"]

_EXAMPLE = "[('words', [1926, 8, 17]), ('label', [1])]"


class DataGenerator:
    """Base of the generators; subclass :class:`MultiSlotDataGenerator` or
    :class:`MultiSlotStringDataGenerator` and override :meth:`generate_sample`.

    Example:
        >>> class Words(MultiSlotDataGenerator):
        ...     def generate_sample(self, line):
        ...         def local_iter():
        ...             words = [int(w) for w in line.split()]
        ...             yield [("words", words), ("label", [words[0] % 2])]
        ...         return local_iter
        >>> Words().run_from_stdin()     # "1 2 3" on stdin -> "3 1 2 3 1 1" on stdout
    """

    def __init__(self) -> None:
        self.batch_size_ = 32
        self._names: Optional[list] = None   # slot names of the first sample
        self._written = 0                   # samples written so far

    def set_batch(self, batch_size: int) -> None:
        """How many samples :meth:`generate_batch` receives at a time (default 32).

        Raises:
            ValueError: ``batch_size`` is not a positive int.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"set_batch: batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size_ = batch_size

    def generate_sample(self, line: Optional[str]) -> Callable:
        """Override: return a callable yielding the samples of ``line`` (``None`` for
        :meth:`run_from_memory`), each ``[(slot_name, [values...]), ...]``; a yielded ``None``
        is skipped."""
        raise NotImplementedError(
            "Please rewrite this function to return a list or tuple: [(name, [feasign, ...]), "
            "...] or ((name, [feasign, ...]), ...)")

    def generate_batch(self, samples: list) -> Callable:
        """Override to post-process ``batch_size_`` samples at a time (padding to the batch's
        longest, say): return a callable yielding samples. By default yields them unchanged."""
        def local_iter():
            yield from samples
        return local_iter

    def run_from_stdin(self) -> None:
        """Read lines from stdin, write their samples to stdout (the pipe-command loop)."""
        self._run(sys.stdin)

    def run_from_memory(self) -> None:
        """Write the samples of ``generate_sample(None)`` to stdout (for tests and benchmarks)."""
        self._run(None)

    def _run(self, lines: Optional[TextIO]) -> None:
        out = sys.stdout
        batch: list = []
        # user code may print(); only samples may reach the data stream
        with contextlib.redirect_stdout(sys.stderr):
            for line in (lines if lines is not None else [None]):
                for sample in _called(self.generate_sample(line), "generate_sample(line)")():
                    if sample is None:
                        continue
                    batch.append(sample)
                    if len(batch) == self.batch_size_:
                        self._write_batch(batch, out)
                        batch = []
            if batch:
                self._write_batch(batch, out)
        out.flush()

    def _write_batch(self, batch: list, out: TextIO) -> None:
        for sample in _called(self.generate_batch(batch), "generate_batch(samples)")():
            if sample is not None:
                out.write(self._gen_str(sample))

    def _gen_str(self, sample: Any) -> str:
        raise NotImplementedError("use MultiSlotDataGenerator or MultiSlotStringDataGenerator")

    def _pairs(self, sample: Any) -> list:
        """``sample`` as a list of (name, values) pairs, checked against the first sample."""
        self._written += 1
        if isinstance(sample, zip):
            sample = list(sample)
        if not isinstance(sample, (list, tuple)):
            raise SampleError(f"the output of process() must be in list or tuple type: sample "
                              f"{self._written} is a {type(sample).__name__}; expected "
                              f"[(slot_name, [values...]), ...], e.g. {_EXAMPLE}")
        for i, item in enumerate(sample):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise SampleError(f"item {i} of sample {self._written} is not a (slot_name, "
                                  f"[values...]) pair: {item!r}")
            name, values = item
            if not isinstance(name, str):
                raise SampleError(f"name{type(name)} must be in str type: item {i} of sample "
                                  f"{self._written} has the slot name {name!r}")
            if not isinstance(values, list):
                raise SampleError(f"elements{type(values)} must be in list type: slot {name!r} "
                                  f"of sample {self._written} holds {values!r}")
            if not values:
                raise SampleError(f"the elements of each field can not be empty, you need "
                                  f"padding it in process(): slot {name!r} of sample "
                                  f"{self._written} has no values")
        self._check_names([name for name, _ in sample])
        return sample

    def _check_names(self, names: list) -> None:
        if self._names is None:
            self._names = names
            return
        if len(names) != len(self._names):
            raise SampleError(f"the complete field set of two given line are inconsistent: "
                              f"sample {self._written} has {len(names)} slots {names}, the first "
                              f"sample had {len(self._names)} {self._names}")
        for index, (want, got) in enumerate(zip(self._names, names)):
            if want != got:
                raise SampleError(f"the field name of two given line are not match: "
                                  f"require<{want}>, get<{got}>: slot {index} of sample "
                                  f"{self._written}")


def _is_number(value: Any) -> bool:
    """An int or a float, or a numpy scalar of either (their ``str()`` is the same digits);
    not a bool ("True" is no number to the dataset)."""
    if type(value) in (int, float):
        return True
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return kind in ("i", "u", "f") and getattr(value, "ndim", 1) == 0


def _called(made: Any, what: str) -> Callable:
    if not callable(made):
        raise TypeError(f"{what} must return a callable (an inner generator function) that "
                        f"yields samples; got {type(made).__name__}")
    return made


class MultiSlotDataGenerator(DataGenerator):
    """A generator of numeric slots: values are ints or floats (numpy scalars too), written
    with Python ``str()``.

    Raises (from ``run_from_stdin`` / ``run_from_memory``):
        SampleError (a ValueError): a sample is not a list/tuple/zip of ``(name, [values])``
            pairs, a value list is empty, the slot names or their number change from one sample
            to the next, or a value is not an int or a float; the message names the slot.

    Example:
        >>> class Reader(MultiSlotDataGenerator):
        ...     def generate_sample(self, line):
        ...         def local_iter():
        ...             yield [("words", [1, 2, 3, 4]), ("label", [0])]
        ...         return local_iter
        >>> Reader().run_from_memory()          # prints "4 1 2 3 4 1 0"
    """

    def _gen_str(self, sample: Any) -> str:
        parts = []
        for name, values in self._pairs(sample):
            kinds = set(map(type, values))
            if not kinds <= {int, float}:
                self._check_numbers(name, values)
            parts.append(f"{len(values)} {' '.join(map(str, values))}")
        return " ".join(parts) + "\n"

    def _check_numbers(self, name: str, values: list) -> None:
        for value in values:
            if not _is_number(value):
                raise SampleError(f"the type of element{type(value)} must be in int or float: "
                                  f"slot {name!r} of sample {self._written} holds {value!r}")


class MultiSlotStringDataGenerator(DataGenerator):
    """A generator whose values are already strings (faster: nothing is converted); the same
    line format and the same checks of the sample's shape as :class:`MultiSlotDataGenerator`.

    Raises (from ``run_from_stdin`` / ``run_from_memory``):
        SampleError (a ValueError): as :class:`MultiSlotDataGenerator`, or a value that is not a
            str.

    Example:
        >>> class Reader(MultiSlotStringDataGenerator):
        ...     def generate_sample(self, line):
        ...         def local_iter():
        ...             words = line.split()
        ...             yield [("words", words[1:]), ("label", words[:1])]
        ...         return local_iter
    """

    def _gen_str(self, sample: Any) -> str:
        parts = []
        for name, values in self._pairs(sample):
            if not all(isinstance(v, str) for v in values):
                bad = next(v for v in values if not isinstance(v, str))
                raise SampleError(f"MultiSlotStringDataGenerator writes str values: slot "
                                  f"{name!r} of sample {self._written} holds {bad!r} "
                                  f"({type(bad).__name__}); use MultiSlotDataGenerator for "
                                  f"numbers")
            parts.append(f"{len(values)} {' '.join(values)}")
        return " ".join(parts) + "\n"
