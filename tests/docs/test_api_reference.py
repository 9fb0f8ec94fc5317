"""The API reference (mkdocs.yml, docs/reference/) builds from the docstrings with no warning, and
without the network: the theme is MkDocs' own and mkdocstrings reads the source (griffe), so no
inventory is fetched. Under CI=true a missing `docs` extra fails the run (tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_reference_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra")
    # proxies pointing nowhere: a build that tried to reach the network would fail
    env = dict(os.environ, PYTHONPATH=str(ROOT), HTTP_PROXY="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    page = (tmp_path / "site" / "reference" / "fleet" / "index.html").read_text()
    for name in ("distributed_optimizer", "distributed_model", "init_worker"):
        assert name in page, f"{name} missing from the fleet reference"
    ps = (tmp_path / "site" / "reference" / "ps" / "index.html").read_text()
    assert "PSConfig" in ps and "PeerLostError" in ps
