"""Paddle's ``fleet.save_persistables(executor, dirname, main_program=None, mode=0)`` and
``fleet.save_inference_model(executor, dirname, ...)``: the leading executor (any object that
is not a path) is accepted and ignored."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fleetx.fleet.delegation import _paddle_save_persistables, _without_executor

SCRIPT = textwrap.dedent("""\
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

    class Executor:  # stands for paddle.static.Executor
        pass

    fleet.init()
    model = fleet.distributed_model(Model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      fleet.DistributedStrategy())
    fleet.init_worker()
    ids = torch.arange(40).reshape(10, 4)
    for _ in range(3):
        opt.minimize(((model(ids) - 3.0) ** 2).mean())
    exe = Executor()
    fleet.save_persistables(exe, "full", None, 0)
    fleet.save_persistables(executor=exe, dirname="base", mode=1)
    fleet.save_persistables(exe, "delta", mode=2)
    fleet.save_persistables("plain")
    fleet.save_inference_model(exe, "export", ["ids"], [None])
    fleet.save_inference_model(executor=exe, dirname="export2")
    fleet.stop_worker()
""")


def test_paddle_forms_are_mapped():
    exe = object()
    assert _without_executor((exe, "d", None, 1), {}) == (("d", None, 1), {}, True)
    assert _without_executor((), {"executor": exe, "dirname": "d"}) == ((), {"dirname": "d"},
                                                                         True)
    assert _without_executor((Path("d"), 1), {}) == ((Path("d"), 1), {}, False)
    assert _without_executor(("d",), {"mode": 2}) == (("d",), {"mode": 2}, False)
    assert _paddle_save_persistables("d", None, 2) == ("d", 2)
    assert _paddle_save_persistables(dirname="d", main_program=object()) == ("d", 0)


def test_a_script_in_paddles_form_saves_and_exports(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRAINING_ROLE", "PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINER_ID",
                        "PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ENDPOINTS")}
    res = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for folder in ("full", "base", "delta", "plain", "export", "export2"):
        assert (tmp_path / folder / "manifest.json").is_file(), folder
