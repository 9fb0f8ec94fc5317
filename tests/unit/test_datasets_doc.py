"""docs/datasets.md: its Python blocks run as written, and the messages it quotes are the ones
fleetx gives."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleetx.data import BadLineError, Slot
from fleetx.data import parse

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "datasets.md").read_text()


def python_blocks() -> list:
    return re.findall(r"```python\n(.*?)```", DOC, re.S)


def test_the_python_blocks_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) == 2 and blocks[0].startswith("# reader.py\n")
    (tmp_path / "reader.py").write_text(blocks[0])  # the generator, a file of its own
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "PADDLE_TRAINER_ENDPOINTS", "TRAINING_ROLE")}
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run([sys.executable, "-c", blocks[1]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # the debugging command the page suggests
    res = subprocess.run(f"cat part-0 | {sys.executable} reader.py", shell=True, cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout == "3 10 11 12 1 1\n1 13 1 0\n2 14 15 1 1\n"


def test_the_format_example():
    block, _ = parse.parse_lines(b"4 1 2 3 4 1 0\n", [Slot("words"), Slot("label", "int64", 1)],
                                 "f")
    assert block.values["words"].tolist() == [1, 2, 3, 4] and block.values["label"] == [0]
    assert "4 1 2 3 4 1 0          # slot \"words\"" in DOC


@pytest.mark.parametrize("line, slots", [
    (b"3 1 2\n", [Slot("ids")]),
    (b"1 5\n", [Slot("ids"), Slot("label", "int64", 1)]),
    (b"0 5 1 1\n", [Slot("ids"), Slot("label", "int64", 1)]),
    (b"1 5 2 1 1\n", [Slot("ids"), Slot("label", "int64", 1)]),
    (b"1 1.5 1 1\n", [Slot("ids"), Slot("label", "int64", 1)]),
    (b"1 18446744073709551616 1 1\n", [Slot("ids"), Slot("label", "int64", 1)]),
    (b"1 5 1 1 7 7\n", [Slot("ids"), Slot("label", "int64", 1)]),
])
def test_quoted_bad_line_reasons_are_real(line, slots):
    with pytest.raises(BadLineError) as err:
        parse.parse_lines(line, slots, "part-7")
    reason = err.value.reason
    quoted = reason.split("; the line holds")[0] if "token(s) after" in reason else reason
    assert quoted in " ".join(DOC.split()), reason


def test_links():
    differences = (ROOT / "docs" / "differences.md").read_text()
    assert "## Datasets and data generators" in differences
    assert "(datasets.md)" in (ROOT / "docs" / "parameter_server.md").read_text()
    assert "(docs/datasets.md)" in (ROOT / "README.md").read_text()
