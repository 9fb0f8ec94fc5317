"""``thread_num`` parallel readers: each takes the next file, pipes it through its commands and
parses the output; the dataset receives the samples file by file, in the file list's order.

Two kinds of reader, the same results (a test runs both on the same files):

* ``"thread"``: reader threads in this process. The pipe commands are processes anyway, and the
  C parser releases the GIL, so threads read in parallel without copying samples between
  processes. The default when the C parser is built.
* ``"process"``: reader processes (``reader_process.py``), each parsing in its own interpreter
  and sending packed blocks back over a pipe (raw arrays, no pickle). The default with the numpy
  parser, which holds the GIL for much of its work.

``benchmarks/dataset.py`` measures both; docs/datasets.md has the choice and why. Both read a
file the same way, :func:`~fleetx.data.reading.read_file` (``reading.py``, re-exported here with
:class:`ReadOptions` and :class:`Abandoned`).

Files are handed out in list order; a file's chunks wait in a queue of their own until the
dataset takes them, so the samples arrive in file order whatever the readers' speeds. With
``bound`` (a streaming QueueDataset) each queue holds at most that many chunks and a reader
ahead of the consumer waits: memory stays bounded.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

from fleetx.data.api import DataError
from fleetx.data.block import SampleBlock
from fleetx.data.parse import backend
from fleetx.data.reader_process import ProcessReader
from fleetx.data.reading import Abandoned, ReadOptions, read_file

__all__ = ["ReadOptions", "ParallelReader", "default_kind", "READER_KINDS", "read_file",
           "progress_printer", "Abandoned"]

READER_KINDS = ("thread", "process")
_POLL_S = 0.2  # how often a waiting reader looks whether the read was abandoned


def default_kind(parser: Optional[str] = None) -> str:
    """``"thread"`` with the C parser (it runs without the GIL), else ``"process"``."""
    return "thread" if (parser or backend()) == "c" else "process"


@dataclass
class _Chunk:
    block: SampleBlock
    lines: int


@dataclass
class _Done:
    skipped: int


@dataclass
class _Failed:
    error: BaseException


class ParallelReader:
    """Read ``files`` with ``readers`` readers; iterate ``(file_index, block)`` in file order.

    Attributes:
        lines: lines of pipe output received so far.
        skipped: malformed lines skipped so far (``skip_bad_lines``).
        files_done: files read completely so far.

    Raises (while iterating):
        PipeCommandError, BadLineError, DataError: the first failure, in file order; the
            other readers are stopped.
    """

    def __init__(self, files: Sequence[str], options: ReadOptions, readers: int = 1,
                 kind: Optional[str] = None, bound: int = 0) -> None:
        kind = kind or default_kind(options.parser)
        if kind not in READER_KINDS:
            raise ValueError(f"reader kind must be one of {list(READER_KINDS)}, got {kind!r}")
        self.files, self.options, self.kind = list(files), options, kind
        self.readers = max(1, min(int(readers), len(self.files) or 1))
        self.lines = self.skipped = self.files_done = 0
        self._queues = [queue.Queue(bound) for _ in self.files]
        self._next, self._lock = 0, threading.Lock()
        self._stop = threading.Event()
        self._workers: list = []
        self._active: dict = {}  # running processes -> how to stop them (close() does)

    def take(self) -> Optional[int]:
        """The next file index to read, or None when all are handed out or reading stopped."""
        with self._lock:
            if self._stop.is_set() or self._next >= len(self.files):
                return None
            self._next += 1
            return self._next - 1

    def _put(self, index: int, item: object) -> bool:
        """Queue ``item`` for file ``index``; False when reading was abandoned meanwhile."""
        while not self._stop.is_set():
            try:
                self._queues[index].put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def emitter(self, index: int) -> Callable:
        """``emit(block, lines)`` queueing file ``index``'s chunks; it raises
        :class:`Abandoned` once the consumer has stopped."""
        def emit(block: SampleBlock, lines: int) -> None:
            if not self._put(index, _Chunk(block, lines)):
                raise Abandoned
        return emit

    def done(self, index: int, skipped: int) -> None:
        self._put(index, _Done(skipped))

    def failed(self, index: int, error: BaseException) -> None:
        self._put(index, _Failed(error))

    def add(self, process: object, stop: Callable) -> None:
        """Track a running process; :meth:`close` calls ``stop(process)`` if it still runs.
        A process started after close() is stopped at once."""
        with self._lock:
            self._active[process] = stop
            stopped = self._stop.is_set()
        if stopped:
            stop(process)

    def discard(self, process: object) -> None:
        with self._lock:
            self._active.pop(process, None)

    def _thread_main(self) -> None:
        while (index := self.take()) is not None:
            try:
                self.done(index, read_file(self.files[index], self.options,
                                           self.emitter(index), self))
            except Abandoned:
                return
            except BaseException as exc:  # handed to the consumer, raised there
                self.failed(index, exc)
                return

    def start(self) -> "ParallelReader":
        if self.kind == "thread":
            target = self._thread_main
        else:
            target = ProcessReader(self).run
        for i in range(self.readers if self.files else 0):
            worker = threading.Thread(target=target, name=f"fleetx-data-reader-{i}",
                                      daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __iter__(self) -> Iterator[tuple]:
        if not self._workers and self.files:
            self.start()
        try:
            for index, q in enumerate(self._queues):
                while True:
                    item = self._get(index, q)
                    if isinstance(item, _Failed):
                        raise item.error
                    if isinstance(item, _Done):
                        self.skipped += item.skipped
                        self.files_done += 1
                        break
                    self.lines += item.lines
                    yield index, item.block
        finally:
            self.close()

    def _get(self, index: int, q: queue.Queue) -> object:
        """The next item of file ``index``; an error if every reader ended without one (a bug
        that would otherwise be a hang)."""
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(w.is_alive() for w in self._workers) and q.empty():
                    raise DataError(f"the readers ended without finishing "
                                    f"{self.files[index]}") from None

    def close(self) -> None:
        """Stop every reader, killing the commands they run, and wait for them."""
        with self._lock:
            self._stop.set()
            running = list(self._active.items())
        for process, stop in running:
            stop(process)  # a reader blocked on a slow command's output wakes up now
        for worker in self._workers:
            worker.join()
        self._workers = []


def progress_printer(interval: float, what: str, out: Callable = print) -> Callable:
    """A callback ``(reader) -> None`` printing ``lines/s`` at most every ``interval`` s."""
    start = last = time.monotonic()

    def report(reader: ParallelReader, final: bool = False) -> None:
        nonlocal last
        now = time.monotonic()
        if interval <= 0 or (now - last < interval and not (final and last > start)):
            return
        last = now
        rate = reader.lines / max(now - start, 1e-9)
        out(f"fleetx data: {what}: {reader.lines} lines from {reader.files_done}/"
            f"{len(reader.files)} files in {now - start:.1f} s, {rate:.0f} lines/s"
            + (f", {reader.skipped} bad lines skipped" if reader.skipped else ""), flush=True)
    return report

