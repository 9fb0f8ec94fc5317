"""A parameter-server script run with plain ``python`` (one process, no servers) never runs its
server branch: an ``init_server(dirname)`` there does not load anything. Evaluating that
never-trained model fails naming the fix instead of scoring the initial weights; the fix
(``init_server(dirname)`` before ``init_worker`` when there are no servers) loads the save and
says "loaded from".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""\
    import json, sys
    import torch
    from torch import nn
    from fleetx import fleet

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 4, sparse=True)
            self.out = nn.Linear(4, 1)

        def forward(self, ids):
            return self.out(self.emb(ids).sum(1)).squeeze(1)

    how, path = sys.argv[1], sys.argv[2]
    fleet.init()
    torch.manual_seed(0)
    model = fleet.distributed_model(Model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      fleet.DistributedStrategy())
    if how == "server_branch_only" and fleet.is_server():   # Paddle's usual shape
        fleet.init_server(path)
    if how == "fixed" and (fleet.is_server() or fleet.server_num() == 0):
        fleet.init_server(path)
    if how == "initial_on_purpose":
        fleet.init_server()
    if how == "late":  # too late to load: refused
        fleet.init_worker()
        fleet.init_server(path)
    if fleet.is_server():
        fleet.run_server()
        sys.exit(0)
    fleet.init_worker()
    ids = torch.arange(40).reshape(10, 4)
    if how == "train":
        for _ in range(30):
            opt.minimize(((model(ids) - 3.0) ** 2).mean())
    model.eval()
    with torch.no_grad():
        print("OUT " + json.dumps(model(ids).tolist()), flush=True)
    if how == "train":
        fleet.save_persistables(path)
    fleet.stop_worker()
""")


def _python(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRAINING_ROLE", "PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINER_ID",
                        "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS")}
    return subprocess.run([sys.executable, str(tmp_path / "script.py"), how, "saved"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _outputs(res: subprocess.CompletedProcess) -> list[float]:
    line = next(l for l in res.stdout.splitlines() if l.startswith("OUT "))
    return json.loads(line[4:])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("local_load")
    (tmp_path / "script.py").write_text(SCRIPT)
    res = _python(tmp_path, "train")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"fleetx ps worker 0: saved to {tmp_path / 'saved'}" in res.stdout.splitlines()
    return tmp_path, _outputs(res)


def test_init_server_only_in_the_server_branch_fails_naming_the_fix(trained):
    tmp_path, _ = trained
    res = _python(tmp_path, "server_branch_only")
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("fleetx.ps.api.StateError: evaluating a model that was neither "
                           "trained nor loaded: this process runs alone"), last
    assert "call fleet.init_server(dirname) before fleet.init_worker() when " \
           "fleet.server_num() == 0" in last
    assert "OUT " not in res.stdout  # nothing was scored


def test_the_fix_loads_the_save_and_says_so(trained):
    tmp_path, outputs = trained
    res = _python(tmp_path, "fixed")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"fleetx ps worker 0: loaded from {tmp_path / 'saved'} (50 sparse row(s), 1 dense " \
           f"table(s))" in res.stdout.splitlines()
    assert _outputs(res) == pytest.approx(outputs, abs=1e-6)
    # a job without servers names its kernel backend too (servers and KV clients do)
    assert "local tables: parameter-server kernels: C kernels" in res.stderr


def test_initial_weights_on_purpose_are_scored(trained):
    tmp_path, outputs = trained
    res = _python(tmp_path, "initial_on_purpose")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded from" not in res.stdout
    assert _outputs(res) != pytest.approx(outputs, abs=1e-3)  # the untrained model


def test_init_server_after_init_worker_alone_is_refused(trained):
    tmp_path, _ = trained
    res = _python(tmp_path, "late")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "fleetx.ps.api.StateError: init_server() after the job started: in a job without "
        "servers it loads the local tables, so call it before fleet.init_worker() and before "
        "the first forward")
