"""The pipeline's pure parts: segmentation, the schedules as data, and the errors (one process,
no communication)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fleetx.parallel.pipeline import LayerDesc, PipelineLayer, SharedLayerDesc, segment
from fleetx.parallel.pipeline_parallel import PipelineParallel
from fleetx.parallel.schedule import bubble_fraction, max_in_flight, normalize_mode, steps


def _mixed():
    """Embedding, then 3 x (Linear, GELU), then LayerNorm: 8 layers, 3 of them Linear."""
    body = [m for _ in range(3) for m in (LayerDesc(nn.Linear, 4, 4), nn.GELU())]
    return [LayerDesc(nn.Embedding, 10, 4)] + body + [nn.LayerNorm(4)]


@pytest.mark.parametrize("n,stages,bounds", [(8, 2, [0, 4, 8]), (9, 4, [0, 3, 5, 7, 9]),
                                             (5, 5, [0, 1, 2, 3, 4, 5]), (7, 3, [0, 3, 5, 7])])
def test_uniform_splits_the_count_the_first_stages_taking_the_remainder(n, stages, bounds):
    assert segment([nn.ReLU()] * n, stages) == bounds


def test_layer_method_splits_the_matching_layers_each_stage_ending_after_its_last():
    layers = _mixed()  # Linear at 1, 3, 5
    assert segment(layers, 3, "layer:Linear") == [0, 2, 4, 8]
    assert segment(layers, 2, "layer:Linear") == [0, 4, 8]
    assert segment(layers, 2, "layer:linear") == [0, 4, 8]  # case-insensitive, as in Paddle
    assert segment(layers, 1, "layer:Embedding|LayerNorm") == [0, 8]


def test_segmentation_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown seg_method 'by_size': use 'uniform' or "
                                         r"'layer:<ClassName>'"):
        segment(_mixed(), 2, "by_size")
    with pytest.raises(ValueError, match=r"'layer:Linear' matches 3 layers, fewer than the 4 "
                                         r"pipeline stages \(classes: \['Embedding', 'GELU', "
                                         r"'LayerNorm', 'Linear'\]\)"):
        segment(_mixed(), 4, "layer:Linear")
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 pipeline stages"):
        segment([nn.ReLU()] * 2, 3)


def test_schedules_as_data():
    assert steps("FThenB", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1),
                                        ("B", 2)]
    assert steps("F-then-B", 4, 3, 2) == steps("FThenB", 4, 3, 2)
    assert steps("1F1B", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3),
                                      ("B", 1), ("B", 2), ("B", 3)]
    assert steps("1F1B", 3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for p in (2, 4, 8):
        for m in (1, 3, 8, 16):
            for s in range(p):
                order = steps("1F1B", p, s, m)
                assert sorted(order) == sorted(steps("FThenB", p, s, m))  # each step once
                assert max_in_flight(order) == min(p - s, m) <= p
                assert max_in_flight(steps("FThenB", p, s, m)) == m
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"unknown schedule_mode 'GPipe': use one of "
                                         r"\('1F1B', 'FThenB'\)"):
        normalize_mode("GPipe")
    with pytest.raises(ValueError, match=r"stage 2 is not in \[0, 2\)"):
        steps("1F1B", 2, 2, 4)


def test_one_stage_builds_everything_with_the_sequential_keys():
    stage = PipelineLayer(_mixed(), loss_fn=nn.MSELoss())
    reference = nn.Sequential(*[d.build_layer() if isinstance(d, LayerDesc) else d
                                for d in _mixed()])
    assert list(stage.state_dict()) == list(reference.state_dict())
    stage.load_state_dict(reference.state_dict())
    tokens = torch.tensor([1, 2, 3])
    assert torch.equal(stage(tokens), reference(tokens))


def test_a_shared_layer_has_the_keys_of_each_place_and_one_parameter():
    layers = [SharedLayerDesc("embed", nn.Embedding, None, "weight", 10, 4),
              LayerDesc(nn.Linear, 4, 4),
              SharedLayerDesc("embed", nn.Embedding, lambda e, h: h @ e.weight.t(), "weight",
                              10, 4)]
    stage = PipelineLayer(layers, loss_fn=nn.CrossEntropyLoss())
    assert list(stage.state_dict()) == ["0.weight", "1.weight", "1.bias", "2.weight"]
    assert len(list(stage.parameters())) == 3
    assert stage(torch.tensor([1, 2])).shape == (2, 10)


def test_one_stage_train_batch_equals_plain_micro_batching():
    torch.manual_seed(0)
    stage = PipelineLayer([LayerDesc(nn.Linear, 3, 5), nn.Tanh(), LayerDesc(nn.Linear, 5, 1)],
                          loss_fn=nn.MSELoss(), recompute_interval=2)
    reference = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    reference.load_state_dict(stage.state_dict())
    model = PipelineParallel(stage, micro_batch_size=2, accumulate_steps=3)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    loss = model.train_batch([x, y], torch.optim.SGD(stage.parameters(), lr=0.5))
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    for key, value in reference.state_dict().items():
        assert torch.allclose(stage.state_dict()[key], value, atol=1e-6)


def _amp_optimizer(stage):
    """``fleet.distributed_optimizer``'s wrapper over SGD with the amp strategy applied, built
    from its parts (one process, no fleet.init)."""
    from fleetx.fleet.optimizer import DistributedOptimizer
    from fleetx.strategy.algorithms.amp import AmpStrategy
    from fleetx.strategy.api import TrainingContext, WorldInfo
    from fleetx.strategy.distributed_strategy import DistributedStrategy
    strategy = DistributedStrategy()
    strategy.amp = True
    ctx = TrainingContext(WorldInfo(), strategy, torch.optim.SGD(stage.parameters(), lr=0.5),
                          stage)
    AmpStrategy(strategy).apply(ctx)
    return DistributedOptimizer(ctx), ctx


def test_train_batch_runs_the_backward_through_a_stage_optimizer():
    from fleetx.parallel.api import StageOptimizer
    torch.manual_seed(0)
    stage = PipelineLayer([LayerDesc(nn.Linear, 3, 5), nn.Tanh(), LayerDesc(nn.Linear, 5, 1)],
                          loss_fn=nn.MSELoss())
    reference = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
    reference.load_state_dict(stage.state_dict())
    opt, ctx = _amp_optimizer(stage)
    assert isinstance(opt, StageOptimizer)
    assert not isinstance(torch.optim.SGD(stage.parameters(), lr=1), StageOptimizer)
    model = PipelineParallel(stage, micro_batch_size=2, accumulate_steps=3,
                             forward_context=ctx.forward_context)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    model.train_batch([x, y], opt)  # plain autograd here: amp's guard refuses unscaled grads
    for xs, ys in zip(x.split(2), y.split(2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(reference(xs), ys)
        (loss / 3).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for key, value in reference.state_dict().items():
        assert torch.allclose(stage.state_dict()[key], value, atol=1e-6), key
    assert opt.get_loss_scaling() == 2.0 ** 15
    with pytest.raises(ValueError, match=r"train_batch: scaler= with an optimizer from "
                                         r"fleet.distributed_optimizer"):
        model.train_batch([x, y], opt, scaler=torch.amp.GradScaler("cpu"))


def test_backward_from_marks_the_gradients_scaled():
    """A stage before the last runs ``backward_from`` on gradients that carry the last
    stage's loss scale: amp's guard unscales them (once) instead of refusing them."""
    torch.manual_seed(0)
    stage = PipelineLayer([LayerDesc(nn.Linear, 3, 2)], loss_fn=nn.MSELoss())
    weight = stage.state_dict()["0.weight"].clone()
    opt, ctx = _amp_optimizer(stage)
    x = torch.randint(-4, 5, (4, 3)).float()  # small integers: exact in bfloat16 sums
    with ctx.forward_context():
        out = stage(x)
    opt.backward_from([out], [torch.full_like(out, 2.0 ** 15)])  # d(sum)/d(out), scaled
    assert opt.step() is True
    assert torch.allclose(stage.state_dict()["0.weight"], weight - 0.5 * x.sum(0).expand(2, 3),
                          atol=1e-6)


def test_gradient_merge_is_refused_with_a_pipeline():
    from fleetx.strategy.api import StrategyError, WorldInfo
    from fleetx.strategy.distributed_strategy import DistributedStrategy
    from fleetx.strategy.planner import plan_for
    s = DistributedStrategy()
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2}
    s.hybrid_configs = {"dp_degree": 1, "pp_degree": 2}
    with pytest.raises(StrategyError, match=r"gradient_merge: pp_degree=2: a pipeline's "
                                            r"train_batch already accumulates "
                                            r"pipeline_configs\['accumulate_steps'\] "
                                            r"micro-batches per optimizer step: set "
                                            r"strategy.gradient_merge = False"):
        plan_for(s, WorldInfo(world_size=2))
    s.hybrid_configs = {"dp_degree": 2, "pp_degree": 1}
    assert "gradient_merge" in plan_for(s, WorldInfo(world_size=2)).applied


def test_pipeline_error_lives_in_the_contract_module():
    import fleetx.fleet.meta_parallel as meta_parallel
    import fleetx.parallel.p2p as p2p
    from fleetx.parallel.api import ParallelError, PipelineError
    assert p2p.PipelineError is PipelineError is meta_parallel.PipelineError
    assert issubclass(PipelineError, ParallelError)


def test_errors_name_the_bad_argument():
    layers = [LayerDesc(nn.Linear, 2, 2)]
    with pytest.raises(TypeError, match="LayerDesc expects an nn.Module subclass, got 3"):
        LayerDesc(3)
    with pytest.raises(ValueError, match=r"PipelineLayer num_stages=2, but without "
                                         r"torch.distributed initialised \(call fleet.init\)"):
        PipelineLayer(layers, num_stages=2)
    with pytest.raises(ValueError, match="recompute_interval must be >= 0, got -1"):
        PipelineLayer(layers, recompute_interval=-1)
    with pytest.raises(ValueError, match=r"the last pipeline stage needs "
                                         r"PipelineLayer\(loss_fn=...\)"):
        PipelineParallel(PipelineLayer(layers))
    with pytest.raises(TypeError, match="PipelineParallel expects a PipelineLayer, got Linear"):
        PipelineParallel(nn.Linear(2, 2))
    model = PipelineParallel(PipelineLayer(layers, loss_fn=nn.MSELoss()), micro_batch_size=2,
                             accumulate_steps=2)
    with pytest.raises(ValueError, match=r"a batch of 3 samples, but pipeline_configs "
                                         r"micro_batch_size=2 x accumulate_steps=2 = 4"):
        model.train_batch([torch.zeros(3, 2), torch.zeros(3, 2)], None)
    with pytest.raises(ValueError, match=r"data must be \[inputs, labels\]"):
        model.eval_batch(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="unknown schedule_mode 'GPipe'"):
        PipelineParallel(PipelineLayer(layers, loss_fn=nn.MSELoss()), schedule_mode="GPipe")


def test_transfers_travel_on_the_device_of_the_groups_backend(monkeypatch):
    """NCCL moves CUDA tensors only: headers, tied weights and a stage's zero loss go on the
    current GPU for an NCCL pipe group, on the CPU for gloo or without a group."""
    from fleetx.parallel import stage as stage_module
    from fleetx.parallel.p2p import _decode, _encode
    assert stage_module.transfer_device(None) == torch.device("cpu")
    backends = {"nccl-group": "nccl", "gloo-group": "gloo"}
    monkeypatch.setattr(stage_module.dist, "get_backend", backends.__getitem__)
    monkeypatch.setattr(stage_module.torch.cuda, "current_device", lambda: 3)
    assert stage_module.transfer_device("nccl-group") == torch.device("cuda", 3)
    assert stage_module.transfer_device("gloo-group") == torch.device("cpu")
    pipe = stage_module.PipeGroup("nccl-group", 0, [0, 1])
    assert pipe.device == torch.device("cuda", 3)
    head = _encode([torch.ones(2, 3, requires_grad=True)], torch.device("cpu"))
    assert _decode(head) == [(torch.float32, True, (2, 3))]

