"""What a torchrun user types: ``-m module``, ``--nproc-per-node``, ``--version``, ``--help``
with examples, showing chosen ranks live (``--log_ranks`` / ``--tee``), and an earlier job's
logs moved aside. The end-to-end checks run the real fleetrun on scripts that do not import
torch (only the launcher does), so each run takes a few seconds.
"""
from __future__ import annotations

import io
import os
import re
import sys
import textwrap
import time
from dataclasses import fields
from importlib import metadata
from pathlib import Path

import pytest

import fleetx
from fleetx import env
from fleetx.launch import cli, logs, ps
from fleetx.launch.collective import plan
from fleetx.launch.config import LaunchConfig
from fleetx.launch.script import entrypoint_problem

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import run  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launch.md"

_HELLO = textwrap.dedent("""\
    import os, sys
    role = os.environ.get("TRAINING_ROLE", "TRAINER")
    who = role + " " + os.environ.get("PADDLE_TRAINER_ID", "-")
    print(f"hello from {who} name={__name__} argv={sys.argv[1:]}", flush=True)
    print(f"to stderr from {who}", file=sys.stderr, flush=True)
    code = int(os.environ.get("PADDLE_TRAINER_ID", "0") == os.environ.get("FAIL_RANK"))
    sys.exit(3 * code)
""")


def _package(root: Path) -> Path:
    """``mypkg/train.py`` (and the same code as ``hello.py``) under ``root``."""
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "train.py").write_text(_HELLO)
    (root / "hello.py").write_text(_HELLO)
    return root


# -- the command line -----------------------------------------------------------------------------
def test_every_underscore_flag_has_its_dashed_alias():
    parser = cli.build_parser()
    spelled = {s for action in parser._actions for s in action.option_strings}
    for f in fields(LaunchConfig):
        for name in cli.flag_names(f)[:1] + list(f.metadata["aliases"]):
            if name.startswith("--") and "_" in name and not f.metadata["positional"]:
                assert name[:2] + name[2:].replace("_", "-") in spelled, name
    c = cli.parse_config(["--nproc-per-node", "3", "--log-dir", "out", "--max-restarts", "1",
                          "--selected-gpus", "0,1,2", "--log-ranks", "2,0", "t.py", "--a_b"])
    assert (c.nproc_per_node, c.log_dir, c.max_restarts, c.gpus, c.log_ranks) == \
        (3, "out", 1, ("0", "1", "2"), (0, 2))
    assert c.training_script_args == ("--a_b",)


def test_version_names_fleetx_torch_and_python(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"fleetrun {fleetx.__version__} (torch {metadata.version('torch')}, Python "
                   f"{'.'.join(map(str, sys.version_info[:3]))})")


def test_help_has_examples_environment_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "fleetrun --nproc-per-node 2 -m mypkg.train" in text
    flat = " ".join(text.split())
    for code, meaning in cli.EXIT_CODES:
        assert f"{code} {' '.join(meaning.split())}" in flat
    for name in cli.ENV_READ:
        assert name in env.VARIABLES and name in flat
    written = [v.name for v in env.VARIABLES.values() if "fleetrun" in v.writer]
    assert all(name in flat for name in written)


def test_docs_list_the_exit_codes_of_the_help():
    docs = DOCS.read_text()
    for code, meaning in cli.EXIT_CODES:
        assert f"| {code} | {meaning} |" in docs, f"docs/launch.md lacks exit code {code}"


@pytest.mark.parametrize("argv, message", [
    (["--tee", "3", "t.py"], "argument --tee: takes no value in fleetrun (it shows every rank's "
                             "output; each rank's log holds stdout and stderr), but 3 followed "
                             "it: remove the 3"),
    (["--tee", "--log_ranks", "1", "t.py"], "argument --tee: shows every rank and --log_ranks "
                                            "chooses some: give one of them"),
    (["--log_ranks", "one", "t.py"], "argument --log_ranks: expected 'all' or comma-separated "
                                     "ranks such as 0,1, got 'one'"),
    (["--log_ranks", "-1", "t.py"], "argument --log_ranks: expected 'all' or ranks >= 0, got "
                                    "(-1,)"),
])
def test_bad_rank_choices_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"fleetrun: error: {message}"


def test_shown_ranks_follow_log_ranks_and_tee():
    assert LaunchConfig(training_script="t.py").shown_ranks() == (0,)
    assert LaunchConfig(training_script="t.py", log_ranks="3,1").shown_ranks() == (1, 3)
    assert LaunchConfig(training_script="t.py", log_ranks="ALL").shown_ranks() == "all"
    assert LaunchConfig(training_script="t.py", tee=True).shown_ranks() == "all"


def test_shown_ranks_of_a_node_are_its_own():
    probes = dict(cuda_count=0, is_local=lambda a: a == "10.0.0.2", free_ports=lambda n: [0] * n,
                  interface_of=lambda a: None)
    config = LaunchConfig(training_script="t.py", nproc_per_node=2, ips="10.0.0.1,10.0.0.2",
                          log_ranks="0,3")
    assert plan(config, **probes).shown_here() == [3]  # node 1 runs ranks 2 and 3
    config = LaunchConfig(training_script="t.py", nproc_per_node=2, ips="10.0.0.1,10.0.0.2",
                          tee=True)
    assert plan(config, **probes).shown_here() == [2, 3]
    p = ps.plan(LaunchConfig(training_script="t.py", server_num=1, worker_num=3, log_ranks="2"),
                is_local=lambda a: True,
                free_ports=lambda n, it=iter([[7000], [7001, 7002, 7003]]): next(it))
    assert [(q.role, q.index) for q in p.shown_here()] == [("worker", 2)]


def test_a_module_is_found_without_importing_it(tmp_path, monkeypatch):
    _package(tmp_path)
    (tmp_path / "mypkg" / "__init__.py").write_text("raise SystemExit('imported')")
    monkeypatch.chdir(tmp_path)
    assert entrypoint_problem("mypkg.train", module=True) is None
    assert entrypoint_problem("nopkg_xyz.train", module=True) == (
        f"no module named 'nopkg_xyz' in the current folder ({tmp_path}) or on sys.path; run "
        f"fleetrun from the folder that holds it, or install it")
    assert entrypoint_problem("hello.py", module=True) == (
        "hello.py: -m takes a module name, not a file: drop -m, or give the module's dotted "
        "name (such as mypkg.train)")
    assert entrypoint_problem("my-pkg.train", module=True) == (
        "my-pkg.train: not a module name (expected a dotted name such as mypkg.train)")
    assert entrypoint_problem("hello.py") is None
    assert entrypoint_problem("no.py") == "no.py: no such file"


# -- the log folder -------------------------------------------------------------------------------
def test_an_earlier_jobs_files_are_moved_to_a_dated_folder(tmp_path):
    names = ["workerlog.0", "workerlog.1", "workerlog.2", "workerlog.3", "serverlog.0",
             "endpoints.log", "fault.2.json"]
    for name in names:
        (tmp_path / name).write_text(name)
    (tmp_path / "mine.txt").write_text("the user's")
    ended = time.mktime((2024, 5, 6, 7, 8, 9, 0, 0, -1))
    os.utime(tmp_path / "workerlog.3", (ended, ended))
    os.utime(tmp_path / "workerlog.0", (ended - 60, ended - 60))
    for name in names:
        if name not in ("workerlog.0", "workerlog.3"):
            os.utime(tmp_path / name, (ended - 5, ended - 5))
    notes = logs.archive_earlier(str(tmp_path))
    dest = tmp_path / "earlier" / "20240506-070809"
    assert notes == [f"moved 7 file(s) of an earlier job (endpoints.log, fault.2.json, "
                     f"serverlog.0, workerlog.0 and 3 more) from {tmp_path} to {dest}"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(names)
    assert (dest / "workerlog.2").read_text() == "workerlog.2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "mine.txt"]
    assert logs.archive_earlier(str(tmp_path)) == []  # nothing left to move


def test_only_the_newest_earlier_folders_are_kept(tmp_path):
    for i in range(logs.KEEP_EARLIER + 1):
        (tmp_path / "workerlog.0").write_text(str(i))
        stamp = time.mktime((2024, 1, 1 + i, 0, 0, 0, 0, 0, -1))
        os.utime(tmp_path / "workerlog.0", (stamp, stamp))
        notes = logs.archive_earlier(str(tmp_path))
    earlier = tmp_path / "earlier"
    assert notes[1] == (f"removed 1 older job folder(s) from {earlier} (20240101-000000); the "
                        f"newest {logs.KEEP_EARLIER} are kept")
    kept = sorted(p.name for p in earlier.iterdir())
    assert len(kept) == logs.KEEP_EARLIER and kept[0] == "20240102-000000"


def test_two_jobs_ending_in_the_same_second_get_two_folders(tmp_path):
    for _ in range(2):
        (tmp_path / "workerlog.0").write_text("x")
        os.utime(tmp_path / "workerlog.0", (1e9, 1e9))
        logs.archive_earlier(str(tmp_path))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(1e9))
    assert sorted(p.name for p in (tmp_path / "earlier").iterdir()) == [stamp, f"{stamp}-1"]


def test_followers_with_prefixes_write_whole_lines(tmp_path):
    out = io.BytesIO()
    paths = [tmp_path / "workerlog.0", tmp_path / "workerlog.1"]
    followers = [logs.LogFollower(str(p), out, interval=0.01, prefix=f"[rank {i}] ").start()
                 for i, p in enumerate(paths)]
    files = [open(p, "ab", buffering=0) for p in paths]
    for i in range(50):
        files[0].write(b"zero %d " % i)
        files[1].write(b"one %d\n" % i)
        files[0].write(b"end\n")
    files[0].write(b"no newline")
    for f in files:
        f.close()
    for follower in followers:
        follower.stop()
    lines = out.getvalue().decode().splitlines()
    assert sorted(lines) == sorted([f"[rank 0] zero {i} end" for i in range(50)]
                                   + [f"[rank 1] one {i}" for i in range(50)]
                                   + ["[rank 0] no newline"])


# -- real fleetrun runs ---------------------------------------------------------------------------
def _worker_logs(log: Path) -> list[str]:
    return sorted(p.name for p in log.iterdir() if p.name.startswith("workerlog."))


def test_tee_then_a_smaller_job_with_chosen_ranks_and_stale_logs_moved(tmp_path):
    cwd = _package(tmp_path)
    first = run(["--nproc_per_node", "4", "--tee", "hello.py", "--x", "1"], cwd)
    assert first.returncode == 0, first.stderr
    for rank in range(4):
        assert f"[rank {rank}] hello from TRAINER {rank} name=__main__ argv=['--x', '1']" \
            in first.stdout.splitlines()
        assert f"[rank {rank}] to stderr from TRAINER {rank}" in first.stdout.splitlines()
    assert _worker_logs(cwd / "log") == [f"workerlog.{r}" for r in range(4)]

    second = run(["--nproc-per-node", "2", "--log-ranks", "1", "hello.py"], cwd)
    assert second.returncode == 0, second.stderr
    moved = re.search(r"fleetrun: moved 5 file\(s\) of an earlier job \(.*\) from \S+ to "
                      r"(\S+)$", second.stdout, re.MULTILINE)
    assert moved, second.stdout
    assert _worker_logs(cwd / "log") == ["workerlog.0", "workerlog.1"]
    assert _worker_logs(Path(moved.group(1))) == [f"workerlog.{r}" for r in range(4)]
    assert Path(moved.group(1)).parent == cwd / "log" / "earlier"
    shown = second.stdout.splitlines()
    assert "hello from TRAINER 1 name=__main__ argv=[]" in shown  # one rank: no prefix
    assert not any("hello from TRAINER 0" in line for line in shown)
    assert "hello from TRAINER 0" in (cwd / "log" / "workerlog.0").read_text()


def test_a_module_runs_on_every_rank_and_a_failure_of_a_shown_rank_is_not_repeated(
        tmp_path, monkeypatch):
    cwd = _package(tmp_path)
    res = run(["--nproc_per_node", "2", "--log_ranks", "all", "-m", "mypkg.train", "--lr", "1"],
              cwd)
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        assert f"[rank {rank}] hello from TRAINER {rank} name=__main__ argv=['--lr', '1']" \
            in res.stdout.splitlines()
    missing = run(["--nproc_per_node", "2", "-m", "nopkg_xyz"], cwd)
    assert missing.returncode == 2
    assert "fleetrun: error: argument training_script: no module named 'nopkg_xyz'" in \
        missing.stderr
    monkeypatch.setenv("FAIL_RANK", "1")
    failing = run(["--nproc_per_node", "2", "--log_ranks", "1", "-m", "mypkg.train"], cwd)
    assert failing.returncode == 1
    log1 = cwd / "log" / "workerlog.1"
    assert (f"rank 1 (local rank 1, pid " in failing.stderr
            and f"exited with code 3; its output is shown above (log: {log1}), ending with:\n"
                f"    to stderr from TRAINER 1" in failing.stderr), failing.stderr
    assert failing.stdout.count("to stderr from TRAINER 1") == 1


def test_a_parameter_server_job_shows_chosen_workers_and_runs_a_module(tmp_path):
    cwd = _package(tmp_path)
    res = run(["--server_num", "1", "--worker_num", "2", "--log_ranks", "0,1", "-m",
               "mypkg.train", "--y"], cwd)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for i in range(2):
        assert f"[worker {i}] hello from TRAINER {i} name=__main__ argv=['--y']" in lines
    assert not any("hello from PSERVER" in line for line in lines)  # servers: only their logs
    assert "hello from PSERVER -" in (cwd / "log" / "serverlog.0").read_text()


def test_a_failing_module_shows_its_own_traceback_without_the_runner(tmp_path):
    import subprocess

    (tmp_path / "badpkg").mkdir()
    (tmp_path / "badpkg" / "__init__.py").write_text("")
    (tmp_path / "badpkg" / "boom.py").write_text(
        "def go():\n    raise ValueError('boom')\n\ngo()\n")
    res = subprocess.run([sys.executable, "-m", "fleetx.run", "-m", "badpkg.boom"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    frames = re.findall(r'File "([^"]+)", line \d+', res.stderr)
    assert frames and all(f.endswith("boom.py") for f in frames), res.stderr
    assert res.stderr.strip().splitlines()[-1] == "ValueError: boom"
