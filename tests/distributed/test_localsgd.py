"""Local SGD and adaptive local SGD on 2 processes:

* ``k_steps=1`` equals plain data parallel (1 process on the double batch), to 1e-5;
* ``k_steps=3, begin_step=2`` equals a simulation of two replicas in one process (gradients
  averaged for steps 1-2, then local steps and a parameter average after steps 5, 8, 11), to 1e-5;
  the ranks hold bitwise identical parameters right after each average and different ones between,
  and ``average_parameters()`` after the last (local) step gives every rank the same model;
  collectives are counted: DDP's gradient hook runs only in steps 1-2, and one parameter
  all-reduce happens per averaging (3 in 12 steps, against 12 gradient all-reduces for DDP);
* localsgd + amp: trains, ranks identical after every average, and an inf on one rank in a local
  step skips that rank's step only (no flag all-reduce while gradients are not synchronised);
* adaptive_localsgd with an exponentially decaying learning rate: the interval grows (from 1 to
  more than 4), each interval equals ``ceil(sqrt(lr0 * loss / (lr * loss0)))`` computed here from
  both ranks' losses, and the ranks are identical after every average.

One spawn runs every case; the parent compares.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run  # noqa: E402

from fleetx.strategy.algorithms.adaptive_localsgd import next_interval  # noqa: E402

STEPS, B, K, BEGIN = 12, 8, 3, 2
LR, MU = 0.05, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(B, 10, generator=g), torch.randn(B, 3, generator=g)


def data_parallel_reference() -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MU)
    for step in range(1, STEPS + 1):
        (x0, y0), (x1, y1) = batch(0, step), batch(1, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        opt.step()
    return model.state_dict()


def local_sgd_simulation() -> list[dict]:
    """Two replicas in one process: Paddle's local SGD schedule, written out plainly."""
    replicas = [make_model(), make_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MU) for m in replicas]
    for step in range(1, STEPS + 1):
        for rank, (model, opt) in enumerate(zip(replicas, opts)):
            opt.zero_grad()
            x, y = batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
        if step <= BEGIN:  # warm-up: synchronous
            for p0, p1 in zip(*(m.parameters() for m in replicas)):
                p0.grad = p1.grad = (p0.grad + p1.grad) / 2
        for opt in opts:
            opt.step()
        if step > BEGIN and (step - BEGIN) % K == 0:
            with torch.no_grad():
                for p0, p1 in zip(*(m.parameters() for m in replicas)):
                    p0.copy_((p0 + p1) / 2)
                    p1.copy_(p0)
    return [m.state_dict() for m in replicas]


class Counter:
    """Counts gradient buckets (through a DDP comm hook) and parameter all-reduces."""

    def __init__(self, n_params: int) -> None:
        import torch.distributed as dist
        self.n_params, self.buckets, self.param_syncs, self.flags = n_params, 0, 0, 0
        self.in_hook = False
        self._all_reduce = dist.all_reduce
        dist.all_reduce = self.all_reduce

    def all_reduce(self, tensor, *args, **kwargs):
        if not self.in_hook:  # the hook's own all-reduce is a gradient bucket
            self.param_syncs += int(tensor.numel() == self.n_params)
            self.flags += int(tensor.numel() == 1)
        return self._all_reduce(tensor, *args, **kwargs)

    def hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.buckets += 1
        self.in_hook = True
        try:
            return allreduce_hook(state, bucket)
        finally:
            self.in_hook = False

    def snapshot(self) -> tuple[int, int, int]:
        return self.buckets, self.param_syncs, self.flags


def _init(**switches):
    from fleetx import fleet
    s = fleet.DistributedStrategy()
    for key, value in switches.items():
        setattr(s, key, value)
    fleet.init(is_collective=True, strategy=s)
    return fleet


def _run(fleet, rank, steps=STEPS, inject=(), make_scheduler=None):
    model = fleet.distributed_model(make_model())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MU))
    counter = Counter(sum(p.numel() for p in model.parameters()))
    opt._ctx.comm_hooks.append((None, counter.hook))
    sched = make_scheduler(opt) if make_scheduler else None
    trace = []
    for step in range(1, steps + 1):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.backward(loss)
        if step in inject:
            model.module[0].weight.grad[0, 0] = math.inf
        lr = opt.get_lr()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        state = {k: v for k, v in opt._ctx.state.items() if k != "amp"}
        trace.append({"loss": loss.item(), "lr": lr, "weight": model.module[0].weight.clone(),
                      "counts": counter.snapshot(), "state": {
                          k: v.state_dict() for k, v in state.items()}})
    last = {k: v.clone() for k, v in model.state_dict().items()}
    opt.average_parameters()  # every rank, before saving: ends local SGD's drift
    import torch.distributed as dist
    dist.all_reduce = counter._all_reduce
    return {"state": last, "averaged": model.state_dict(), "trace": trace,
            "plan": fleet.applied_strategies()}


def _train(rank: int, world: int, out: str) -> None:
    results = {"k1": _run(_init(localsgd=True), rank)}
    results["k3"] = _run(_init(localsgd=True,
                               localsgd_configs={"k_steps": K, "begin_step": BEGIN}), rank)
    results["amp"] = _run(_init(localsgd=True, localsgd_configs={"k_steps": 2, "begin_step": 1},
                                amp=True, amp_configs={"init_loss_scaling": 8.0}),
                          rank, steps=8, inject={4} if rank == 0 else ())
    results["adaptive"] = _run(
        _init(adaptive_localsgd=True), rank, steps=40,
        make_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8))
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("localsgd")
    run(_train, 2, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_k1_is_plain_data_parallel(ranks):
    expected = data_parallel_reference()
    for result in ranks:
        assert result["k1"]["plan"] == ("data_parallel", "localsgd")
        for name, value in expected.items():
            torch.testing.assert_close(result["k1"]["state"][name], value, rtol=0, atol=1e-5)


def test_k3_equals_the_two_replica_simulation(ranks):
    for result, expected in zip(ranks, local_sgd_simulation()):
        for name, value in expected.items():
            torch.testing.assert_close(result["k3"]["state"][name], value, rtol=0, atol=1e-5)


def synced_steps(trace) -> list[int]:
    counts = [t["counts"][1] for t in trace]
    return [i + 1 for i, (a, b) in enumerate(zip([0] + counts, counts)) if b > a]


def test_k3_communicates_one_time_in_k(ranks):
    t0, t1 = ranks[0]["k3"]["trace"], ranks[1]["k3"]["trace"]
    assert synced_steps(t0) == synced_steps(t1) == [5, 8, 11]
    buckets = [t["counts"][0] for t in t0]
    assert buckets[BEGIN - 1] > 0 and buckets[-1] == buckets[BEGIN - 1]  # no DDP after warm-up
    for step, (a, b) in enumerate(zip(t0, t1), start=1):
        same = torch.equal(a["weight"], b["weight"])
        assert same is (step <= BEGIN or step in (5, 8, 11)), step
    assert t0[-1]["state"]["localsgd"] == {"step": STEPS, "syncs": 3}


def test_average_parameters_before_saving_gives_every_rank_the_same_model(ranks):
    # Step 12 is a local step (the last average was after step 11): the ranks end apart, and
    # a model saved by rank 0 alone would be its own. average_parameters() ends that.
    last = [r["k3"]["state"] for r in ranks]
    assert any(not torch.equal(last[0][k], last[1][k]) for k in last[0])
    simulated = local_sgd_simulation()
    for name in last[0]:
        saved = [r["k3"]["averaged"][name] for r in ranks]
        assert torch.equal(saved[0], saved[1]), name
        torch.testing.assert_close(saved[0], (simulated[0][name] + simulated[1][name]) / 2,
                                   rtol=0, atol=1e-5)
    # Where the ranks never drift (k_steps=1 is data parallel) it changes nothing.
    for r in ranks:
        for name, value in r["k1"]["state"].items():
            assert torch.equal(r["k1"]["averaged"][name], value)


def test_average_parameters_under_adaptive_localsgd_ends_the_drift(ranks):
    # With the interval grown to 16, the 40 steps end between averages: the ranks end apart
    # until average_parameters() gives both the mean of their models.
    last = [r["adaptive"]["state"] for r in ranks]
    assert any(not torch.equal(last[0][k], last[1][k]) for k in last[0])
    for name in last[0]:
        saved = [r["adaptive"]["averaged"][name] for r in ranks]
        assert torch.equal(saved[0], saved[1]), name
        torch.testing.assert_close(saved[0], (last[0][name] + last[1][name]) / 2,
                                   rtol=0, atol=1e-6)


def test_localsgd_with_amp(ranks):
    t0, t1 = ranks[0]["amp"]["trace"], ranks[1]["amp"]["trace"]
    assert ranks[0]["amp"]["plan"] == ("data_parallel", "localsgd", "amp")
    assert synced_steps(t0) == [3, 5, 7]
    for step in (1, 3, 5, 7):
        assert torch.equal(t0[step - 1]["weight"], t1[step - 1]["weight"])
    # Step 4 is local: rank 0 skipped it (its inf), rank 1 stepped; no flag was all-reduced.
    assert torch.equal(t0[3]["weight"], t0[2]["weight"])
    assert not torch.equal(t1[3]["weight"], t1[2]["weight"])
    assert t0[3]["counts"][2] == t0[2]["counts"][2]
    assert t0[-1]["loss"] < t0[0]["loss"]


def test_adaptive_interval_grows_as_the_learning_rate_decays(ranks):
    t0, t1 = ranks[0]["adaptive"]["trace"], ranks[1]["adaptive"]["trace"]
    assert ranks[0]["adaptive"]["plan"] == ("data_parallel", "adaptive_localsgd")
    ks = [t["state"]["adaptive_localsgd"]["k_steps"] for t in t0]
    assert ks == [t["state"]["adaptive_localsgd"]["k_steps"] for t in t1]
    assert ks[0] == 1 and ks[-1] > 4 and ks == sorted(ks)
    syncs = synced_steps(t0)
    assert len(syncs) < 20
    lr0, loss0 = t0[0]["lr"], (t0[0]["loss"] + t1[0]["loss"]) / 2
    last = 1
    for step in syncs:
        a, b = t0[step - 1], t1[step - 1]
        assert torch.equal(a["weight"], b["weight"])
        assert step - last == t0[last - 1]["state"]["adaptive_localsgd"]["k_steps"]
        expected = next_interval(lr0, loss0, a["lr"], (a["loss"] + b["loss"]) / 2, 1)
        assert a["state"]["adaptive_localsgd"]["k_steps"] == expected
        last = step
