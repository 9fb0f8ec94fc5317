"""Paddle's ``fleet.save_persistables(executor, dirname, main_program=None, mode=0)`` and
``fleet.save_inference_model(executor, dirname, ...)``: the leading executor (any object that
is not a path) is accepted and ignored."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetx import fleet
from fleetx.fleet import delegation
from fleetx.fleet.delegation import _save_persistables_args, _without_executor

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
    exe, forms = object(), delegation._SAVE_FORMS
    assert _without_executor((exe, "d", None, 1), {}, forms) == (("d", None, 1), {}, True)
    assert _without_executor((), {"executor": exe, "dirname": "d"}, forms) == (
        (), {"dirname": "d"}, True)
    assert _without_executor((Path("d"), 1), {}, forms) == ((Path("d"), 1), {}, False)
    assert _without_executor(("d",), {"mode": 2}, forms) == (("d",), {"mode": 2}, False)
    assert _save_persistables_args((exe, "d", None, 2), {}) == (("d", 2), {})
    assert _save_persistables_args((exe, "d"), {"mode": 2}) == (("d",), {"mode": 2})
    assert _save_persistables_args((), {"executor": exe, "dirname": "d",
                                        "main_program": object()}) == ((), {"dirname": "d"})
    assert _save_persistables_args(("d", 1), {}) == (("d", 1), {})


def test_a_first_argument_that_is_no_path_and_no_executor_is_named():
    """``save_persistables(None)`` once lost its argument as an executor and failed on a
    missing dirname."""
    with pytest.raises(TypeError, match=r"save_persistables: the first argument, of type "
                                        r"NoneType, is not a path, and no dirname follows it "
                                        r"to take it for Paddle's executor; call "
                                        r"save_persistables\(dirname, mode=0\) or "
                                        r"save_persistables\(executor, dirname, "
                                        r"main_program=None, mode=0\)"):
        fleet.save_persistables(None)
    with pytest.raises(TypeError, match=r"save_inference_model: the first argument, of type "
                                        r"int, .* call save_inference_model\(dirname, "):
        fleet.save_inference_model(3)


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
