"""Every Python block of README.md and docs/*.md runs as written (docs/writing_docs.md gives the
marker convention); skipped blocks are the ones tests/docs/skipped.txt lists, with a reason.

A block for ``python`` runs as ``python block.py`` would, in a process forked from a server that
imported torch and fleetx once (``helpers.run_script``); a block for ``fleetrun`` runs under the
real launcher."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import ROOT, recipes, runnable_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import run_script  # noqa: E402  (tests/helpers.py)

BLOCKS = runnable_blocks()
SKIP_LIST = Path(__file__).with_name("skipped.txt")
# launcher variables of an enclosing job must not make a block's script think it is distributed
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINER_ID",
                  "TRAINING_ROLE", "FLEETX_DRY_RUN")
SLOW_SECONDS = 20      # a block whose marker says "slow" runs only in the slow stage


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _command(block, script: Path) -> list[str]:
    return [sys.executable, "-m", "fleetx.launch", *block.arg.split(), str(script)]


def _params():
    # blocks marked skip are not collected at all (CI=true fails a skipped test); the list test
    # below accounts for them
    for block in (b for b in BLOCKS if b.mode != "skip"):
        marks = [pytest.mark.slow] if "slow" in block.arg.split() else []
        yield pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", _params())
def test_block_runs(block, tmp_path):
    if block.mode == "elsewhere":
        other = ROOT / block.arg
        assert other.is_file(), f"{block.name}: 'run: elsewhere' names no test file {block.arg}"
        assert Path(block.page).name in other.read_text(), \
            f"{block.arg} does not read {block.page}, so it cannot run {block.name}"
        return
    if block.mode == "fleetrun":
        block.arg = " ".join(a for a in block.arg.split() if a != "slow")
    script = tmp_path / "block.py"
    script.write_text(block.script())
    if block.mode == "fleetrun":
        res = subprocess.run(_command(block, script), cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=240)
    else:
        res = run_script([str(script)], tmp_path, _env(), timeout=240)
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in (tmp_path / "log").glob("*")
                   if p.is_file())  # fleetrun's log folder holds folders too (ps_snapshots)
    assert res.returncode == 0, (f"{block.name} failed ({res.returncode}):\n--- script\n"
                                 f"{block.script()}\n--- output\n{res.stdout[-3000:]}"
                                 f"{res.stderr[-5000:]}\n{logs}")


def test_skipped_blocks_are_the_listed_ones():
    """Skipping cannot grow silently: tests/docs/skipped.txt names every skipped block."""
    skipped = sorted(f"{b.page}: {b.arg}" for b in BLOCKS if b.mode == "skip")
    listed = sorted(line for line in SKIP_LIST.read_text().splitlines()
                    if line.strip() and not line.startswith("#"))
    assert skipped == listed, ("update tests/docs/skipped.txt (and think twice before adding):\n"
                               + "\n".join(skipped))


@pytest.mark.parametrize("block", recipes(), ids=lambda b: b.name)
def test_cluster_recipe_is_valid_shell(block):
    res = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert res.returncode == 0, f"{block.name}: {res.stderr}\n{block.code}"


def test_every_python_block_is_found():
    """The parser sees every ```python fence of the pages (none hidden by indentation)."""
    from doc_blocks import pages
    fences = sum(len(re.findall(r"^[ \t]*```python[ \t]*$", p.read_text(), re.M))
                 for p in pages())
    assert fences == len(BLOCKS) + sum(len(b.joined) for b in BLOCKS)


def test_clusters_page_recipes_are_marked():
    """Every shell block of docs/clusters.md is a recipe checked above (five or more)."""
    page = [b for b in recipes() if b.page == "docs/clusters.md"]
    assert len(page) >= 5 and (ROOT / "docs" / "clusters.md").read_text().count("```bash") == len(page)
