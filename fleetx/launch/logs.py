"""The log folder: ``workerlog.N`` per global rank, ``endpoints.log``, showing chosen ranks
live, and moving an earlier job's files aside.

Each process writes its own stdout and stderr into ``workerlog.<global rank>`` (the bootstrap
points both file descriptors there, so nothing passes through the launcher). The launcher
follows the files of the ranks it shows (rank 0 unless ``--log_ranks`` / ``--tee`` say
otherwise) and copies them to its own stdout as they grow.

Before a job starts, the files an earlier job left in the folder are moved to
``<log_dir>/earlier/<date>/`` (:func:`archive_earlier`): after a 4-process job, a 2-process one
must not leave ``workerlog.2`` and ``workerlog.3`` beside its own as if they were current.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from typing import BinaryIO, Optional

from fleetx.launch.api import LaunchError

__all__ = ["describe_exit", "prepare_dir", "worker_log", "endpoints_log", "write_endpoints",
           "last_lines", "shown_above", "LogFollower", "archive_earlier", "EARLIER_DIR",
           "KEEP_EARLIER"]

#: The sub-folder of the log folder that holds earlier jobs' files, one dated folder per job.
EARLIER_DIR = "earlier"
#: How many earlier jobs' folders are kept; older ones are removed (with a notice).
KEEP_EARLIER = 5
# Every file a job writes in the log folder (fault.N.json: fleetx.comm's blame reports;
# steptimes.N: the step-time histograms of the summary's p50/p99; throughput.N, scalars.N.csv:
# fleet.observe's samples/s for the end-of-job summary and its
# scalars when no scalars_dir was given).
_JOB_FILE = re.compile(r"^(workerlog\.\d+|serverlog\.\d+|heterlog\.\d+|endpoints\.log|"
                       r"fault\.\d+\.json|progress\.\d+|steptimes\.\d+|throughput\.\d+|scalars\.\d+\.csv)$")


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


def archive_earlier(log_dir: str, keep: int = KEEP_EARLIER) -> list[str]:
    """Move the files an earlier job left in ``log_dir`` to ``<log_dir>/earlier/<date>/`` (the
    date of the newest of them, when that job last wrote), then remove all but the ``keep``
    newest such folders; returns one notice line per action (none when the folder was clean).

    Raises:
        LaunchError: a file cannot be moved or a folder removed (the message names it).
    """
    try:
        names = sorted(n for n in os.listdir(log_dir) if _JOB_FILE.match(n)
                       and os.path.isfile(os.path.join(log_dir, n)))
    except FileNotFoundError:
        return []
    if not names:
        return []
    newest = max(os.path.getmtime(os.path.join(log_dir, n)) for n in names)
    earlier = os.path.join(log_dir, EARLIER_DIR)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))
    dest, suffix = os.path.join(earlier, stamp), 1
    while os.path.exists(dest):  # two jobs that ended in the same second
        dest, suffix = os.path.join(earlier, f"{stamp}-{suffix}"), suffix + 1
    try:
        os.makedirs(dest)
        for name in names:
            os.replace(os.path.join(log_dir, name), os.path.join(dest, name))
    except OSError as exc:
        raise LaunchError(f"--log_dir {log_dir}: cannot move the earlier job's logs to {dest}: "
                          f"{exc.strerror or exc}") from None
    notes = [f"moved {len(names)} file(s) of an earlier job ({_summary(names)}) from {log_dir} "
             f"to {dest}"]
    return notes + _prune(earlier, keep)


def _summary(names: list[str]) -> str:
    shown = ", ".join(names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _prune(earlier: str, keep: int) -> list[str]:
    folders = sorted(n for n in os.listdir(earlier) if os.path.isdir(os.path.join(earlier, n)))
    old = folders[:max(0, len(folders) - keep)]
    for name in old:
        try:
            shutil.rmtree(os.path.join(earlier, name))
        except OSError as exc:
            raise LaunchError(f"cannot remove {os.path.join(earlier, name)}: "
                              f"{exc.strerror or exc}") from None
    return [f"removed {len(old)} older job folder(s) from {earlier} ({', '.join(old)}); the "
            f"newest {keep} are kept"] if old else []


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


_ERROR_LINE = re.compile(r"^(fleetx: |[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b)")


def error_line(path: str, limit: int = 300) -> str:
    """The last line of a log that states an error (the last line of a traceback, or a
    ``fleetx:`` note naming a peer), cut to ``limit`` characters; "" when there is none."""
    line = next((l.strip() for l in reversed(last_lines(path, 60)) if _ERROR_LINE.match(l)), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def shown_above(header: str, path: str) -> list[str]:
    """The failure report of a log that was shown live: where it is and its last line only (a
    traceback already on the screen is not printed twice)."""
    last = next((line for line in reversed(last_lines(path)) if line.strip()), "(empty)")
    return [f"{header}; its output is shown above (log: {path}), ending with:", f"    {last}"]


class LogFollower:
    """Copies a log file to a stream as it grows, from a background thread; with a ``prefix``,
    line by line, each line starting with it (several followers share one stream: a line is
    written whole, under a lock).

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

    _lock = threading.Lock()  # one line at a time on a stream that several followers share

    def __init__(self, path: str, out: BinaryIO, interval: float = 0.1,
                 prefix: Optional[str] = None) -> None:
        self._path, self._out, self._interval = path, out, interval
        self._prefix = prefix.encode() if prefix is not None else None
        self._pending = b""
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
                    self._write(b"", last=True)
                    return
                self._stop.wait(self._interval)
        finally:
            if f:
                f.close()

    def _copy(self, f: BinaryIO) -> None:
        while chunk := f.read(1 << 16):
            self._write(chunk)

    def _write(self, chunk: bytes, last: bool = False) -> None:
        if self._prefix is None:
            data = chunk
        else:
            # Whole lines only, so that ranks shown together never split each other's lines;
            # a last line without its newline is written when the follower stops.
            lines = (self._pending + chunk).split(b"\n")
            self._pending = b"" if last else lines.pop()
            data = b"".join(self._prefix + line + b"\n" for line in lines if line or not last)
        if data:
            with self._lock:
                self._out.write(data)
                self._out.flush()


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``was killed by signal SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
