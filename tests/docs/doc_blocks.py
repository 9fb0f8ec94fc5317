"""Find the code blocks of README.md and docs/*.md and the marker that says how each one runs.

The convention (documented for writers in docs/writing_docs.md):

* A ```python block with no marker runs as a script: ``python3 block.py`` in an empty
  directory, one process, with this repository on ``PYTHONPATH``.
* ``<!-- run: fleetrun ARGS -->`` on the line(s) right before the block runs it as a script under
  ``fleetrun ARGS block.py``, e.g. ``<!-- run: fleetrun --nproc_per_node 2 -->``.
* ``<!-- run: skip (reason) -->`` skips a fragment that cannot run alone; the reason is required,
  and tests/docs/skipped.txt lists every skipped block, so skipping cannot grow silently.
* ``<!-- run: continue -->`` joins the block to the previous Python block of the same page (a
  page that builds a model in one block and trains it in the next): the joined script runs once,
  under the first block's marker.
* ``<!-- run: elsewhere tests/PATH.py -->``: another test runs this block (it names the page).
* Any ``run`` marker may carry a hidden prelude: the lines after the marker's first line, up to
  ``-->``, are Python run before the block (definitions the page's prose stands for, such as a
  ``Net`` or a data shard); the block's own text is never edited before it runs.
* ``<!-- cluster recipe -->`` before a ```bash block: the recipe needs a cluster, so its syntax
  is checked with ``bash -n``.
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^([ \t]*)```(\w+)[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
MODES = ("python", "fleetrun", "skip", "continue", "elsewhere")


@dataclass
class Block:
    """One fenced block of a page, with its marker's mode, argument and hidden prelude."""
    page: str          # path relative to the repository root
    line: int          # the fence's line number, 1-based
    lang: str
    code: str
    mode: str = "python"
    arg: str = ""
    prelude: str = ""
    joined: list = field(default_factory=list)   # blocks continued into this one

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    def script(self) -> str:
        parts = [self.prelude, self.code] + [p for b in self.joined for p in (b.prelude, b.code)]
        return "\n".join(p for p in parts if p.strip())


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _markers_before(text: str) -> list[str]:
    """The HTML comments that end right before a fence (only blank space between), last first."""
    found, rest = [], text.rstrip()
    while rest.endswith("-->"):
        start = rest.rfind("<!--")
        if start < 0:
            break
        found.append(rest[start + 4:-3].strip())
        rest = rest[:start].rstrip()
    return found


def _apply_marker(block: Block, comments: list[str]) -> None:
    for comment in comments:
        if comment == "cluster recipe":
            block.mode = "recipe"
            return
        if not comment.startswith("run"):
            continue
        head, _, prelude = comment.partition("\n")
        spec = head[3:].lstrip(":").strip() or "python"
        mode, _, arg = spec.partition(" ")
        if mode not in MODES:
            raise ValueError(f"{block.name}: unknown run marker {mode!r}; valid: {MODES}")
        if mode == "skip" and not re.fullmatch(r"\(.+\)", arg.strip()):
            raise ValueError(f"{block.name}: 'run: skip' needs a reason in parentheses")
        block.mode, block.arg, block.prelude = mode, arg.strip(), prelude
        return


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    out: list[Block] = []
    for match in FENCE.finditer(text):
        block = Block(str(path.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1,
                      match.group(2), textwrap.dedent(match.group(3)))
        _apply_marker(block, _markers_before(text[:match.start()]))
        out.append(block)
    return out


def runnable_blocks() -> list[Block]:
    """Every Python block to run (joined blocks folded into their head), skipped ones included."""
    result: list[Block] = []
    for path in pages():
        head = None
        for block in (b for b in blocks_of(path) if b.lang == "python"):
            if block.mode == "continue":
                if head is None:
                    raise ValueError(f"{block.name}: 'run: continue' with no block before it")
                head.joined.append(block)
                continue
            head = block
            result.append(block)
    return result


def recipes() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p) if b.mode == "recipe"]
