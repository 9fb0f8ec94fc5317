"""``fleet.save_inference_model`` exports a model a serving team loads without fleetx: a
process in which fleetx cannot be imported rebuilds the dense part from ``model.pt`` with its
own ``nn.Module`` (the converted embedding's weight included) and looks the unbounded table up
in the ``.npy`` parts; it scores a batch exactly as the live model did, after training on two
servers and two workers, and in one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
sys.path.insert(0, str(ROOT / "tests" / "launch"))
from test_fleetrun import fleetrun_cmd  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(ROOT), FLEETX_TIMEOUT="60")


def serve(export: Path) -> list:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, str(SCRIPTS / "serve_export.py"), str(export)],
                         capture_output=True, text=True, timeout=120, env=env, cwd="/")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize("servers", [0, 2])
def test_an_export_scores_like_the_live_model_without_fleetx(tmp_path, servers):
    script = [SCRIPTS / "ps_export_train.py", "--out", tmp_path]
    cmd = fleetrun_cmd("--server_num", "2", "--worker_num", "2", *script) if servers else \
        [sys.executable] + [str(a) for a in script]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "exported to" in res.stdout
    live = json.loads((tmp_path / "live.json").read_text())
    np.testing.assert_allclose(serve(tmp_path / "export"), live, rtol=0, atol=1e-6)
    folder = next((tmp_path / "export").glob("save-*"))
    desc = json.loads((folder / "export.json").read_text())
    assert desc["sparse"]["emb"]["state_dict_key"] == "emb.weight"
    assert desc["sparse"]["user"]["missing"] == "initial"
    assert len(desc["sparse"]["user"]["parts"]) == max(servers, 1)
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["info"] == {
        "mode": "export"}
