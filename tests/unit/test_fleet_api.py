"""The fleet API on one process: wrappers, misuse errors, util helpers, role queries."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from fleetx import DistributedStrategy
from fleetx.fleet import Fleet, FleetError, UtilBase
from fleetx.role_maker import Role, UserDefinedRoleMaker


@pytest.fixture
def fleet(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PADDLE_TRAINER_ENDPOINTS",
                 "PADDLE_TRAINER_ID", "PADDLE_PSERVERS_IP_PORT_LIST", "FLEETX_DRY_RUN"):
        monkeypatch.delenv(name, raising=False)
    f = Fleet()
    f.init(is_collective=True)
    return f


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_one_process_wrappers_train_like_plain_torch(fleet):
    model, plain = fleet.distributed_model(net()), net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(3):
        opt.minimize(nn.functional.mse_loss(model(x), y))
        ref.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        ref.step()
    for (k, a), (k2, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(a, b)
    assert model._engine is model.module  # no DDP with one process
    assert fleet.plan.applied == ()


def test_optimizer_wrapper_surface(fleet):
    model = fleet.distributed_model(net())
    opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.get_lr() == pytest.approx(0.01) and fleet.get_lr() == pytest.approx(0.01)
    fleet.set_lr(0.5)
    assert all(g["lr"] == 0.5 for g in opt.param_groups)
    with pytest.raises(TypeError, match="set_lr expects a real number or a one-element float "
                                        "tensor, got str"):
        opt.set_lr("0.1")
    opt.set_lr(np.float32(0.25))
    assert opt.get_lr() == 0.25
    opt.set_lr(torch.tensor(0.5))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    sd = opt.state_dict()
    fresh = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["param_groups"][0]["lr"] == 0.5


def test_lr_scheduler_accepts_the_wrapper(fleet):
    model = fleet.distributed_model(net())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.minimize(model(torch.randn(2, 4)).sum())
        sched.step()
    assert opt.get_lr() == pytest.approx(0.25)


def test_model_wrapper_forwards_attributes_and_modes(fleet):
    inner = net()
    inner.custom = "yes"
    model = fleet.distributed_model(inner)
    assert model.custom == "yes" and model.module is inner
    model.eval()
    assert not inner.training
    model.train()
    assert inner.training


def test_explain_prints_the_plan(fleet):
    fleet.distributed_model(net())
    out = io.StringIO()
    plan = fleet.explain(file=out)
    assert "data_parallel" in out.getvalue() and "one process" in out.getvalue()
    assert plan.applied == ()


def test_util_on_one_process_returns_values_of_the_same_kind(fleet):
    assert fleet.util.all_reduce(3) == 3 and isinstance(fleet.util.all_reduce(3), int)
    assert fleet.util.all_reduce(2.5, "max") == 2.5
    arr = fleet.util.all_reduce(np.array([[1, 2]]))
    assert isinstance(arr, np.ndarray) and arr.tolist() == [[1, 2]]
    t = fleet.util.all_reduce(torch.tensor([1.0]))
    assert isinstance(t, torch.Tensor)
    assert fleet.util.all_gather(7) == [7]
    assert fleet.util.broadcast(np.float32(1.5)) == 1.5
    with pytest.raises(ValueError, match=r"mode must be one of \['sum', 'max', 'min'\], got 'avg'"):
        fleet.util.all_reduce(1, "avg")
    with pytest.raises(ValueError, match="comm_world must be one of"):
        fleet.util.all_reduce(1, comm_world="server")
    with pytest.raises(TypeError, match="got str"):
        fleet.util.all_reduce("1")


@pytest.mark.parametrize("files, n, expected", [
    (list("abcde"), 2, [list("abc"), list("de")]),
    (list("ab"), 3, [["a"], ["b"], []]),
    (["1", "2", "3"], 2, [["1", "2"], ["3"]]),
    ([], 2, [[], []]),
])
def test_get_file_shard(files, n, expected):
    endpoints = [f"127.0.0.1:{6000 + i}" for i in range(n)]
    for index in range(n):
        f = Fleet()
        f.init(UserDefinedRoleMaker(is_collective=True, current_id=index,
                                    worker_endpoints=endpoints))
        assert f.util.get_file_shard(files) == expected[index]


def test_all_to_all_on_one_process(fleet):
    assert [a.tolist() for a in fleet.util.all_to_all([np.arange(3)])] == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"all_to_all takes one input per worker \(1\), got 2"):
        fleet.util.all_to_all([np.arange(3), np.arange(2)])
    with pytest.raises(ValueError, match="all_to_all inputs must be 1-D and of one dtype"):
        fleet.util.all_to_all([np.zeros((2, 2))])


def test_get_file_shard_needs_a_list(fleet):
    with pytest.raises(TypeError, match="files should be a list of file need to be read."):
        fleet.util.get_file_shard("a,b")


def test_print_on_rank(fleet, capsys):
    fleet.util.print_on_rank("hello", 0)
    fleet.util.print_on_rank("not me", 1)
    assert capsys.readouterr().out == "hello\n"


@pytest.mark.parametrize("call", ["worker_index", "worker_num", "is_first_worker", "init_worker",
                                  "distributed_model", "barrier_worker", "explain"])
def test_calls_before_init_are_clear_errors(call):
    f = Fleet()
    with pytest.raises(FleetError, match=r"call fleet.init\(\) before fleet\."):
        getattr(f, call)(*([net()] if call == "distributed_model" else []))


def test_init_argument_errors():
    with pytest.raises(ValueError, match="`is_collective` should be instance of `bool`, but got str"):
        Fleet().init(is_collective="yes")
    with pytest.raises(ValueError, match="`role_maker` should be subclass of `RoleMakerBase`"):
        Fleet().init(role_maker="worker")
    with pytest.raises(TypeError, match="expects a DistributedStrategy, got dict"):
        Fleet().init(is_collective=True, strategy={"amp": True})


def test_wrapper_argument_errors(fleet):
    with pytest.raises(ValueError, match="expects a torch.nn.Module, got NoneType"):
        fleet.distributed_model(None)
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer, got list"):
        fleet.distributed_optimizer([])
    with pytest.raises(FleetError, match=r"call fleet.distributed_optimizer\(...\) before fleet.get_lr"):
        fleet.get_lr()


def test_strategy_is_copied_and_replaced_by_distributed_optimizer(fleet):
    s = DistributedStrategy()
    s.fuse_grad_size_in_MB = 8
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    s.fuse_grad_size_in_MB = 16
    assert f._strategy.fuse_grad_size_in_MB == 8
    model = f.distributed_model(net())
    s2 = DistributedStrategy()
    s2.fuse_grad_size_in_MB = 2
    with pytest.warns(UserWarning, match="replaces the one given to fleet.init"):
        f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy=s2)
    assert f._strategy.fuse_grad_size_in_MB == 2


@pytest.mark.parametrize("call", ["init_worker", "stop_worker", "init_server", "run_server"])
def test_runtime_calls_in_a_one_process_collective_job_warn_as_paddle(fleet, call):
    with pytest.warns(UserWarning, match=rf"{call}\(\) function doesn't work when use "
                                         rf"non_distributed fleet\."):
        getattr(fleet, call)()


@pytest.mark.parametrize("call", ["init_worker", "stop_worker"])
def test_runtime_calls_before_an_optimizer_in_a_collective_job_raise_value_error(call):
    f = Fleet()  # two workers; a user-defined role opens no connection until one is needed
    f.init(UserDefinedRoleMaker(is_collective=True, current_id=0,
                                worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"]))
    with pytest.raises(ValueError, match="Fleet can not find suitable runtime handler") as err:
        getattr(f, call)()
    assert isinstance(err.value, FleetError)


class MyUtil(UtilBase):
    """Paddle's documented pattern: a plain ``super().__init__()``."""

    def __init__(self):
        super().__init__()

    def get_user_id(self):
        return 10


def test_a_util_subclass_assigned_to_fleet_util_serves_that_fleet(fleet):
    util = MyUtil()
    fleet.util = util
    assert fleet.util is util and util._fleet is fleet
    assert util.get_user_id() == 10 and util.all_reduce(np.array([3, 4])).tolist() == [3, 4]
    assert util.get_file_shard(["a", "b"]) == ["a", "b"]
    bound = UtilBase(Fleet())
    fleet.util = bound  # a util built for another fleet keeps it
    assert bound._fleet is not fleet


def test_module_level_util_assignment_binds_the_default_fleet():
    from fleetx import fleet as module
    previous = module.util
    try:
        module.util = MyUtil()
        assert module.util._fleet is module._fleet and module.util.get_user_id() == 10
    finally:
        module.util = previous


def test_util_before_init_names_the_attribute():
    with pytest.raises(FleetError, match=r"^call fleet.init\(\) before using fleet.util$"):
        Fleet().util.barrier()


def test_applied_lists_before_an_optimizer_are_empty_as_in_paddle(fleet, capsys):
    assert fleet._final_strategy() == {} and fleet._get_applied_meta_list() == []
    assert fleet._get_applied_graph_list() == []
    assert "WARNING: You may need to call minimize function before _get_applied_meta_list " \
           "called" in capsys.readouterr().out


def test_final_strategy_and_applied_meta_list_reflect_the_plan(fleet):
    s = DistributedStrategy()
    s.amp = True
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2}
    s.recompute = True  # skipped with a warning: recompute_configs names no module
    s.fp16_allreduce = True  # skipped on one process: nothing to all-reduce
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(net())
    with pytest.warns(UserWarning):
        f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    # Paddle's chain, head first: gradient merge wraps AMP.
    assert f._get_applied_meta_list() == ["GradientMergeOptimizer", "AMPOptimizer"]
    assert f._get_applied_graph_list() == []  # one process: no data parallel
    final = f._final_strategy()
    assert isinstance(final, DistributedStrategy) and final is not f._strategy
    assert (final.amp, final.gradient_merge, final.recompute, final.fp16_allreduce) == (
        True, True, False, False)
    assert final.gradient_merge_configs["k_steps"] == 2 and f._strategy.recompute is True


def merge_fleet(k_steps=2, **switches):
    s = DistributedStrategy()
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": k_steps}
    for key, value in switches.items():
        setattr(s, key, value)
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(net())
    return f, model, f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))


def test_minimize_and_step_say_whether_the_parameters_were_updated():
    f, model, opt = merge_fleet(k_steps=2)
    x = torch.randn(4, 4)
    taken = []
    for _ in range(4):
        before = model.module[0].weight.clone()
        taken.append(f.minimize(model(x).square().mean()))
        assert taken[-1] is (not torch.equal(before, model.module[0].weight))
    assert taken == [False, True, False, True]
    opt.backward(model(x).square().mean())
    assert opt.step() is False and opt.last_step_taken is False
    opt.backward(model(x).square().mean())
    loss = opt.step(closure=lambda: torch.tensor(7.0))  # torch's contract: the closure's loss
    assert loss.item() == 7.0 and opt.last_step_taken is True


def test_minimize_is_false_on_a_skipped_amp_step(fleet):
    s = DistributedStrategy()
    s.amp = True
    f = Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(net())
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    before = model.module[0].weight.clone()
    assert opt.minimize(model(x).sum() * float("inf")) is False
    assert torch.equal(before, model.module[0].weight)
    assert opt.minimize(model(x).square().mean()) is True


def test_lr_scheduler_under_gradient_merge_counts_updates_with_the_recipe():
    # StepLR(10, 0.5), k_steps=2, 50 micro-steps = 25 updates: two decays, 0.05 -> 0.0125.
    f, model, opt = merge_fleet(k_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    x = torch.randn(4, 4)
    updates = 0
    for _ in range(50):
        if opt.minimize(model(x).square().mean()):
            sched.step()
            updates += 1
    assert updates == 25 and opt.get_lr() == pytest.approx(0.05 * 0.5 ** 2)
    # Without the recipe the scheduler counts micro-steps: five decays, 0.05 -> 0.0016.
    f, model, opt = merge_fleet(k_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for _ in range(50):
        opt.minimize(model(x).square().mean())
        sched.step()
    assert opt.get_lr() == pytest.approx(0.05 * 0.5 ** 5) and round(opt.get_lr(), 4) == 0.0016


def test_set_state_dict_is_paddles_name_for_load_state_dict():
    f, model, opt = merge_fleet(k_steps=3)
    opt.minimize(model(torch.randn(2, 4)).sum())
    saved = opt.state_dict()
    _, _, fresh = merge_fleet(k_steps=3)
    fresh.set_lr(0.5)
    fresh.set_state_dict(saved)
    assert fresh.get_lr() == pytest.approx(0.05)
    assert fresh.state_dict()["fleetx"]["gradient_merge"] == {"micro_step": 1}


def test_ps_mode_init_opens_nothing_and_runtime_needs_a_plan():
    f = Fleet()
    f.init(UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=2,
                                server_endpoints=["127.0.0.1:1"]))  # nothing listens there
    assert f.is_worker() and f.worker_num() == 2 and f.server_num() == 1
    assert f._comm is None
    with pytest.raises(FleetError, match="Fleet can not find suitable runtime handler"):
        f.init_worker()


def test_dry_run_prints_plan_and_exits(fleet, monkeypatch, capsys):
    monkeypatch.setenv("FLEETX_DRY_RUN", "1")
    model = fleet.distributed_model(net())
    with pytest.raises(SystemExit) as ex:
        fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert ex.value.code == 0
    assert "fleetx plan" in capsys.readouterr().out


def test_optimizer_first_then_model_share_one_context(fleet):
    inner = net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(inner.parameters(), lr=0.1))
    model = fleet.distributed_model(inner)
    model(torch.randn(2, 4))
    assert opt._ctx is fleet._ctx and model._built_for is fleet._ctx
    assert opt._ctx.model is inner


def test_step_hooks_on_the_wrapper_run(fleet):
    model = fleet.distributed_model(net())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.minimize(model(torch.randn(2, 4)).sum())
    assert calls == ["pre", "post"]


def test_eval_copies_and_nested_checkpoints(fleet):
    import copy
    model = fleet.distributed_model(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    outer = nn.Sequential(model)
    assert list(outer.state_dict())[:2] == ["0.0.weight", "0.0.bias"]
    assert str(outer.load_state_dict(outer.state_dict())) == "<All keys matched successfully>"
    ema = copy.deepcopy(model)  # a plain copy that does not take part in the job
    assert ema._context_of is None and ema(torch.randn(2, 4)).shape == (2, 3)
    model.eval()
    assert not model.module[1].training
    assert model(torch.randn(2, 4)).shape == (2, 3)
