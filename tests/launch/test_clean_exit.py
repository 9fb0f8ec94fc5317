"""A script that returns normally exits 0, every time, under fleetrun and under
``python -m fleetx.run``; exit codes, exceptions, threads, atexit handlers and open files behave
as under plain ``python``.

The repeated runs are the proof that the exit-time SIGABRT of torch's gloo threads is gone
(ranks that end at different moments: one saves, the other just ends, no final barrier); they take
a few minutes and run in the slow stage.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_fleetrun import fleetrun_cmd  # tests/launch is on sys.path (rootdir-less layout)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_ABORT = "terminate called"


def run_module(tmp_path: Path, body: str, *args: str, timeout: float = 60):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, "-m", "fleetx.run", str(script), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


# -- exit semantics of python -m fleetx.run (and of the bootstrap, which shares the code) --------
def test_exit_code_of_sys_exit_is_kept(tmp_path):
    assert run_module(tmp_path, "import sys\nsys.exit(int(sys.argv[1]))\n", "7").returncode == 7
    assert run_module(tmp_path, "import sys\nsys.exit(None)\n").returncode == 0


def test_sys_exit_with_text_prints_it_and_exits_1(tmp_path):
    res = run_module(tmp_path, "import sys\nsys.exit('bad input file')\n")
    assert (res.returncode, res.stderr.strip()) == (1, "bad input file")


def test_uncaught_exception_prints_one_traceback_from_the_script(tmp_path):
    res = run_module(tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    assert res.returncode == 1
    assert res.stderr.count("Traceback") == 1
    assert "fleetx" not in res.stderr and "runpy" not in res.stderr  # the script's frames only
    assert res.stderr.rstrip().endswith("ValueError: boom")


def test_threads_atexit_and_unclosed_files_complete_before_the_exit(tmp_path):
    res = run_module(tmp_path, """
        import atexit, threading, time
        out = open("unclosed.txt", "w")           # never closed or flushed by the script
        out.write("all of it")
        atexit.register(lambda: print("atexit ran", flush=True))
        def late():
            time.sleep(0.5)
            open("thread.txt", "w").write("thread finished")
        threading.Thread(target=late).start()     # non-daemon: the exit waits for it
        """)
    assert res.returncode == 0, res.stderr
    assert "atexit ran" in res.stdout
    assert (tmp_path / "unclosed.txt").read_text() == "all of it"
    assert (tmp_path / "thread.txt").read_text() == "thread finished"


def test_the_interpreter_teardown_never_starts(tmp_path):
    """The fix itself, deterministically: the teardown in which torch's gloo threads abort is
    skipped. An object kept in sys.modules is finalised only by that teardown, so its __del__
    runs under plain python and never under fleetx.run."""
    body = """
        import sys
        class Witness:
            def __del__(self):
                print("teardown ran", flush=True)
        sys.modules["witness"] = Witness()
        """
    script = tmp_path / "witness.py"
    script.write_text(textwrap.dedent(body))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=60)
    assert "teardown ran" in plain.stdout  # the control: plain python tears down
    res = run_module(tmp_path, body)
    assert res.returncode == 0 and "teardown ran" not in res.stdout


def test_ctrl_c_ends_the_process_by_sigint(tmp_path):
    res = run_module(tmp_path, "raise KeyboardInterrupt\n")
    assert res.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in res.stderr


def test_module_form_and_usage(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(4)\n")
    res = subprocess.run([sys.executable, "-m", "fleetx.run", "-m", "mymod", "a", "b"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout.strip()) == (4, "args ['a', 'b']")
    res = subprocess.run([sys.executable, "-m", "fleetx.run"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "no script given" in res.stderr


# -- the real jobs -------------------------------------------------------------------------------
def _fleetrun_job(tmp_path: Path, *script_args: str) -> None:
    res = subprocess.run(fleetrun_cmd("--nproc_per_node", "2", SCRIPTS / "exit_after_save.py",
                                      *script_args), cwd=tmp_path, capture_output=True,
                         text=True, timeout=180)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert res.returncode == 0 and _ABORT not in logs, (
        f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}\n{logs[-3000:]}")
    assert (tmp_path / "model.pt.done").exists()


def test_ranks_that_end_apart_exit_zero(tmp_path):
    _fleetrun_job(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["data_parallel", "gradient_merge"])
def test_twenty_runs_all_exit_zero(tmp_path, variant):
    args = ("--gradient-merge",) if variant == "gradient_merge" else ()
    for i in range(20):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        _fleetrun_job(run_dir, *args)


_PLAIN_DDP = SCRIPTS / "plain_ddp_exit.py"


def _run_group(cmd, cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on a timeout kill the whole session, since
    torchrun's workers outlive a killed torchrun."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _torchrun_job(run_dir: Path) -> None:
    res = _run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                      "--standalone", "-m", "fleetx.run", str(_PLAIN_DDP)], run_dir)
    assert res.returncode == 0 and _ABORT not in res.stderr, (
        f"{run_dir.name}: exit {res.returncode}\n{res.stderr[-3000:]}")
    assert (run_dir / "model.pt").exists()


def test_plain_ddp_under_torchrun_with_fleetx_run_exits_zero(tmp_path):
    """The README's recipe for other launchers: ``torchrun ... -m fleetx.run script.py``."""
    _torchrun_job(tmp_path)


@pytest.mark.slow
def test_plain_ddp_under_torchrun_with_fleetx_run_exits_zero_twenty_times(tmp_path):
    """A plain DDP script without fleetx, which aborts at exit under bare torchrun now and
    then, started by torchrun through ``python -m fleetx.run``."""
    for i in range(20):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        _torchrun_job(run_dir)
