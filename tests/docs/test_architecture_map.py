"""docs/architecture.md's tree maps every top-level entry of ``fleetx/``, and names only files
that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fleetx"


def _tree() -> list:
    """``(indent, names, description)`` for each entry line of the ``fleetx/`` tree; a line
    continuing the description above it (indented further) is left out."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"^```\nfleetx/\n(.*?)^```$", text, re.M | re.S).group(1)
    entries = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if indent in (2, 4, 6):
            names, _, description = line.strip().partition("  ")
            entries.append((indent, [n for n in names.split(", ") if n != "..."],
                            description.strip()))
    return entries


def _top_level() -> set:
    return {p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}


def test_every_top_level_entry_of_fleetx_is_mapped_with_a_line():
    top = [(names, description) for indent, names, description in _tree() if indent == 2]
    mapped = {n for names, _ in top for n in names}
    assert mapped == _top_level(), (f"missing from docs/architecture.md: "
                                    f"{sorted(_top_level() - mapped)}; not in fleetx/: "
                                    f"{sorted(mapped - _top_level())}")
    assert all(description for _, description in top)


def test_every_file_the_map_names_exists():
    folders = {0: PACKAGE}  # indent -> the folder the entries indented further sit in
    for indent, names, _ in _tree():
        here = folders.get(indent - 2)
        assert here is not None, f"{names} is indented under a file"
        folders[indent] = None
        for name in names:
            assert (here / name.rstrip("/")).exists(), f"{here.relative_to(ROOT)}/{name}"
            if name.endswith("/"):
                folders[indent] = here / name.rstrip("/")
