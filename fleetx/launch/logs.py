"""The log folder: ``workerlog.N`` per global rank, ``endpoints.log``, and showing rank 0 live.

Each process writes its own stdout and stderr into ``workerlog.<global rank>`` (the bootstrap
points both file descriptors there, so nothing passes through the launcher). The launcher
follows rank 0's file and copies it to its own stdout as it grows.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections import deque
from typing import BinaryIO, Optional

from fleetx.launch.api import LaunchError

__all__ = ["describe_exit", "prepare_dir", "worker_log", "endpoints_log", "write_endpoints", "last_lines",
           "shown_above", "LogFollower"]


def prepare_dir(log_dir: str) -> None:
    """Create the log folder if needed and check that files can be written in it.

    Raises:
        LaunchError: the folder cannot be created or written (the message names it and why).
    """
    try:
        os.makedirs(log_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fleetrun-probe-", dir=log_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise LaunchError(f"--log_dir {log_dir}: cannot write the logs there: "
                          f"{exc.strerror or exc}") from None


def worker_log(log_dir: str, rank: int) -> str:
    """Path of the log of global rank ``rank``."""
    return os.path.join(log_dir, f"workerlog.{rank}")


def endpoints_log(log_dir: str) -> str:
    return os.path.join(log_dir, "endpoints.log")


def write_endpoints(log_dir: str, endpoints: list[str]) -> None:
    """Rewrite ``endpoints.log``: a header line, then one endpoint per line."""
    with open(endpoints_log(log_dir), "w") as f:
        f.write("PADDLE_TRAINER_ENDPOINTS: \n" + "\n".join(endpoints) + "\n")


def last_lines(path: str, count: int = 20) -> list[str]:
    """The last ``count`` lines of a text file (empty if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=count)]
    except OSError:
        return []


def shown_above(header: str, path: str) -> list[str]:
    """The failure report of a log that was shown live: where it is and its last line only (a
    traceback already on the screen is not printed twice)."""
    last = next((line for line in reversed(last_lines(path)) if line.strip()), "(empty)")
    return [f"{header}; its output is shown above (log: {path}), ending with:", f"    {last}"]


class LogFollower:
    """Copies a log file to a stream as it grows, from a background thread.

    A file that already exists when the follower starts belongs to an earlier job and is
    skipped; the bootstrap replaces it with a new file, which is followed from its first byte.
    The follower keeps the old file open until then, so the new file cannot reuse its inode
    number (which is how the two are told apart). Appends to the followed file (a restarted
    worker group) keep flowing.

    Example:
        >>> follower = LogFollower("log/workerlog.0", sys.stdout.buffer).start()
        >>> ...  # run the job
        >>> follower.stop()  # copies what is left, then returns
    """

    def __init__(self, path: str, out: BinaryIO, interval: float = 0.1) -> None:
        self._path, self._out, self._interval = path, out, interval
        try:
            self._stale: Optional[BinaryIO] = open(path, "rb")
        except OSError:
            self._stale = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetrun-log", daemon=True)

    def _inode(self) -> Optional[int]:
        try:
            return os.stat(self._path).st_ino
        except OSError:
            return None

    def start(self) -> "LogFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._stale:
            self._stale.close()

    def _run(self) -> None:
        f, inode = None, None
        stale = os.fstat(self._stale.fileno()).st_ino if self._stale else None
        try:
            while True:
                stopping = self._stop.is_set()
                current = self._inode()
                if current is not None and current != stale and current != inode:
                    if f:
                        self._copy(f)
                        f.close()
                    try:
                        f = open(self._path, "rb")
                    except OSError:  # replaced again meanwhile: next round
                        f = None
                    inode = os.fstat(f.fileno()).st_ino if f else None
                if f:
                    self._copy(f)
                if stopping:
                    return
                self._stop.wait(self._interval)
        finally:
            if f:
                f.close()

    def _copy(self, f: BinaryIO) -> None:
        while chunk := f.read(1 << 16):
            self._out.write(chunk)
        self._out.flush()


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``was killed by signal SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
