"""docs/faq.md: the messages its prose quotes (beyond those its blocks reproduce) are the ones the
code raises, and the fixes it names exist."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAQ = (ROOT / "docs" / "faq.md").read_text()


def test_quoted_messages_come_from_the_code():
    assert 'f"{peer} lost: {reason}"' in (ROOT / "fleetx/ps/errors.py").read_text()
    assert "is not reachable at {host}:{port} after {timeout:.0f} s" in \
        (ROOT / "fleetx/ps/handshake.py").read_text()
    assert "terminate called without an active exception" in \
        (ROOT / "docs/reliability.md").read_text()


def test_named_fixes_exist():
    assert "FLEETX_PS_DEAD_AFTER" in (ROOT / "fleetx/env.py").read_text()
    assert (ROOT / "fleetx/run.py").is_file() or (ROOT / "fleetx/run").is_dir()
    assert "-m fleetx.run" in (ROOT / "docs/reliability.md").read_text()
    for page in ("environment.md", "parameter_server.md", "reliability.md", "launch.md"):
        assert f"({page})" in FAQ and (ROOT / "docs" / page).is_file()
