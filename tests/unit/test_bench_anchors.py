"""Benchmarks that need the reference scripts (outside the repository) stop with a message naming
the missing file and the fix, when ``FLEETX_ANCHORS`` points at a folder without them."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import anchors  # noqa: E402


def _run(args: list, anchor_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLEETX_ANCHORS=str(anchor_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_names_fix(proc: subprocess.CompletedProcess, missing: str, folder: Path) -> None:
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"benchmark needs the reference script {missing}, not found in "
                           f"{folder} (FLEETX_ANCHORS={folder})"), last
    assert "set FLEETX_ANCHORS to the folder that holds" in last
    assert "benchmarks/README.md, section 'Reference scripts'" in last
    assert "Traceback" not in proc.stderr


def test_ps_ctr_compare_names_the_missing_harness(tmp_path):
    empty = tmp_path / "anchors"
    empty.mkdir()
    proc = _run([str(ROOT / "benchmarks/ps_ctr.py"), "compare", "--cases", "async_adam_1x2",
                 "--data", str(tmp_path / "data"), "--rounds", "1"], empty, tmp_path)
    _assert_names_fix(proc, "harness.py", empty)
    assert not (tmp_path / "data").exists(), "no data is generated before the check"


def test_ps_ctr_compare_names_paddles_missing_scripts(tmp_path):
    folder = tmp_path / "anchors"
    folder.mkdir()
    (folder / "harness.py").write_text("")
    (folder / "paddle_ps_run.py").write_text("")
    proc = _run([str(ROOT / "benchmarks/ps_ctr.py"), "compare", "--cases", "async_1x2",
                 "--data", str(tmp_path / "data")], folder, tmp_path)
    _assert_names_fix(proc, "paddle_ps_ctr.py", folder)


def test_startup_names_the_missing_harness(tmp_path):
    empty = tmp_path / "anchors"
    empty.mkdir()
    proc = _run([str(ROOT / "benchmarks/startup.py"), "--pairs", "1"], empty, tmp_path)
    _assert_names_fix(proc, "harness.py", empty)


def test_require_returns_the_first_path_when_all_exist(tmp_path, monkeypatch):
    for name in anchors.PADDLE_PS:
        (tmp_path / name).write_text("")
    monkeypatch.setenv("FLEETX_ANCHORS", str(tmp_path))
    assert anchors.require(*anchors.PADDLE_PS) == tmp_path / "paddle_ps_run.py"
    monkeypatch.delenv("FLEETX_ANCHORS")
    assert anchors.folder() == ROOT.parent / "shared" / "reference" / "anchors"
    with pytest.raises(anchors.MissingAnchor, match="no_such_anchor.py, not found in"):
        anchors.require("no_such_anchor.py")


def test_ps_ctr_compare_names_a_missing_paddle_venv(tmp_path):
    folder = tmp_path / "anchors"
    folder.mkdir()
    for name in ("harness.py", *anchors.PADDLE_PS):
        (folder / name).write_text("")
    venv = tmp_path / "no-venv" / "bin" / "python"
    proc = _run([str(ROOT / "benchmarks/ps_ctr.py"), "compare", "--cases", "async_adam_1x2",
                 "--data", str(tmp_path / "data"), "--paddle-py", str(venv)], folder, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"Paddle's python {venv} not found: set PADDLE_PS_PY or --paddle-py, or build the venv "
        "as benchmarks/README.md says (section 'Paddle 2.6.2 for the parameter-server "
        "comparison')")
    assert not (tmp_path / "data").exists()
