"""A worker killed while its dataset reads leaves no pipe command or reader process behind:
they stay in the worker's process group (the group kill of fleetrun's guardian takes them) and
die with their parent (PR_SET_PDEATHSIG) when the worker alone is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleetx.data import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

WORKER = textwrap.dedent("""
    import sys
    from fleetx.data import QueueDataset
    ds = QueueDataset()
    ds.init(batch_size=1, use_var=["ids"], pipe_command=sys.argv[3], reader=sys.argv[2])
    ds.set_filelist([sys.argv[1]])
    for batch in ds:
        pass
""")


def matching(text: str) -> list:
    """Living (not zombie) processes whose command line contains ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if text in args and state != "Z":
            found.append(int(pid))
    return found


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_and_kill(tmp_path: Path, kind: str, marker: str, kill) -> None:
    (tmp_path / "part-0").write_text("1 5\n")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    command = f"sleep {marker}; cat"
    # the worker leads a group of its own, as under fleetrun
    worker = subprocess.Popen([sys.executable, str(script), str(tmp_path / "part-0"), kind,
                               command], start_new_session=True)
    try:
        assert wait_for(lambda: matching(f"sh -c sleep {marker}"), 30), "no pipe command ran"
        kill(worker.pid)
        worker.wait(10)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    return command


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_killed_group_takes_the_pipe_commands(tmp_path, kind):
    marker = f"23.{os.getpid()}1"
    try:
        run_and_kill(tmp_path, kind, marker, lambda pid: os.killpg(pid, signal.SIGKILL))
        assert wait_for(lambda: not matching(marker), 5), matching(marker)
    finally:
        for pid in matching(marker):  # only what this test started
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_worker_killed_alone_takes_its_commands_and_readers(tmp_path, kind):
    marker = f"23.{os.getpid()}2"
    try:
        command = run_and_kill(tmp_path, kind, marker, lambda pid: os.kill(pid, signal.SIGKILL))
        # the shells of the commands and the reader processes die with their parent; a child the
        # shell forked itself (here the sleep) is left to the group kill, checked above
        gone = lambda: not matching(f"-c {command}") and not matching("reader_process import")
        assert wait_for(gone, 5), matching(f"-c {command}")
    finally:
        for pid in matching(marker):
            os.kill(pid, signal.SIGKILL)


def test_stop_tree_kills_background_children(tmp_path):
    child = processes.start("sleep 301 & sleep 302 & wait", shell=True)
    assert wait_for(lambda: len(processes.descendants(child.pid)) == 2, 10)
    kids = processes.descendants(child.pid)
    processes.stop_tree(child)
    assert child.returncode == -signal.SIGKILL
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() and
                                    Path(f"/proc/{p}/stat").read_text().rsplit(") ", 1)[1][0]
                                    != "Z" for p in kids), 5)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_hung_pipe_command_is_an_error_naming_the_file(tmp_path, kind, monkeypatch):
    from fleetx.data import InMemoryDataset, PipeTimeoutError
    (tmp_path / "part-0").write_text("1 5\n")
    monkeypatch.setenv("FLEETX_TIMEOUT", "1")
    marker = f"31.{os.getpid()}3"
    ds = InMemoryDataset()
    ds.init(batch_size=1, use_var=["ids"], reader=kind, pipe_command=f"sleep {marker}; cat")
    ds.set_filelist([str(tmp_path / "part-0")])
    start = time.monotonic()
    with pytest.raises(PipeTimeoutError, match=r"reading .*part-0: 'cat .*part-0 \| sleep "
                                               r"31\.\d+; cat' wrote nothing for 1 s "
                                               r"\(FLEETX_TIMEOUT\); the commands were killed"):
        ds.load_into_memory()
    assert time.monotonic() - start < 15
    assert wait_for(lambda: not matching(f"sleep {marker}"), 5)  # the commands were killed


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_command_that_ends_its_output_but_does_not_exit_is_an_error_naming_it(
        tmp_path, kind, monkeypatch):
    """The download command closes its output, so the pipe command ends, then hangs on its
    way out: the wait for its exit is bounded by FLEETX_TIMEOUT as its silence is."""
    from fleetx.data import PipeTimeoutError, QueueDataset
    (tmp_path / "part-0").write_text("1 5\n")
    monkeypatch.setenv("FLEETX_TIMEOUT", "1")
    marker = f"61.{os.getpid()}4"
    download = f"exec 1>&-; sleep {marker}; cat"
    ds = QueueDataset()
    ds.init(batch_size=1, use_var=["ids"], reader=kind, download_cmd=download)
    ds.set_filelist([str(tmp_path / "part-0")])
    start = time.monotonic()
    try:
        with pytest.raises(PipeTimeoutError, match=r"reading .*part-0: 'exec 1>&-; sleep "
                                                   r"61\.\d+; cat .*part-0' ended its output "
                                                   r"but did not exit within 1 s "
                                                   r"\(FLEETX_TIMEOUT\); the commands were "
                                                   r"killed") as caught:
            list(ds)
        assert caught.value.after_output
        assert time.monotonic() - start < 15
        assert wait_for(lambda: not matching(f"sleep {marker}"), 5)  # the commands were killed
    finally:
        for pid in matching(marker):  # only what this test started
            os.kill(pid, signal.SIGKILL)


def test_a_negative_timeout_is_refused_naming_the_variable(tmp_path, monkeypatch):
    from fleetx.data import QueueDataset
    from fleetx.env import EnvError
    (tmp_path / "part-0").write_text("1 5\n")
    monkeypatch.setenv("FLEETX_TIMEOUT", "-5")
    ds = QueueDataset()
    ds.init(batch_size=1, use_var=["ids"], reader="thread")
    ds.set_filelist([str(tmp_path / "part-0")])
    with pytest.raises(EnvError, match=r"FLEETX_TIMEOUT='-5': expected 0 \(no limit\) or a "
                                       r"number of seconds > 0"):
        list(ds)


def test_a_slow_but_talking_command_is_no_timeout(tmp_path, monkeypatch):
    from fleetx.data import QueueDataset
    (tmp_path / "part-0").write_text("")
    monkeypatch.setenv("FLEETX_TIMEOUT", "1")
    ds = QueueDataset()
    ds.init(batch_size=1, use_var=["ids"], reader="thread",
            pipe_command="for i in 1 2 3; do echo 1 $i; sleep 0.6; done")
    ds.set_filelist([str(tmp_path / "part-0")])
    assert [b["ids"].values.tolist() for b in ds] == [[1], [2], [3]]
