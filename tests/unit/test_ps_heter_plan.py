"""Heter workers in the plan and the fleet (one process, nothing connects): the plan names them
and refuses GEO and a lock-step job with several; a heter worker's fleet takes the server
branch and builds a runtime that serves sections; ``HeterSection`` runs its module locally when
nothing is bound; what cannot travel is refused; the lock-step stall rule."""
import pytest
import torch
from torch import nn

from fleetx.fleet import Fleet, FleetError, PaddleCloudRoleMaker
from fleetx.nn import HeterSection
from fleetx.nn.heter import sections
from fleetx.ps.api import StateError
from fleetx.strategy.api import StrategyError
from fleetx.strategy.distributed_strategy import DistributedStrategy

BASE = {"PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:1", "PADDLE_TRAINERS_NUM": "2",
        "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:3,127.0.0.1:4"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 2, sparse=True)
        self.mlp = HeterSection(nn.Linear(4, 1))

    def forward(self, ids):
        return self.mlp(self.emb(ids).flatten(1))


def heter_fleet(heters: int = 1, a_sync: bool = True, k_steps: int = 0, heter_role=False):
    env = dict(BASE, PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST=",".join(
        f"127.0.0.1:{10 + i}" for i in range(heters)))
    env.update(TRAINING_ROLE="HETER_TRAINER", POD_IP="127.0.0.1", PADDLE_PORT="10") \
        if heter_role else env.update(TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0")
    f = Fleet()
    f.init(PaddleCloudRoleMaker(is_collective=False, environ=env))
    s = DistributedStrategy()
    s.a_sync = a_sync
    s.a_sync_configs = {"k_steps": k_steps, "heter_worker_device_guard": "gpu"}
    torch.manual_seed(0)
    model = f.distributed_model(Net())
    f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), s)
    return f


def test_the_plan_names_the_heter_workers(capsys):
    f = heter_fleet(heters=2)
    f.explain()
    assert ("async mode: 1 server(s), 2 worker(s), 2 heter worker(s) on gpu (async); sparse "
            "tables: emb") in capsys.readouterr().out


@pytest.mark.parametrize("kw, words", [
    (dict(k_steps=4), "heter workers train in sync or async mode, not GEO"),
    (dict(a_sync=False, heters=2), r"a sync \(lock-step\) job takes one heter worker, not 2"),
])
def test_the_plan_refuses_what_heter_workers_cannot_do(kw, words):
    with pytest.raises(StrategyError, match=words):
        heter_fleet(**kw)


def test_a_heter_worker_takes_the_server_branch_and_serves_sections():
    f = heter_fleet(heter_role=True)
    assert f.is_server() and not f.is_worker()
    runtime = f._ctx.runtime
    assert runtime.is_heter and runtime.index == 0 and runtime.heter_device == "gpu"
    f.init_server("anything")  # the servers load saves; a heter worker takes the call quietly
    with pytest.raises(StateError, match="init_worker.. runs on workers; this process is a "
                                         "heter worker"):
        f.init_worker()
    with pytest.raises(FleetError, match="fleet.util collectives run among workers; this is a "
                                         "heter worker"):
        f.util.barrier()


def test_a_section_runs_its_module_when_nothing_is_bound():
    torch.manual_seed(0)
    inner = nn.Linear(3, 2)
    section = HeterSection(inner)
    x = torch.rand(4, 3)
    assert torch.equal(section(x), inner(x)) and not section.remote
    section.bind(lambda s, inputs: ("remote", inputs))
    assert section(x)[0] == "remote" and section.remote
    assert "remote" in repr(section)
    with pytest.raises(TypeError, match="HeterSection wraps an nn.Module, got int"):
        HeterSection(3)


def test_sections_are_named_after_their_path_and_may_not_nest():
    model = nn.Module()
    model.a = HeterSection(nn.Linear(1, 1))
    model.b = HeterSection(nn.Linear(1, 1), name="a")
    with pytest.raises(ValueError, match="two HeterSections are named 'a'"):
        sections(model)
    nested = nn.Module()
    nested.outer = HeterSection(nn.Sequential(HeterSection(nn.Linear(1, 1))))
    with pytest.raises(ValueError, match="HeterSection 'outer' holds another HeterSection"):
        sections(nested)


def test_what_cannot_travel_is_refused_naming_it():
    import numpy as np
    from fleetx.ps.api import ProtocolError
    from fleetx.ps_torch.heter import check, pack, unpack
    with pytest.raises(TypeError, match="input 1 is a int; a HeterSection takes and returns "
                                        "tensors only"):
        check([torch.ones(1), 3], "input")
    with pytest.raises(TypeError, match="input 0 has dtype torch.bfloat16; a HeterSection's "
                                        "tensors must be one of torch.float32"):
        check([torch.ones(1, dtype=torch.bfloat16)], "input")
    shapes, bufs = pack([torch.arange(6.0).view(2, 3), torch.tensor([1, 2])], "input")
    back = unpack(shapes, bufs, "input")
    assert torch.equal(back[0], torch.arange(6.0).view(2, 3)) and back[1].dtype == torch.int64
    for bad, words in (([[2, 3]], "4 values of float32 do not make shape"),
                       ([[-1]], "is not a list of at most 16 sizes >= 0"),
                       ([[1] * 17], "is not a list of at most 16 sizes >= 0"),
                       ("x", "'shapes' must list one shape per buffer")):
        with pytest.raises(ProtocolError, match=words):
            unpack(bad, [np.zeros(4, np.float32)][:1] if bad != "x" else [], "input")


def test_a_trainer_that_holds_up_the_lock_step_is_named_after_the_timeout():
    from fleetx.ps import PSConfig
    from fleetx.ps_torch.heter_worker import HeterWorker, _Trainer
    from fleetx.ps_torch.layout import ModelLayout
    torch.manual_seed(0)
    model = Net()
    layout = ModelLayout.of(model, torch.optim.SGD(model.parameters(), lr=0.1))
    config = PSConfig(["127.0.0.1:1"], 2, mode="sync", timeout=20.0,
                      heter_workers=("127.0.0.1:2",))
    heter = HeterWorker(config, 0, layout)
    heter._started = 0.0
    for r in (0, 1):
        heter._trainers[r] = _Trainer(r, f"trainer {r} (pid {r} on h)", None)
        heter._trainers[r].last_request = 100.0
    heter._reported, heter._step_since = {0}, 100.0  # trainer 0 waits in step 0 since t=100
    heter._check_liveness(110.0)
    assert heter._error is None  # within the timeout: waiting is no failure
    heter._trainers[0].last_request = 125.0  # trainer 0 keeps asking; trainer 1 is silent
    heter._check_liveness(125.0)
    assert str(heter._error) == (
        "trainer 1 (pid 1 on h) lost: sent no request for 25 s while trainer 0 waited in "
        "lock-step 0 (timeout 20 s, FLEETX_TIMEOUT)")

def test_a_heter_worker_has_nothing_to_serve_in_an_inference_only_job(caplog):
    import logging
    from fleetx.fleet.ps_util import DistributedInfer
    f = heter_fleet(heter_role=True)
    with caplog.at_level(logging.INFO, logger="fleetx.ps"):
        DistributedInfer(fleet=f).init_distributed_infer_env(dirname="ckpt")  # returns at once
    assert "inference runs the heter sections on the workers; nothing to serve" in caplog.text
