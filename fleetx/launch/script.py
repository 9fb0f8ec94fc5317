"""Run a user's script as ``python script.py`` would, and end the process without interpreter
teardown.

Why: a backward pass leaves a ``contextvars.Context`` in the C++ state of the autograd work it
launches, and DDP's gloo all-reduce runs inside backward, so gloo's worker threads
(``pt_gloo_runloop``) hold Python objects. When such a thread drops the last reference after the
main thread has begun interpreter shutdown, it is forced to exit inside a C++ destructor and the
process dies of ``std::terminate`` (SIGABRT, "terminate called without an active exception"),
in about one run of four when the ranks of a job end at different moments. Destroying the
process groups does not stop those threads, so no teardown order helps; never starting the
interpreter's teardown does.

:func:`run_script` therefore does, after the script returns, what Python's own exit does first
— wait for non-daemon threads, run the ``atexit`` handlers, flush every open file — and then
ends the process with ``os._exit``. The script's exit status is kept: ``sys.exit(n)`` exits
``n``, ``sys.exit("text")`` prints the text and exits 1, an uncaught exception prints its
traceback and exits 1, and Ctrl-C still ends the process by SIGINT.

Both fleetrun's bootstrap and ``python -m fleetx.run`` (for torchrun, srun, mpirun) use it.
"""
from __future__ import annotations

import atexit
import gc
import io
import os
import runpy
import signal
import sys
import threading
from typing import NoReturn, Optional, Sequence

__all__ = ["run_script", "exit_cleanly", "entrypoint_problem"]


def entrypoint_problem(target: str, module: bool = False) -> Optional[str]:
    """What keeps ``target`` from being run, or None: a script path that is not a file, or a
    module whose top-level package is on neither the current folder nor ``sys.path`` (found
    without importing anything, so no package code runs in the launcher).

    Example:
        >>> entrypoint_problem("no_such_script.py")
        'no_such_script.py: no such file'
    """
    if not module:
        return None if os.path.isfile(target) else f"{target}: no such file"
    from importlib.machinery import PathFinder

    if target.endswith(".py"):
        return (f"{target}: -m takes a module name, not a file: drop -m, or give the module's "
                f"dotted name (such as mypkg.train)")
    top = target.split(".")[0]
    if not top.isidentifier() or not all(part.isidentifier() for part in target.split(".")):
        return f"{target}: not a module name (expected a dotted name such as mypkg.train)"
    if PathFinder.find_spec(top, [os.getcwd(), *sys.path[1:]]) is None:
        return (f"no module named {top!r} in the current folder ({os.getcwd()}) or on "
                f"sys.path; run fleetrun from the folder that holds it, or install it")
    return None


def run_script(target: str, args: Sequence[str], module: bool = False) -> NoReturn:
    """Run ``target`` (a path, or a module name with ``module=True``) as ``__main__`` with
    ``sys.argv = [target, *args]``, then end the process with :func:`exit_cleanly`.

    Args:
        target: the script's path, or the module's dotted name.
        args: the script's command-line arguments.
        module: run ``target`` as ``python -m target`` would.
    """
    code, keep = 0, None
    sys.argv = [target, *args]
    try:
        # Hold the script's globals (or, on an error, its frames) until the end, as `python`
        # holds __main__: a file the script left open is flushed, not finalised half-written.
        if module:
            keep = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            keep = runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code, keep = _exit_status(exc.code), exc
    except KeyboardInterrupt as exc:
        _print_exception(exc, None if module else target)
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # die of SIGINT, as Python does
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)  # not reached: SIGINT ends the process
    except BaseException as exc:  # noqa: BLE001 - report it as the interpreter would
        _print_exception(exc, None if module else target)
        code, keep = 1, exc
    exit_cleanly(code)


def exit_cleanly(code: int = 0) -> NoReturn:
    """End the process with ``code`` as a normal exit would, without interpreter teardown:
    non-daemon threads joined, ``atexit`` handlers run, open files flushed, then ``os._exit``."""
    try:
        _finish()
    except BaseException as exc:  # noqa: BLE001 - an atexit failure must still end the process
        _print_exception(exc, None)
        code = code or 1
    os._exit(code)


def _finish() -> None:
    _join_threads()
    # atexit runs handlers itself and prints (not raises) their errors, as at a normal exit.
    atexit._run_exitfuncs()
    _flush_open_files()


def _join_threads() -> None:
    """What the interpreter does first at exit: wait for every non-daemon thread (and run the
    hooks that ``concurrent.futures`` registers to stop its workers)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # pragma: no cover - interpreters without the hook
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _flush_open_files() -> None:
    """``os._exit`` skips finalizers: flush every file object still open (a script's module-level
    ``open(..., "w")`` that was never closed), then the standard streams. No garbage collection
    first: collecting a file's wrapper and its raw file in one cycle may close the raw file
    before the wrapper's buffer is written."""
    for obj in gc.get_objects():
        # issubclass on the type: isinstance would read obj.__class__, and some objects warn
        # when touched (torch.distributed.reduce_op)
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                continue
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            continue


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives: None is 0, an int is itself, anything else is
    printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _print_exception(exc: BaseException, script: Optional[str]) -> None:
    """The traceback from the script's first frame on, as ``python script.py`` prints it;
    without a script (a module), from the first frame outside this file and :mod:`runpy`."""
    tb = exc.__traceback__
    if script is not None:
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
    else:
        # runpy's frames are named "<frozen runpy>" on interpreters that freeze it
        ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
        while tb is not None and (tb.tb_frame.f_code.co_filename in ours or os.path.abspath(
                tb.tb_frame.f_code.co_filename) in ours):
            tb = tb.tb_next
        tb = tb or exc.__traceback__
    if tb is not None:
        exc = exc.with_traceback(tb)  # newer interpreters print exc.__traceback__, not the arg
    sys.excepthook(type(exc), exc, exc.__traceback__)
