"""The contract of ``fleetx.data``: slot declarations, the batch types, the errors, and what a
global shuffle needs from the fleet.

Nothing here imports torch: the reader processes and data-generator scripts import this module,
and they must start in a fraction of a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Protocol, Sequence

__all__ = ["Slot", "as_slots", "RaggedSlot", "DataError", "SampleError", "BadLineError",
           "PipeCommandError", "PipeTimeoutError", "ShuffleError", "Util", "FleetLike", "DTYPE_ERROR"]

# The reference's message for a variable of another dtype, kept as its first sentence.
DTYPE_ERROR = "Currently, fleetx datasets only support dtype=float32 and dtype=int64"

# Every spelling a user may reach for, mapped to the two dtypes a slot can have. "uint64" and
# "float" are the reference's slot type names; torch and numpy dtypes are matched by name.
_DTYPES = {"int64": "int64", "uint64": "int64", "torch.int64": "int64", "long": "int64",
           "torch.long": "int64", "float32": "float32", "float": "float32",
           "torch.float32": "float32", "torch.float": "float32"}


class DataError(ValueError):
    """Base of the errors of ``fleetx.data`` (a ``ValueError``, as the reference raises)."""


class SampleError(DataError):
    """A data generator produced a malformed sample (the message names the slot)."""


class BadLineError(DataError):
    """A line of a file's pipe output is not in the slot format the dataset declares.

    Attributes:
        file: the file whose pipe output holds the line.
        line: its number, from 1, in that output.
        reason: what is wrong with it.
    """

    def __init__(self, file: str, line: int, reason: str) -> None:
        super().__init__(f"{file}, line {line} of its pipe output: {reason} (init(..., "
                         f"skip_bad_lines=True) skips such lines and counts them)")
        self.file, self.line, self.reason = file, line, reason


class PipeCommandError(DataError):
    """The command a file was read through failed: it could not start, or exited non-zero.

    Attributes:
        file: the file being read.
        command: the shell command that failed.
        returncode: its exit status (127: not found; negative: killed by that signal).
        stderr: the end of what it wrote on stderr.
    """

    def __init__(self, file: str, command: str, returncode: int, stderr: str) -> None:
        tail = stderr.strip() or "(nothing on stderr)"
        super().__init__(f"reading {file}: command {command!r} exited with status {returncode}; "
                         f"its stderr ends with:\n{tail}")
        self.file, self.command, self.returncode, self.stderr = file, command, returncode, stderr


class PipeTimeoutError(DataError):
    """A file's commands wrote nothing for ``timeout`` seconds (``FLEETX_TIMEOUT``), or one
    of them ended its output but did not exit within that time: a hung download or generator;
    both commands are killed.

    Attributes:
        file: the file being read.
        command: the pipeline (``<download_cmd> <file> | <pipe_command>``), or the command
            that did not exit.
        timeout: the seconds waited.
        after_output: the output had ended (the command hung on its way out).
    """

    def __init__(self, file: str, command: str, timeout: float,
                 after_output: bool = False) -> None:
        what = "ended its output but did not exit within" if after_output else \
            "wrote nothing for"
        super().__init__(f"reading {file}: {command!r} {what} {timeout:g} s "
                         f"(FLEETX_TIMEOUT); the commands were killed")
        self.file, self.command, self.timeout = file, command, timeout
        self.after_output = after_output


class ShuffleError(DataError):
    """Workers disagree during a global shuffle (another slot declaration, a missing fleet)."""


@dataclass(frozen=True)
class Slot:
    """One slot of the data: a name, a dtype, and a width for dense slots.

    A *sparse* slot (``dense_width=0``) holds any number (at least one) of values per sample;
    a batch gives them as a :class:`RaggedSlot`. A *dense* slot holds exactly ``dense_width``
    values per sample; a batch gives a ``(batch, dense_width)`` tensor.

    Args:
        name: the slot's name (no whitespace); batches are keyed by it.
        dtype: ``"int64"`` (ids, labels; the reference's ``"uint64"`` too) or ``"float32"``
            (``"float"``); numpy and torch dtypes of those two are accepted.
        dense_width: values per sample of a dense slot; 0 for a sparse slot.

    Raises:
        ValueError: another dtype (the reference's message), an empty name or a negative width.

    Example:
        >>> Slot("click", "int64", dense_width=1), Slot("dense", "float32", dense_width=13)
        >>> Slot("C1")                      # sparse int64 ids
    """

    name: str
    dtype: str = "int64"
    dense_width: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in
                                                                   self.name):
            raise ValueError(f"a slot name must be a non-empty string without whitespace, got "
                             f"{self.name!r}")
        spelled = str(self.dtype).removeprefix("<class '").removesuffix("'>")
        spelled = spelled.removeprefix("numpy.")
        if spelled not in _DTYPES:
            raise ValueError(f"{DTYPE_ERROR}: slot {self.name!r} has dtype {self.dtype!r} "
                             f"(valid: 'int64', 'float32', or the reference's 'uint64', "
                             f"'float')")
        object.__setattr__(self, "dtype", _DTYPES[spelled])
        if isinstance(self.dense_width, bool) or not isinstance(self.dense_width, int) or \
                self.dense_width < 0:
            raise ValueError(f"slot {self.name!r}: dense_width must be an int >= 0 (0: a sparse "
                             f"slot), got {self.dense_width!r}")

    @property
    def dense(self) -> bool:
        return self.dense_width > 0


def as_slots(items: Iterable[Any]) -> tuple:
    """The :class:`Slot` s declared by ``items`` (``Slot`` objects, or names for sparse int64
    slots), in order.

    Raises:
        TypeError: an item is neither.
        ValueError: two slots share a name.
    """
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(f"use_var / slots must be a list of fleetx.data.Slot or slot names, "
                        f"got {type(items).__name__}")
    slots = []
    for item in items:
        if isinstance(item, str):
            item = Slot(item)
        if not isinstance(item, Slot):
            raise TypeError(f"use_var / slots items must be fleetx.data.Slot or str, got "
                            f"{type(item).__name__} ({item!r})")
        slots.append(item)
    names = [s.name for s in slots]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"slot names must be unique; declared more than once: {twice}")
    return tuple(slots)


class RaggedSlot(NamedTuple):
    """A sparse slot of one batch, ready for ``nn.EmbeddingBag`` /
    ``fleetx.nn.SparseEmbeddingBag`` (``bag(slot.values, slot.offsets)``).

    Attributes:
        values: every sample's values, concatenated (int64 or float32, 1-D).
        offsets: where each sample's values start in ``values`` (int64, one per sample).
        lengths: how many values each sample has (int64, one per sample).
    """

    values: Any
    offsets: Any
    lengths: Any


class Util(Protocol):
    """What a global shuffle uses of ``fleet.util`` (:class:`fleetx.fleet.UtilBase` is one)."""

    def barrier(self, comm_world: str = "worker") -> None: ...

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any: ...

    def all_to_all(self, inputs: Sequence[Any], comm_world: str = "worker") -> list: ...


class FleetLike(Protocol):
    """What ``global_shuffle(fleet)`` and ``get_*_data_size(fleet)`` use of the fleet: the
    ``fleetx.fleet`` module and a ``Fleet`` object both qualify. The dataset never imports the
    fleet; it is handed one."""

    util: Util

    def worker_num(self) -> int: ...

    def worker_index(self) -> int: ...
