"""CI runs what the README tells a user to run: its test command is stage 1 of ``.ci/run``,
verbatim, and the slow stage's command is the one the README quotes."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> dict:
    quick = re.search(r"^# 2\. set up and run the tests\n(.+)$", (ROOT / "README.md").read_text(),
                      re.MULTILINE)
    slow = re.search(r"second stage on every run: `([^`]+)`",
                     " ".join((ROOT / "README.md").read_text().split()))
    assert quick and slow, "README.md lost its test command or its slow-stage command"
    return {"stage 1": quick.group(1).strip(), "stage 2": slow.group(1)}


def test_ci_runs_the_readme_test_commands_verbatim():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for stage, command in _readme_commands().items():
        assert command in lines, f"{stage}: .ci/run does not run the README's {command!r}"
