"""Every setting of DistributedStrategy either has a reader or declares why it has no effect.

Readers are found by recording which config fields are read (``recording_reads``) while every
strategy is applied and then trains for two steps in a one-process gloo group: a key nobody
reads must carry ``no_effect``, and a key declared without effect must not be read. The plan and
``fleet.explain()`` name the no-effect settings a user changed, and the ``*_configs`` set while
their switch is off.
"""
from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fleetx import fleet as fleet_module
from fleetx.fleet.fleet import Fleet
from fleetx.parallel.pipeline import PipelineLayer
from fleetx.role_maker import UserDefinedRoleMaker
from fleetx.strategy.algorithms.pipeline import pipeline_model
from fleetx.strategy.algorithms.tensor_parallel import init_seed
from fleetx.strategy.api import (Mode, ModelInfo, OptimizerInfo, PlanInput, StrategyError,
                                 TrainingContext, WorldInfo, registered)
from fleetx.strategy.config import recording_reads
from fleetx.strategy.distributed_strategy import MESSAGES, DistributedStrategy, TopLevelConfig
from fleetx.strategy.planner import load_strategies, make_plan

GM2 = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "avg": False}}
# Settings under which each strategy applies (what they read is recorded, not listed here).
SCENARIOS = [
    (dict(amp=True, lars=True, **GM2), WorldInfo(world_size=2), "sgd", True),
    (dict(amp=True, lamb=True, build_strategy={"fuse_all_optimizer_ops": True}),
     WorldInfo(world_size=2), "adam", True),
    (dict(dgc=True, fp16_allreduce=True, nccl_comm_num=2,
          dgc_configs={"rampup_begin_step": 0}), WorldInfo(world_size=2), "sgd", True),
    (dict(localsgd=True, localsgd_configs={"k_steps": 2}), WorldInfo(world_size=2), "sgd", True),
    (dict(adaptive_localsgd=True), WorldInfo(world_size=2), "sgd", True),
    (dict(recompute=True, recompute_configs={"checkpoints": ["0", "2"]}),
     WorldInfo(world_size=2), "sgd", True),
    # Stage 1 on a 2-process plan over the 1-process group (ZeroRedundancyOptimizer runs on it).
    (dict(sharding=True, sharding_configs={"stage": 1, "sharding_degree": 2, "dp_degree": 1,
                                           "hybrid_dp": False}),
     WorldInfo(world_size=2), "adam", True),
    # The hierarchy needs several nodes: applied only (its reads happen in apply).
    (dict(use_hierarchical_allreduce=True, hierarchical_allreduce_inter_nranks=2,
          sync_batch_norm=True, execution_strategy={"num_threads": 2}),
     WorldInfo(world_size=4, local_world_size=2, device="cuda"), "sgd", False),
    # auto measures in the fleet at the first training forward: applied only here.
    (dict(auto=True), WorldInfo(world_size=2), "sgd", False),
    (dict(anomaly_guard=True, anomaly_guard_configs={"min_history": 1}), WorldInfo(), "sgd",
     True),
    (dict(a_sync=True, a_sync_configs={"k_steps": 0}), WorldInfo(mode=Mode.PS), "sgd", True),
    # With servers the mode reaches the cluster config (nothing connects before init_worker).
    (dict(a_sync=False), WorldInfo(mode=Mode.PS, server_num=1,
                                   server_endpoints=("127.0.0.1:9",)), "sgd", False),
    # A heter worker: the device guard reaches its runtime (nothing runs before run_server).
    (dict(a_sync=True, a_sync_configs={"heter_worker_device_guard": "gpu"}),
     WorldInfo(rank=1, mode=Mode.PS, server_num=1, server_endpoints=("127.0.0.1:9",),
               is_heter_worker=True, heter_endpoints=("127.0.0.1:10",)), "sgd", False),
]


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _strategy(fields):
    s = DistributedStrategy()
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def _train(ctx, model, steps=2):
    """Two steps through the context's hook points, as the fleet's wrappers run them."""
    for wrap in ctx.model_wrappers:
        model = wrap(model)
    for _ in range(steps):
        with ctx.forward_context():
            loss = model(torch.randn(4, 128)).float().pow(2).mean()
        for listener in ctx.loss_listeners:
            listener(loss)
        ctx.backward(loss)
        if all(guard() for guard in ctx.step_guards):
            ctx.optimizer.step()
        for hook in ctx.after_step:
            hook()
        if all(guard() for guard in ctx.zero_grad_guards):
            ctx.optimizer.zero_grad()


def _apply_and_train(fields, world, opt_kind, run):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 160), nn.ReLU(), nn.Linear(160, 4))  # 20480 >= DGC's min
    opt = (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if opt_kind == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    s = _strategy(fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(PlanInput(s, world, ModelInfo.of(model), OptimizerInfo.of(opt)))
    assert len(plan.applied) >= len([k for k in fields if not k.endswith("_configs")]) - 1
    with recording_reads() as reads:
        ctx = TrainingContext(world, s, opt, model)
        for name in plan.applied:
            registered(name)(s).apply(ctx)
        if run:
            _train(ctx, model)
    return plan.applied, reads


@pytest.fixture(scope="module")
def reads(one_process_group):
    load_strategies()
    found, applied = set(), set()
    threads = torch.get_num_threads()
    try:
        for fields, world, opt_kind, run in SCENARIOS:
            names, scenario_reads = _apply_and_train(fields, world, opt_kind, run)
            applied.update(names)
            found |= scenario_reads
        # fleet.init seeds the model-parallel streams (mp_degree > 1 needs several processes:
        # tests/distributed/test_hcg.py runs it; here only what it reads is recorded)
        with recording_reads() as init_reads:
            init_seed(_strategy({"hybrid_configs": {"mp_degree": 2}}), 2)
        found |= init_reads
        # fleet.distributed_model(PipelineLayer) reads pipeline_configs (here a one-stage pipe)
        with recording_reads() as pipe_reads:
            stage = PipelineLayer([nn.Linear(2, 2)], loss_fn=nn.MSELoss(), group=dist.group.WORLD)
            pipeline_model(stage, _strategy({}))
        found |= pipe_reads
        # sharding_configs['units'] picks the units of stages 2 and 3, which need several
        # processes (tests/distributed/test_sharding_units.py); the plan reads it to list them
        # (the planner's own reads, of every setting's value, are not the strategies')
        with recording_reads() as unit_reads:
            s = _strategy({"sharding": True, "sharding_configs": {"stage": 3}})
            make_plan(PlanInput(s, WorldInfo(world_size=2), ModelInfo.of(nn.Linear(2, 2))))
        found |= {"sharding_configs.units"} & unit_reads
    finally:
        torch.set_num_threads(threads)  # execution_strategy's num_threads
    # tensor_parallel_plan applies with mp_degree > 1 only, which needs several processes
    # (tests/distributed/test_tp_plan.py); it reads hybrid_configs, read above by init_seed
    assert applied == {c.name for c in registered()} - {"no_effect", "configs_without_switch",
                                                        "tensor_parallel_plan"}
    return found


def _settings():
    for key in TopLevelConfig.specs():
        yield TopLevelConfig, key
    for cls in MESSAGES.values():
        for key in cls.specs():
            yield cls, key


def _refused(cls, key):
    """Whether switching a bool key away from its default (with its switch on) fails the plan,
    naming the key: such a key acts by being refused."""
    spec = cls.specs()[key]
    if spec.type is not bool or cls is TopLevelConfig:
        return False
    switch = cls.section[:-len("_configs")]
    s = _strategy({switch: True, cls.section: {key: not spec.default}})
    try:
        make_plan(PlanInput(s, WorldInfo()))
    except StrategyError as err:
        return key in str(err)
    return False


def test_every_setting_has_a_reader_or_declares_no_effect(reads):
    load_strategies()
    switches = {c.name for c in registered()}
    silent = [cls.key_name(k) for cls, k in _settings()
              if cls.key_name(k) not in reads and not cls.no_effect_of(k)
              and not (cls is TopLevelConfig and k in switches) and not _refused(cls, k)]
    assert not silent, f"no code reads these settings and none declares no_effect: {silent}"


def test_no_setting_declared_without_effect_is_read(reads):
    lying = [cls.key_name(k) for cls, k in _settings()
             if cls.no_effect_of(k) and cls.key_name(k) in reads]
    assert not lying, f"declared no_effect but read while training: {lying}"


def test_the_recorder_sees_reads_through_copies_only_when_read():
    s = _strategy({"amp": True, "amp_configs": {"decr_ratio": 0.5}})
    with recording_reads() as seen:
        cfg = s.typed_config("amp")
        assert seen == set()
        assert cfg.decr_ratio == 0.5
    assert seen == {"amp_configs.decr_ratio"}


@pytest.mark.parametrize("fields,named", [
    ({"a_sync_configs": {"use_ps_gpu": 1}},
     "a_sync_configs.use_ps_gpu (GPU parameter servers are not offered)"),
    ({"a_sync_configs": {"launch_barrier": False}}, "a_sync_configs.launch_barrier (workers "
                                                    "always wait for the servers"),
    ({"a_sync_configs": {"lr_decay_steps": 100}}, "a_sync_configs.lr_decay_steps (use an LR "
                                                  "scheduler"),
    ({"recompute": True, "recompute_configs": {"checkpoints": ["0"], "enable_offload": True}},
     "recompute_configs.enable_offload (offload is not implemented: on CPU the kept inputs"),
    ({"pipeline": True}, "pipeline (pipelines run when hybrid_configs['pp_degree'] > 1"),
    ({"tensor_parallel": True}, "tensor_parallel (no switch is needed: "
                                "hybrid_configs['mp_degree']"),
    ({"sharding_configs": {"mp_degree": 2}},
     "sharding_configs.mp_degree (sharding together with tensor or pipeline parallelism is not "
     "implemented"),
])
def test_the_plan_names_settings_without_effect(fields, named):
    plan = make_plan(PlanInput(_strategy(fields), WorldInfo()))
    entry = next(e for e in plan.entries if e.name == "no_effect")
    assert entry.warn and named in entry.reason
    assert named in str(plan)


def test_a_default_value_is_not_named():
    plan = make_plan(PlanInput(_strategy({"a_sync_configs": {"use_ps_gpu": 0}}), WorldInfo()))
    assert "no_effect" not in [e.name for e in plan.warnings]


@pytest.mark.parametrize("section,switch", [("amp_configs", "amp"),
                                            ("localsgd_configs", "localsgd"),
                                            ("gradient_merge_configs", "gradient_merge"),
                                            ("dgc_configs", "dgc")])
def test_configs_set_while_the_switch_is_off_are_named(section, switch):
    key = next(iter(MESSAGES[section].specs()))
    value = MESSAGES[section].specs()[key].default
    changed = value * 2 + 1 if isinstance(value, int) else ([0.5] if isinstance(value, list)
                                                            else value * 2 + 1)
    plan = make_plan(PlanInput(_strategy({section: {key: changed}}), WorldInfo()))
    entry = next(e for e in plan.entries if e.name == "configs_without_switch")
    assert entry.warn
    assert (f"{section} set while strategy.{switch} is off: ignored (set strategy.{switch} = "
            f"True to use it)") in entry.reason
    on = make_plan(PlanInput(_strategy({section: {key: changed}, switch: True}),
                             WorldInfo(world_size=2),
                             optimizer=OptimizerInfo("SGD", (("momentum", 0.9),))))
    assert "configs_without_switch" not in [e.name for e in on.entries if e.warn]


@pytest.mark.parametrize("section", ["hybrid_configs", "pipeline_configs",
                                     "tensor_parallel_configs", "a_sync_configs"])
def test_configs_that_need_no_switch_are_not_named_as_switched_off(section):
    key = {"hybrid_configs": "mp_degree", "pipeline_configs": "accumulate_steps",
           "tensor_parallel_configs": "tensor_parallel_degree", "a_sync_configs": "k_steps"}
    plan = make_plan(PlanInput(_strategy({section: {key[section]: 2}}), WorldInfo()))
    assert "configs_without_switch" not in [e.name for e in plan.warnings]


def test_explain_names_a_key_without_effect(capsys):
    f = Fleet()
    rm = UserDefinedRoleMaker(is_collective=True, current_id=0, worker_num=1,
                              worker_endpoints=["127.0.0.1:6170"])
    s = _strategy({"a_sync_configs": {"use_ps_gpu": 1}, "amp_configs": {"incr_ratio": 4.0}})
    f.init(role_maker=rm, strategy=s)
    out = io.StringIO()
    f.explain(file=out)
    text = out.getvalue()
    assert "a_sync_configs.use_ps_gpu (GPU parameter servers are not offered)" in text
    assert "amp_configs set while strategy.amp is off" in text
    assert fleet_module is not None


def test_distributed_optimizer_warns_about_settings_without_effect():
    f = Fleet()
    rm = UserDefinedRoleMaker(is_collective=True, current_id=0, worker_num=1,
                              worker_endpoints=["127.0.0.1:6170"])
    f.init(role_maker=rm, strategy=_strategy({"a_sync_configs": {"lr_decay_steps": 5},
                                              "localsgd_configs": {"k_steps": 4}}))
    model = nn.Linear(2, 1)
    with pytest.warns(UserWarning) as caught:
        f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    text = "\n".join(str(w.message) for w in caught)
    assert "a_sync_configs.lr_decay_steps (use an LR scheduler" in text
    assert "localsgd_configs set while strategy.localsgd is off" in text
    # notices about settings are not skipped strategies, in the warning or in the plan
    assert "skipped" not in text
    plan = str(f.explain(file=io.StringIO()))
    assert "no_effect                  WARNING   set but without effect" in plan
    assert "configs_without_switch     WARNING   localsgd_configs set" in plan
