"""Saves that finish on a background thread: the handle ``fleet.save_checkpoint`` returns.

An asynchronous save does its collective part in the call (the entry, the save id, the copy of
each rank's share of the state into CPU memory) and its writing, hashing and commit on one
thread of its own, :func:`start`. Its :class:`SaveHandle` says whether it is finished
(:meth:`~SaveHandle.done`) and waits for it, raising its error (:meth:`~SaveHandle.wait`). A
synchronous save returns a handle that is finished already (:func:`finished`).

The thread is a daemon: a process that ends does not wait for it by itself, the fleet does
(``fleet.load_checkpoint``, the next save and the exit of the process wait for a pending save),
so that a save is never cut short by an exit that did not ask for it.

Example:
    >>> handle = start("ckpt", lambda: "written")
    >>> handle.wait()
    'written'
    >>> handle.done()
    True
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional

from fleetx.checkpoint.api import CheckpointError

__all__ = ["SaveHandle", "start", "finished"]


class SaveHandle:
    """A save to ``path``, finished or under way on a background thread.

    Args:
        path: the checkpoint folder the save writes (named in its error).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._finished = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._raised = False  # wait() raised the error: the fleet does not raise it again

    def done(self) -> bool:
        """True once the save has finished, committed or failed.

        Example:
            >>> finished("ckpt", None).done()
            True
        """
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait until the save has finished; return the committed manifest.

        Args:
            timeout: seconds to wait at most (None: until it finishes; the save's own
                collectives are bounded by ``FLEETX_TIMEOUT``).

        Raises:
            CheckpointError: the save failed (the message names ``path`` and the cause; the
                previous checkpoint there stays loadable), or is not finished within
                ``timeout`` seconds.

        Example:
            >>> finished("ckpt", "manifest").wait()
            'manifest'
        """
        if not self._finished.wait(timeout):
            raise CheckpointError(f"the asynchronous save to {self.path} did not finish within "
                                  f"{timeout} s", self.path)
        if self._error is not None:
            self._raised = True
            error = self._error
            path = getattr(error, "path", None) or self.path
            raise CheckpointError(f"the save to {self.path} failed: {error}", path) from error
        return self._result

    def settle(self) -> None:
        """Wait until the save has finished; raise its error unless :meth:`wait` raised it
        already (what the fleet calls before the next save, a load, and at exit)."""
        self._finished.wait()
        if not self._raised:
            self.wait()

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._finished.set()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "writing"
        return f"<SaveHandle {self.path!r} {state}>"


def start(path: str, write: Callable[[], Any],
          then: Optional[Callable[[Any], None]] = None) -> SaveHandle:
    """Run ``write()`` on a new background thread; its handle.

    Args:
        path: the checkpoint folder (for the handle and its error).
        write: the work; what it returns is what :meth:`SaveHandle.wait` returns.
        then: called on the thread with that result when ``write`` succeeded.
    """
    handle = SaveHandle(path)

    def run() -> None:
        _yield_to_training()
        try:
            result = write()
            if then is not None:
                then(result)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            handle._finish(error=exc)
        else:
            handle._finish(result)

    threading.Thread(target=run, name=f"fleetx-save {path}", daemon=True).start()
    return handle


def _yield_to_training() -> None:
    """Run this thread at the lowest priority (nice 19; Linux sets it per thread): it takes the
    CPU the training loop leaves (its waits for communication and data) first, and about 1.5 %
    of a core the training keeps busy, so it still finishes within the save's timeouts.
    (``SCHED_IDLE`` measured no better and can starve it.)"""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:  # not permitted here: the thread keeps the ordinary policy
        pass


def finished(path: str, result: Any) -> SaveHandle:
    """A handle of a save that is finished already (a synchronous save)."""
    handle = SaveHandle(path)
    handle._finish(result)
    return handle
