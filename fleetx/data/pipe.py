"""Reading one file through its shell pipeline: ``<download_cmd> <file> | <pipe_command>``.

Both commands are real shell commands (``/bin/sh -c``), started as two processes joined by a
pipe, as in the reference (``cat part-0 | python reader.py``). The output is handed on in chunks
of whole lines. When the output ends, both exit statuses are checked: a command that failed
(not found, a traceback in the generator, a missing file) is a :class:`PipeCommandError` naming
the file, the command and the end of its stderr, never a silently shorter file. A reader that
stops early (an error elsewhere, a consumer that broke off) kills both processes.
"""
from __future__ import annotations

import select
import shlex
import signal
import subprocess
import tempfile
import time
from typing import IO, Any, Callable, Iterator, Optional

from fleetx.data import processes
from fleetx.data.api import PipeCommandError, PipeTimeoutError

__all__ = ["read_lines", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20   # a chunk of output parsed at once: large enough to amortise each call
_STDERR_TAIL = 2000     # bytes of a failed command's stderr kept in the error
# How a download command ends when the pipe command legitimately stopped reading early
# (``head -n 100``): SIGPIPE, seen directly or through the shell (128 + 13).
_SIGPIPE = {-signal.SIGPIPE, 128 + signal.SIGPIPE}


def read_lines(path: str, download_cmd: str, pipe_command: str,
               chunk_bytes: int = CHUNK_BYTES, tracker: Optional[Any] = None,
               timeout: Optional[float] = None) -> Iterator[tuple]:
    """Yield ``(first_line, data)``: the pipeline's output as chunks of whole lines (the last
    one gets a newline if it lacked one); ``first_line`` numbers the chunk's first line from 1.
    ``tracker`` (optional): ``add(process, stop)`` and ``discard(process)`` are told about the
    two processes, so that a reader stopping from outside can kill them. ``timeout``: seconds
    the commands may stay silent (None: no limit).

    Raises:
        PipeTimeoutError: nothing came for ``timeout`` seconds, or a command ended its output
            but did not exit within ``timeout`` seconds (both commands are killed).
        PipeCommandError: a command exited non-zero (or could not be started); raised after the
            output was consumed, so the samples read before it are never taken for the whole.
    """
    download = f"{download_cmd} {shlex.quote(path)}"
    with tempfile.TemporaryFile() as err_dl, tempfile.TemporaryFile() as err_pipe:
        # in the worker's process group and killed with this thread (fleetx.data.processes)
        first = processes.start(download, shell=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err_dl)
        try:
            second = processes.start(pipe_command, shell=True, stdin=first.stdout,
                                     stdout=subprocess.PIPE, stderr=err_pipe)
        except BaseException:
            processes.stop_tree(first)
            raise
        finally:
            first.stdout.close()  # the pipe command holds the read end now
        if tracker is not None:
            tracker.add(first, processes.stop_tree)
            tracker.add(second, processes.stop_tree)
        finished = False
        try:
            yield from _chunks(second.stdout, chunk_bytes, lambda: PipeTimeoutError(
                path, f"{download} | {pipe_command}", timeout), timeout)
            finished = True
        finally:
            if not finished:
                processes.stop_tree(second)
                processes.stop_tree(first)
            second.stdout.close()
            if tracker is not None:
                tracker.discard(first)
                tracker.discard(second)
        _check(path, [(download, first, err_dl), (pipe_command, second, err_pipe)], timeout)


def _chunks(out: IO[bytes], chunk_bytes: int, silent: Callable[[], Exception],
            timeout: Optional[float] = None) -> Iterator[tuple]:
    """Whole lines as they come: a chunk grows to ``chunk_bytes`` while output keeps flowing,
    and is handed on as soon as the command pauses (a slow generator's lines are not held back
    until a full chunk is there). ``silent()`` is raised after ``timeout`` s without output."""
    # poll, not select: a process with more than 1024 open files still reads its pipes
    poller = select.poll()
    poller.register(out, select.POLLIN | select.POLLHUP | select.POLLERR)
    line, rest, ended = 1, b"", False
    while not ended:
        if timeout is not None and not poller.poll(timeout * 1000):
            raise silent()
        parts = [rest, out.read1(chunk_bytes)]  # output (or its end) is there
        size, ended = sum(map(len, parts)), not parts[1]
        while not ended and size < chunk_bytes and poller.poll(0):
            parts.append(out.read1(chunk_bytes - size))
            size, ended = size + len(parts[-1]), not parts[-1]
        data = b"".join(parts)
        cut = data.rfind(b"\n") + 1
        if cut:
            yield line, data[:cut]
            line += data.count(b"\n", 0, cut)
        rest = data[cut:]
    if rest:
        yield line, rest + b"\n"


def _check(path: str, commands: list, timeout: Optional[float]) -> None:
    """Wait for both commands; raise for the download command if it failed (it comes first:
    a pipe command that saw no input often fails as a consequence), else for the pipe command.
    A download stopped by SIGPIPE (the pipe command stopped reading) is no failure of its own.
    A command that ended its output but does not exit within ``timeout`` s (None: no limit)
    hangs on its way out: both are killed, a :class:`PipeTimeoutError` names it."""
    (download, first, err_dl), (pipe_command, second, err_pipe) = commands
    deadline = None if timeout is None else time.monotonic() + timeout
    statuses = []
    for command, process in ((pipe_command, second), (download, first)):
        try:
            statuses.append(process.wait(None if deadline is None else
                                         max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            processes.stop_tree(second)
            processes.stop_tree(first)
            raise PipeTimeoutError(path, command, timeout, after_output=True) from None
    pipe_status, download_status = statuses
    if download_status != 0 and download_status not in _SIGPIPE:
        raise PipeCommandError(path, download, download_status, _tail(err_dl))
    if pipe_status != 0:
        raise PipeCommandError(path, pipe_command, pipe_status, _tail(err_pipe))


def _tail(err: IO[bytes]) -> str:
    err.seek(0, 2)
    size = err.tell()
    err.seek(max(0, size - _STDERR_TAIL))
    return err.read().decode(errors="replace")
