"""What several test folders share (no tests here): loopback ports, an example's modules, a
finished request, and processes forked from a server that imported torch and fleetx once.

Import it as the tests import their neighbours, by putting this folder on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import free_ports
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import multiprocessing
import os
import random
import runpy
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Iterator


#: the first port of the range of pytest-xdist's worker gw0; worker gwN takes the N-th block of
#: _BLOCK ports after it. All lie below the kernel's ephemeral range (32768-60999 on Linux), which
#: it hands to connect() and bind(port 0): a port given out here is never some other test's
#: outgoing connection, nor a port another worker gives out, between its release and its use.
_FIRST, _BLOCK = 12000, 2000
_next: list[int] = []


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every address: a listener on any of them takes the port
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free a moment ago, from this test process's own block (its pytest-xdist
    worker's), handed out in turn so that none comes back soon."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    low = _FIRST + _BLOCK * ((int(worker) if worker.isdigit() else 0) % 10)
    if not _next:
        _next.append(low + random.randrange(_BLOCK))
    ports: list[int] = []
    for _ in range(_BLOCK):
        port = low + (_next[0] - low) % _BLOCK
        _next[0] = port + 1
        if _is_free(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports in {low}-{low + _BLOCK - 1}")


def free_port() -> int:
    """One loopback port that was free a moment ago."""
    return free_ports(1)[0]


@contextlib.contextmanager
def example_modules(folder: Path) -> Iterator[None]:
    """Import an example's modules by their plain names (``import data``, ``import model``)
    inside the block, whatever another example of the same module names left in
    ``sys.modules``; the previous modules and ``sys.path`` come back afterwards."""
    names = {p.stem for p in Path(folder).glob("*.py")}
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n in names}
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


class Done:
    """A client request that has finished with ``result`` already (``wait`` returns it at
    once), for fakes of the parameter-server client."""

    def __init__(self, result) -> None:
        self.result = result

    def wait(self, timeout=None):
        return self.result

    def done(self) -> bool:
        return True


#: what the fork server of :func:`preloaded` imports once, so the processes it forks start with
#: torch and fleetx loaded (a fresh interpreter spends about three CPU seconds importing them)
PRELOAD = ["torch", "torch.distributed", "fleetx.fleet", "fleetx.parallel", "fleetx.metrics"]
# the Hugging Face models the tests build (tests/hf_models.py), about four CPU seconds to import
if importlib.util.find_spec("transformers") is not None:
    PRELOAD += ["transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def preloaded():
    """The ``multiprocessing`` context whose processes are forked from a fork server that
    imported :data:`PRELOAD` (it starts at its first use in this process and stays). The server
    never runs a tensor operation, so no thread pool exists when it forks."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def as_if_spawned_from(parent: int, environ: dict) -> None:
    """Make a process forked from the fork server look like one the test ``parent`` started:
    its environment now (not the server's, from the server's start) and its stdout and stderr
    (pytest's capture of the test running now, so the output shows where the test fails)."""
    os.environ.clear()
    os.environ.update(environ)
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{parent}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)


@functools.lru_cache(maxsize=None)
def _fresh_path(pythonpath: str) -> tuple:
    """``sys.path`` of a fresh interpreter after its first entry, under ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                         env=env, capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.loads(out.stdout))


def _script_main(argv: list, cwd: str, environ: dict, out: str, err: str, path: list) -> None:
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = list(argv)
    sys.path[:] = path
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # as the interpreter does: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # an interpreter's exit runs them; multiprocessing's does not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Script:
    """``subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE
    or STDOUT, text=True)`` in a process forked from :func:`preloaded`'s server: the script runs
    as ``__main__`` with the same ``sys.argv``, ``sys.path`` (its folder, then ``PYTHONPATH``,
    then the interpreter's own), working directory, environment and exit status as under a
    fresh interpreter, but torch and fleetx are imported already. The output goes to files,
    read by :meth:`communicate`.

    Args:
        argv: the script (relative to ``cwd`` or absolute) and its arguments.
        merged: stderr goes with stdout (``stderr=STDOUT``); :meth:`communicate` returns None
            for it.
    """

    def __init__(self, argv: list, cwd, env: dict, merged: bool = False) -> None:
        script = Path(cwd, argv[0]).resolve()
        path = [str(script.parent), *_fresh_path(env.get("PYTHONPATH", ""))]
        self.args = [sys.executable, *map(str, argv)]
        self._tmp = tempfile.TemporaryDirectory()
        self._out = os.path.join(self._tmp.name, "stdout")
        self._err = self._out if merged else os.path.join(self._tmp.name, "stderr")
        self._merged = merged
        self._proc = preloaded().Process(
            target=_script_main,
            args=([str(script), *map(str, argv[1:])], str(cwd), dict(env), self._out, self._err,
                  path))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self):
        return self._proc.exitcode

    def poll(self):
        return self._proc.exitcode

    def wait(self, timeout=None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()

    terminate = kill

    def communicate(self, timeout=None):
        """Wait (``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process left
        running, as Popen's) and return ``(stdout, stderr)``."""
        self.wait(timeout)
        out = Path(self._out).read_text(errors="replace")
        err = None if self._merged else Path(self._err).read_text(errors="replace")
        self._tmp.cleanup()
        return out, err


def run_script(argv: list, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)`` as a :class:`Script`.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds (it is killed).
    """
    proc = Script(argv, cwd, env)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
