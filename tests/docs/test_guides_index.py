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
