"""The hybrid topology without processes: Paddle's rank numbering over data/pipe/sharding/model,
the degree errors (each degree named ``name=value``), the one-process hybrid group, the RNG
tracker, and the fleet surface (``get_hybrid_communicate_group``, ``fleet.meta_parallel``)."""
import itertools
import time

import pytest
import torch

from fleetx.fleet.api import FleetError
from fleetx.fleet.fleet import Fleet
from fleetx.parallel import (MODEL_PARALLEL_RNG, HybridCommunicateGroup, ParallelError,
                             ParallelMode, RNGStatesTracker, model_parallel_random_seed)
from fleetx.role_maker import Role, UserDefinedRoleMaker
from fleetx.strategy.api import StrategyError
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.topology import AXES, Topology, resolve

SHAPES = [(1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 2), (2, 2, 1, 2), (3, 2, 1, 2), (2, 1, 3, 1),
          (1, 3, 1, 2), (2, 2, 2, 2)]


def _topology(dp, pp, sharding, mp):
    return Topology(dp_degree=dp, sharding_degree=sharding, mp_degree=mp, pp_degree=pp)


# -- layout -----------------------------------------------------------------------------------

def test_paddle_numbering_for_dp2_mp2_and_pp2_mp2():
    # Paddle 2.2's CommunicateTopology(["data", "pipe", "sharding", "model"], dims).get_comm_list
    t = _topology(2, 1, 1, 2)
    assert t.groups("model") == [[0, 1], [2, 3]]
    assert t.groups("data") == [[0, 2], [1, 3]]
    assert t.groups("pipe") == [[0], [1], [2], [3]]
    t = _topology(1, 2, 1, 2)
    assert t.groups("model") == [[0, 1], [2, 3]]
    assert t.groups("pipe") == [[0, 2], [1, 3]]
    assert t.groups("data") == [[0], [1], [2], [3]]
    assert [t.stage(r) for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_is_row_major_over_data_pipe_sharding_model(shape):
    t = _topology(*shape)
    ranks = [((d * shape[1] + p) * shape[2] + s) * shape[3] + m
             for d, p, s, m in itertools.product(*(range(n) for n in shape))]
    assert ranks == list(range(t.world_size))
    for rank, coord in enumerate(itertools.product(*(range(n) for n in shape))):
        assert tuple(t.coordinate(rank)) == coord
        assert t.rank_of(*coord) == rank
    assert (t.dp_rank(t.world_size - 1), t.stage(t.world_size - 1),
            t.sharding_rank(t.world_size - 1), t.mp_rank(t.world_size - 1)) == \
        tuple(n - 1 for n in shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_axis_groups_partition_the_world_and_vary_only_that_axis(shape):
    t = _topology(*shape)
    for i, axis in enumerate(AXES):
        groups = t.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(t.world_size))
        assert all(len(g) == shape[i] for g in groups)
        for g in groups:
            coords = [t.coordinate(r) for r in g]
            assert [c[i] for c in coords] == list(range(shape[i]))  # in axis order
            assert len({c[:i] + c[i + 1:] for c in coords}) == 1
            assert all(t.group_of(axis, r) == g for r in g)


def test_axis_and_coordinate_errors_name_the_bad_value():
    t = _topology(2, 1, 1, 2)
    with pytest.raises(ValueError, match="unknown axis 'tensor': choose one of data, pipe, "
                                         "sharding, model"):
        t.groups("tensor")
    with pytest.raises(ValueError, match="model=2 is outside the model axis of degree 2"):
        t.rank_of(model=2)


# -- the degrees ------------------------------------------------------------------------------

def _hybrid(**configs):
    s = DistributedStrategy()
    for name, value in configs.items():
        setattr(s, name, value)
    return s


@pytest.mark.parametrize("configs, world, expected", [
    ({"hybrid_configs": {"mp_degree": 2}}, 4, (2, 1, 1, 2)),
    ({"hybrid_configs": {"pp_degree": 2, "mp_degree": 2}}, 4, (1, 2, 1, 2)),
    ({"hybrid_configs": {"dp_degree": 2, "pp_degree": 2}}, 4, (2, 2, 1, 1)),
    ({"tensor_parallel_configs": {"tensor_parallel_degree": 2}}, 4, (2, 1, 1, 2)),
    ({"hybrid_configs": {"mp_degree": 2},
      "tensor_parallel_configs": {"tensor_parallel_degree": 2}}, 2, (1, 1, 1, 2)),
])
def test_degrees_alone_turn_tensor_and_pipeline_parallelism_on(configs, world, expected):
    s = _hybrid(**configs)
    assert not s.tensor_parallel and not s.pipeline  # no switch needed
    assert tuple(resolve(s, world).shape) == expected


@pytest.mark.parametrize("configs, world, message", [
    ({"hybrid_configs": {"mp_degree": 3}}, 2,
     "pp_degree=1 x mp_degree=3 is 3 processes per data-parallel rank, which does not divide "
     "the world size 2: use degrees whose product divides 2 (dp_degree=-1 then infers the "
     "rest)"),
    ({"hybrid_configs": {"dp_degree": 2, "mp_degree": 2}}, 2,
     "dp_degree=2 x pp_degree=1 x sharding_degree=1 x mp_degree=2 is 4 processes, but the world "
     "size is 2: make the product 2, or set dp_degree=-1 to infer it"),
    ({"hybrid_configs": {"pp_degree": 3, "mp_degree": 2}}, 4,
     "pp_degree=3 x mp_degree=2 is 6 processes per data-parallel rank, which does not divide "
     "the world size 4"),
    ({"tensor_parallel_configs": {"tensor_parallel_degree": 3}}, 4,
     "mp_degree=3 is 3 processes per data-parallel rank, which does not divide the world size "
     "4 (tensor_parallel_configs['tensor_parallel_degree'] fills mp_degree)"),
])
def test_degrees_that_cannot_fill_the_world_are_named(configs, world, message):
    with pytest.raises(StrategyError) as err:
        resolve(_hybrid(**configs), world)
    assert message in str(err.value)


def _fleet_init(world, rank=0, **configs):
    f = Fleet()
    rm = UserDefinedRoleMaker(is_collective=True, current_id=rank, role=Role.WORKER,
                              worker_num=world,
                              worker_endpoints=[f"127.0.0.1:{6170 + r}" for r in range(world)])
    f.init(role_maker=rm, is_collective=True, strategy=_hybrid(**configs))
    return f


def test_fleet_init_refuses_impossible_degrees_at_once():
    start = time.monotonic()
    with pytest.raises(StrategyError, match=r"mp_degree=3 .*world size 2"):
        _fleet_init(2, hybrid_configs={"mp_degree": 3})
    with pytest.raises(StrategyError, match=r"hybrid_configs\['mp_degree'\]=2 and "
                                            r"tensor_parallel_configs\['tensor_parallel_degree'\]"
                                            r"=4 disagree"):
        _fleet_init(2, hybrid_configs={"mp_degree": 2},
                    tensor_parallel_configs={"tensor_parallel_degree": 4})
    assert time.monotonic() - start < 30  # no rendezvous was waited for


# -- the group on one process -----------------------------------------------------------------

def test_one_process_group_answers_without_torch_distributed():
    hcg = HybridCommunicateGroup(_topology(1, 1, 1, 1))
    assert (hcg.get_global_rank(), hcg.get_data_parallel_rank(), hcg.get_model_parallel_rank(),
            hcg.get_stage_id(), hcg.get_sharding_parallel_rank()) == (0, 0, 0, 0, 0)
    assert (hcg.get_data_parallel_world_size(), hcg.get_model_parallel_world_size(),
            hcg.get_pipe_parallel_world_size(), hcg.get_sharding_parallel_world_size()) == \
        (1, 1, 1, 1)
    assert hcg.get_model_parallel_group() is None and hcg.get_data_parallel_group() is None
    assert hcg.get_parallel_mode() is ParallelMode.DATA_PARALLEL
    # Paddle's attribute spelling and the query spelling both work
    assert hcg.is_first_stage and hcg.is_last_stage()
    assert (hcg.get_p2p_prev_rank(), hcg.get_p2p_next_rank()) == (0, 0)
    with pytest.raises(ValueError, match=r"stage_id=1 is not a stage: choose 0 to 0"):
        hcg.get_rank_from_stage(1)
    with pytest.raises(ValueError, match="unknown axis 'x'"):
        hcg.group_ranks("x")


def test_a_topology_larger_than_the_world_is_named():
    with pytest.raises(ParallelError) as err:
        HybridCommunicateGroup(_topology(1, 1, 1, 2))
    assert str(err.value) == ("dp_degree=1 x pp_degree=1 x sharding_degree=1 x mp_degree=2 is 2 "
                              "processes, but the world has 1: make the product of the degrees 1")


def test_fleet_get_hybrid_communicate_group():
    f = Fleet()
    with pytest.raises(FleetError, match=r"call fleet.init\(\) before "
                                         r"fleet.get_hybrid_communicate_group\(\)"):
        f.get_hybrid_communicate_group()
    f = _fleet_init(1)
    assert f.get_hybrid_communicate_group().topology() == _topology(1, 1, 1, 1)
    # not launched: the two processes never joined, so there are no groups to return
    with pytest.raises(FleetError, match="no hybrid communicate group: this process joined no "
                                         "process group"):
        _fleet_init(2, hybrid_configs={"mp_degree": 2}).get_hybrid_communicate_group()


def test_meta_parallel_is_reachable_as_in_paddle():
    from fleetx import fleet
    from fleetx.fleet import meta_parallel
    from fleetx.parallel import get_rng_state_tracker
    assert fleet.meta_parallel is meta_parallel
    assert meta_parallel.get_rng_state_tracker is get_rng_state_tracker
    assert fleet.HybridCommunicateGroup is HybridCommunicateGroup
    assert fleet.get_hybrid_communicate_group.__name__ == "get_hybrid_communicate_group"


# -- the RNG tracker --------------------------------------------------------------------------

def test_rng_state_draws_from_the_stream_and_leaves_the_global_generator_alone():
    torch.manual_seed(3)
    expected_global = torch.rand(5)
    torch.manual_seed(11)
    expected_stream = torch.rand(10)
    tracker = RNGStatesTracker()
    tracker.add("s", 11)
    torch.manual_seed(3)
    with tracker.rng_state("s"):
        first = torch.rand(5)
    after = torch.rand(5)
    with tracker.rng_state("s"):
        second = torch.rand(5)
    assert torch.equal(after, expected_global)  # as if the blocks had not drawn
    assert torch.equal(torch.cat([first, second]), expected_stream)  # the stream advances


def test_tracker_states_round_trip_and_errors_name_the_stream():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    saved = tracker.get_states_tracker()
    with tracker.rng_state("a"):
        x = torch.rand(3)
    tracker.set_states_tracker(saved)
    with tracker.rng_state("a"):
        assert torch.equal(torch.rand(3), x)
    with pytest.raises(ValueError, match="rng stream 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used by another rng stream"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match=r"unknown rng stream 'model_parallel_rng' \(known: a\)"):
        with tracker.rng_state():
            pass


def test_model_parallel_seeds_agree_globally_and_differ_per_rank():
    seeds = [model_parallel_random_seed(7, rank) for rank in range(4)]
    assert {g for g, _ in seeds} == {7}
    assert len({local for _, local in seeds} | {7}) == 5
    from fleetx.parallel import get_rng_state_tracker
    assert MODEL_PARALLEL_RNG in get_rng_state_tracker().get_states_tracker()
