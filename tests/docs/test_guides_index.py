"""docs/guides/index.md points only at pages and sections that exist."""
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    heads = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_link_resolves():
    index = DOCS / "guides" / "index.md"
    links = re.findall(r"\]\(([^)]+)\)", index.read_text())
    assert len(links) > 20
    for link in links:
        target, _, anchor = link.partition("#")
        page = (index.parent / target).resolve()
        assert page.is_file(), link
        if anchor:
            assert anchor in _anchors(page), f"{link}: no such section"


SECTIONS = ["## What it does", "## When to use it", "## How", "## Measured effect"]


def test_every_guide_is_listed_and_has_the_four_parts():
    """A guide says what, when, how and its measured effect, in that order, and the index
    lists every guide."""
    folder = DOCS / "guides"
    index = (folder / "index.md").read_text()
    guides = sorted(p for p in folder.glob("*.md") if p.name != "index.md")
    assert len(guides) >= 20
    for page in guides:
        assert f"]({page.name})" in index, f"{page.name} is not in guides/index.md"
        heads = re.findall(r"^## .*$", page.read_text(), re.M)
        found = [h for h in heads if any(h.startswith(s) for s in SECTIONS)]
        assert [next(s for s in SECTIONS if h.startswith(s)) for h in found] == SECTIONS, \
            f"{page.name}: sections {heads}"
        assert "```python" in page.read_text(), f"{page.name}: no example"
