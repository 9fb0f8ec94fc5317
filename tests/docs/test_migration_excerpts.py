"""The blocks of docs/migration_paddle.md marked ``<!-- run: elsewhere
tests/docs/test_migration_excerpts.py -->`` (docs/writing_docs.md), of two kinds:

* a fleetx block without a prelude is an excerpt of the example file that the page links last
  before it (``[...](../examples/...py)``): its lines are consecutive lines of that file, word
  for word (up to their common indentation), and that example is run by the test RUNNERS names;
* a Paddle block, whose hidden prelude makes ``strategy`` a fleetx ``DistributedStrategy``, holds
  Paddle's strategy lines as the FleetX manual describes them: they run here, so fleetx accepts
  every key and value they set as written.
"""
from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import pytest

from doc_blocks import ROOT, blocks_of

PAGE = ROOT / "docs" / "migration_paddle.md"
THIS = "tests/docs/test_migration_excerpts.py"
LINK = re.compile(r"\]\(\.\./(examples/[\w/]+\.py)\)")

# The test that runs each example an excerpt is taken from (the page names it beside the excerpt).
RUNNERS = {
    "examples/strategies/amp.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/gradient_merge.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/localsgd.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/adaptive_localsgd.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/lars.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/lamb.py": "tests/examples/test_strategy_examples.py",
    "examples/strategies/dgc.py": "tests/examples/test_comm_examples.py",
    "examples/strategies/hierarchical_allreduce.py": "tests/examples/test_comm_examples.py",
    "examples/gpt/train.py": "tests/examples/test_gpt_example.py",
    "examples/wide_and_deep/train.py": "tests/examples/test_wide_and_deep.py",
    "examples/wide_and_deep/train_dataset.py": "tests/examples/test_wide_and_deep_dataset.py",
    "examples/word2vec/train.py": "tests/examples/test_word2vec.py",
}


def _ours() -> list:
    return [b for b in blocks_of(PAGE)
            if b.lang == "python" and b.mode == "elsewhere" and b.arg == THIS]


EXCERPTS = [b for b in _ours() if not b.prelude.strip()]
PADDLE = [b for b in _ours() if b.prelude.strip()]


def _linked_example(block) -> str | None:
    """The example file the page links last between the previous fence and this block."""
    before = "\n".join(PAGE.read_text().splitlines()[:block.line - 1])
    found = LINK.findall(before.rsplit("```", 1)[-1])
    return found[-1] if found else None


def _lines_in(excerpt: str, text: str) -> bool:
    want = excerpt.rstrip("\n").splitlines()
    lines = text.splitlines()
    return any(textwrap.dedent("\n".join(lines[i:i + len(want)])).splitlines() == want
               for i in range(len(lines) - len(want) + 1))


def test_the_page_has_both_kinds():
    assert len(EXCERPTS) >= 12 and len(PADDLE) >= 12, (len(EXCERPTS), len(PADDLE))


def _names(text: str, source: Path) -> bool:
    """The runner names the example: its stem quoted (a parametrised list of examples), or its
    folder and file name (a path built from parts)."""
    quoted = any(f"{q}{source.stem}{q}" in text for q in "'\"")
    named = f'"{source.name}"' in text and (source.stem != "train"  # train.py: which one?
                                            or f'"{source.parent.name}"' in text)
    return quoted or named or str(source) in text


@pytest.mark.parametrize("block", EXCERPTS, ids=lambda b: b.name)
def test_excerpt_is_in_the_linked_example(block):
    source = _linked_example(block)
    assert source, f"{block.name}: no link to an example file between the last block and this one"
    assert _lines_in(block.code, (ROOT / source).read_text()), \
        f"{block.name} is not a run of whole lines of {source}:\n{block.code}"
    assert source in RUNNERS, f"{block.name}: which test runs {source}? add it to RUNNERS"
    runner = ROOT / RUNNERS[source]
    assert _names(runner.read_text(), Path(source)), f"{runner} does not name {source}"
    assert RUNNERS[source] in PAGE.read_text(), f"the page does not name {RUNNERS[source]}"


@pytest.mark.parametrize("block", PADDLE, ids=lambda b: b.name)
def test_paddle_strategy_lines_are_accepted(block):
    from fleetx import fleet
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Paddle 2.0's key names
        exec(compile(block.script(), block.name, "exec"), scope)
    strategy = scope["strategy"]
    assert isinstance(strategy, fleet.DistributedStrategy)
    assert re.search(r"^strategy\.\w+\s*=", block.code, re.M), f"{block.name} sets nothing"


def test_a_key_fleetx_does_not_know_is_refused():
    """The check above can fail: a wrong key in a Paddle block would raise."""
    from fleetx import fleet
    strategy = fleet.DistributedStrategy()
    with pytest.raises(Exception, match="init_loss_scale"):
        strategy.amp_configs = {"init_loss_scale": 32768}
