"""Reader processes: one per reader thread of a :class:`~fleetx.data.readers.ParallelReader`
of kind ``"process"``; the parsing happens here, outside the dataset's interpreter.

The process is started as ``python -c "...; main()" CONFIG`` (never through multiprocessing, so
the user's ``__main__`` is not imported again and needs no ``if __name__ == "__main__"``
guard). It imports numpy and ``fleetx.data``'s torch-free modules only.

Protocol, over the process's stdin and stdout:

* jobs, one JSON line each: ``[file_index, path]``; end of stdin: exit 0;
* frames back: a 32-byte header ``<4sIqqq`` (``b"FXRD"``, kind, file index, value, payload
  bytes) then the payload: kind 1 a chunk (value: its lines; payload: a packed
  :class:`~fleetx.data.block.SampleBlock`), kind 2 the file is done (value: bad lines
  skipped), kind 3 an error (payload: JSON naming the error type and its fields).
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Optional

import numpy as np

from fleetx.data import processes
from fleetx.data.api import (BadLineError, DataError, PipeCommandError, PipeTimeoutError,
                             Slot)
from fleetx.data.block import SampleBlock
from fleetx.data.reading import Abandoned, ReadOptions, read_file

__all__ = ["ProcessReader", "main"]

_HEADER = struct.Struct("<4sIqqq")
_MAGIC = b"FXRD"
_CHUNK, _DONE, _ERROR = 1, 2, 3
_STOP_S = 5.0  # how long a reader process may take to stop its pipe commands
_FIRST_READ = 1 << 20
_MAX_FRAME_BYTES = 1 << 40  # a sanity bound; the buffer only grows with the bytes that come
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the fleetx package
_BOOT = f"import sys; sys.path.insert(0, {_ROOT!r}); " \
        f"from fleetx.data.reader_process import main; main()"


def _config(options: ReadOptions) -> str:
    return json.dumps({"slots": [[s.name, s.dtype, s.dense_width] for s in options.slots],
                       "download_cmd": options.download_cmd,
                       "pipe_command": options.pipe_command,
                       "skip_bad_lines": options.skip_bad_lines,
                       "chunk_bytes": options.chunk_bytes, "parser": options.parser,
                       "timeout": options.timeout})


def _error_payload(exc: BaseException) -> bytes:
    if isinstance(exc, PipeCommandError):
        fields = {"file": exc.file, "command": exc.command, "returncode": exc.returncode,
                  "stderr": exc.stderr}
    elif isinstance(exc, PipeTimeoutError):
        fields = {"file": exc.file, "command": exc.command, "timeout": exc.timeout,
                  "after_output": exc.after_output}
    elif isinstance(exc, BadLineError):
        fields = {"file": exc.file, "line": exc.line, "reason": exc.reason}
    else:
        fields = {"message": f"{type(exc).__name__}: {exc}"}
    return json.dumps({"type": type(exc).__name__, "fields": fields}).encode()


def _error_from(payload: bytes, path: str) -> BaseException:
    sent = json.loads(payload)
    kind, fields = sent["type"], sent["fields"]
    if kind == "PipeCommandError":
        return PipeCommandError(**fields)
    if kind == "PipeTimeoutError":
        return PipeTimeoutError(**fields)
    if kind == "BadLineError":
        return BadLineError(**fields)
    return DataError(f"reading {path} in a reader process: {fields['message']}")


def main() -> None:
    """The reader process: read the jobs on stdin, answer with frames on stdout."""
    config = json.loads(sys.argv[1])
    options = ReadOptions(tuple(Slot(*s) for s in config["slots"]), config["download_cmd"],
                          config["pipe_command"], config["skip_bad_lines"],
                          config["chunk_bytes"], config["parser"], config["timeout"])
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # only frames may reach the dataset
    # stopped by the dataset: the commands of the file being read die with this process. Not
    # by unwinding (sys.exit): at exit the interpreter flushes stdout, which blocks for good
    # on a pipe nobody reads any more, and the commands would outlive the stop
    signal.signal(signal.SIGTERM, _stopped)

    def frame(kind: int, index: int, value: int, payload: Any = b"") -> None:
        data = memoryview(payload).cast("B") if len(payload) else b""
        out.write(_HEADER.pack(_MAGIC, kind, index, value, len(data)))
        out.write(data)
        out.flush()
    for job in sys.stdin.buffer:
        index, path = json.loads(job)
        try:
            skipped = read_file(path, options, lambda block, lines: frame(
                _CHUNK, index, lines, block.pack()))
            frame(_DONE, index, skipped)
        except Exception as exc:  # sent to the dataset, raised there
            frame(_ERROR, index, 0, _error_payload(exc))


def _stopped(*_: Any) -> None:
    """SIGTERM in a reader process: kill its pipe commands, then exit at once."""
    processes.kill_descendants()
    os._exit(128 + signal.SIGTERM)


def _ask_to_stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.terminate()  # it kills its pipe commands and exits


def _stop(child: subprocess.Popen) -> None:
    """End a reader process: with no more jobs it exits by itself; one still reading is asked
    to stop (SIGTERM: it kills its pipe commands on the way out), then killed."""
    try:
        child.stdin.close()
    except OSError:  # pragma: no cover - it is gone already
        pass
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(_STOP_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process ignoring SIGTERM
            processes.stop_tree(child)
    child.wait()


def _frame_size(size: int, path: str) -> int:
    """A frame's announced payload size, refused when negative or beyond any real chunk.

    Raises:
        DataError: naming the file.
    """
    if not 0 <= size <= _MAX_FRAME_BYTES:
        raise DataError(f"reading {path}: the reader process sent a malformed frame "
                        f"(payload of {size} bytes)")
    return size


def _read_exact(stream: IO[bytes], size: int) -> Optional[bytearray]:
    """``size`` bytes, or None at the end of the stream. The buffer grows with what arrives
    (doubling from 1 MiB), so a size the data does not back allocates no more than it."""
    buf, got = bytearray(min(size, _FIRST_READ)), 0
    while got < size:
        if got == len(buf):
            buf.extend(bytes(min(size - got, len(buf))))
        with memoryview(buf) as whole, whole[got:] as view:
            n = stream.readinto(view)
        if not n:
            return None
        got += n
    return buf


class ProcessReader:
    """Runs one reader process per thread of ``reader`` (``run`` is the thread's target)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.config = _config(reader.options)

    def run(self) -> None:
        index = None
        with tempfile.TemporaryFile() as err:
            try:
                child = processes.start([sys.executable, "-c", _BOOT, self.config],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=err)
            except BaseException as exc:  # no process: the next file reports it
                if (index := self.reader.take()) is not None:
                    self.reader.failed(index, exc)
                return
            self.reader.add(child, _ask_to_stop)
            try:
                while (index := self.reader.take()) is not None:
                    path = self.reader.files[index]
                    child.stdin.write((json.dumps([index, path]) + "\n").encode())
                    child.stdin.flush()
                    if not self._receive(child, index, path, err):
                        return
            except Abandoned:
                return
            except BrokenPipeError:
                self.reader.failed(index, self._died(child, path, err))
            except BaseException as exc:  # handed to the dataset, raised there
                self.reader.failed(index, exc)
            finally:
                self.reader.discard(child)
                _stop(child)

    def _receive(self, child: subprocess.Popen, index: int, path: str, err: IO[bytes]) -> bool:
        """Frames of file ``index`` until it is done (True) or failed (False)."""
        emit = self.reader.emitter(index)
        while True:
            header = _read_exact(child.stdout, _HEADER.size)
            if header is None:
                self.reader.failed(index, self._died(child, path, err))
                return False
            magic, kind, got, value, size = _HEADER.unpack(header)
            payload = _read_exact(child.stdout, _frame_size(size, path)) if size \
                else bytearray()
            if magic != _MAGIC or got != index or payload is None:
                self.reader.failed(index, DataError(f"reading {path}: the reader process sent "
                                                    f"a malformed frame"))
                return False
            if kind == _CHUNK:
                emit(SampleBlock.unpack(self.reader.options.slots, np.frombuffer(payload,
                                                                                 np.uint8),
                                        f"the reader process of {path}"), value)
            elif kind == _DONE:
                self.reader.done(index, value)
                return True
            else:
                self.reader.failed(index, _error_from(bytes(payload), path))
                return False

    @staticmethod
    def _died(child: subprocess.Popen, path: str, err: IO[bytes]) -> DataError:
        status = child.wait()
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace").strip() or "(nothing on stderr)"
        return DataError(f"the reader process reading {path} exited with status {status}; "
                         f"its stderr ends with:\n{tail}")
