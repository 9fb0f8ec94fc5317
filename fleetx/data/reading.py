"""How one file is read: its commands, then the parser, chunk by chunk (:func:`read_file`, with
its :class:`ReadOptions`). A reader thread (``readers.py``) and a reader process
(``reader_process.py``) both read files this way; a reader whose consumer has stopped unwinds
with :class:`Abandoned`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

from fleetx.data.parse import parse_lines
from fleetx.data.pipe import CHUNK_BYTES, read_lines

__all__ = ["ReadOptions", "read_file", "Abandoned"]


@dataclass(frozen=True)
class ReadOptions:
    """How every file is read: the commands, the slots, bad lines, the chunk size, the
    parser (None: the C one when it is built; benchmarks compare them), and how long the
    commands may stay silent."""

    slots: tuple
    download_cmd: str = "cat"
    pipe_command: str = "cat"
    skip_bad_lines: bool = False
    chunk_bytes: int = CHUNK_BYTES
    parser: Optional[str] = None
    timeout: Optional[float] = None  # seconds a file's commands may stay silent (FLEETX_TIMEOUT)


def read_file(path: str, options: ReadOptions, emit: Callable,
              tracker: Optional[object] = None) -> int:
    """Read one file; ``emit(block, lines)`` for each parsed chunk. Returns the bad lines
    skipped. ``tracker``: ``add(process, stop)`` / ``discard(process)`` for its commands."""
    skipped = 0
    chunks = read_lines(path, options.download_cmd, options.pipe_command, options.chunk_bytes,
                        tracker, options.timeout)
    with contextlib.closing(chunks):  # stopping early kills the file's commands at once
        for first_line, data in chunks:
            block, bad = parse_lines(data, options.slots, path, first_line,
                                     options.skip_bad_lines, options.parser)
            skipped += bad
            emit(block, data.count(b"\n"))
    return skipped


class Abandoned(Exception):
    """The consumer stopped reading: a reader unwinds (its pipe commands are killed)."""
