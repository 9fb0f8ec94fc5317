"""The process grid: which degrees a strategy asks for (``resolve``) and the rank layout of its
groups (``Topology``). Pure logic, no processes; every error message is checked whole."""
import warnings

import pytest
import torch

from fleetx.strategy.api import StrategyError
from fleetx.strategy.config import recording_reads
from fleetx.strategy.distributed_strategy import DistributedStrategy
from fleetx.strategy.topology import Topology, resolve


def _strategy(**fields):
    s = DistributedStrategy()
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def _sharded(**configs):
    return _strategy(sharding=True, **configs)


def _grid(topology):
    return topology.dp_degree, topology.sharding_degree


# -- what resolves ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_sharding_alone_shards_over_the_whole_world(world):
    # Paddle's sharding_degree default is 8; unset, it is not used: 2 processes work.
    t = resolve(_sharded(), world)
    assert t == Topology(dp_degree=1, sharding_degree=world)
    assert t.sharding_groups() == [list(range(world))]


def test_eight_processes_degree_four_with_hybrid_dp():
    s = _sharded(sharding_configs={"sharding_degree": 4, "hybrid_dp": True})
    t = resolve(s, 8)
    assert _grid(t) == (2, 4)
    assert t.sharding_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("configs", [
    {"sharding_configs": {"sharding_degree": 4}},
    {"hybrid_configs": {"sharding_degree": 4}},
    {"hybrid_configs": {"dp_degree": 2}},
    {"sharding_configs": {"dp_degree": 2, "hybrid_dp": True}},
    {"hybrid_configs": {"sharding_degree": 4, "dp_degree": -1}},
    {"hybrid_configs": {"sharding_degree": 4, "dp_degree": 2},
     "sharding_configs": {"sharding_degree": 4, "dp_degree": 2, "hybrid_dp": True}},
])
def test_each_place_of_a_degree_gives_the_same_grid(configs):
    # One degree given, the other inferred from the 8 processes (dp_degree -1 means infer).
    assert _grid(resolve(_sharded(**configs), 8)) == (2, 4)


def test_sharding_configs_fills_hybrid_configs_only_when_that_is_unset():
    s = _sharded(sharding_configs={"sharding_degree": 2})
    assert _grid(resolve(s, 4)) == (2, 2)
    s.hybrid_configs = {"sharding_degree": 2}  # set, and equal: fine
    assert _grid(resolve(s, 4)) == (2, 2)


def test_the_old_name_sharding_group_size_counts_as_set():
    s = _sharded()
    with pytest.warns(DeprecationWarning, match="sharding_group_size"):
        s.sharding_configs = {"sharding_group_size": 2}
    assert _grid(resolve(s, 4)) == (2, 2)


def test_a_strategy_from_a_dict_or_file_counts_its_keys_as_set(tmp_path):
    d = DistributedStrategy.from_dict({"sharding": True,
                                       "sharding_configs": {"sharding_degree": 2}})
    assert _grid(resolve(d, 4)) == (2, 2)
    path = tmp_path / "s.prototxt"
    d.save_to_prototxt(path)
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(path)
    assert _grid(resolve(loaded, 6)) == (3, 2)


def test_a_default_assigned_explicitly_is_set():
    # Assigning the default 8 is a choice (like protobuf's HasField): on 2 processes it fails.
    s = _sharded(sharding_configs={"sharding_degree": 8})
    with pytest.raises(StrategyError, match=r"sharding_configs\['sharding_degree'\]=8 is larger"):
        resolve(s, 2)


def test_sharding_off_every_rank_is_data_parallel_and_sharding_configs_is_ignored():
    s = _strategy(sharding_configs={"sharding_degree": 3, "mp_degree": 2, "hybrid_dp": True})
    assert resolve(s, 4) == Topology(dp_degree=4, sharding_degree=1)
    assert resolve(_strategy(hybrid_configs={"dp_degree": 4, "sharding_degree": 1}), 4) == \
        Topology(dp_degree=4, sharding_degree=1)


# -- what is refused --------------------------------------------------------------------------

@pytest.mark.parametrize("configs, world, message", [
    ({"sharding_configs": {"sharding_degree": 4}, "hybrid_configs": {"sharding_degree": 2}}, 8,
     "hybrid_configs['sharding_degree']=2 and sharding_configs['sharding_degree']=4 disagree: "
     "set the same value in both, or set only hybrid_configs['sharding_degree'] (hybrid_configs "
     "is the source of truth; the other only fills it when it is unset)"),
    ({"sharding_configs": {"sharding_degree": 2}, "hybrid_configs": {"sharding_degree": 1}}, 2,
     "hybrid_configs['sharding_degree']=1 and sharding_configs['sharding_degree']=2 disagree"),
    ({"sharding_configs": {"dp_degree": 2}, "hybrid_configs": {"dp_degree": 4}}, 8,
     "hybrid_configs['dp_degree']=4 and sharding_configs['dp_degree']=2 disagree"),
    ({"sharding_configs": {"sharding_degree": 4}}, 2,
     "sharding_configs['sharding_degree']=4 is larger than the world size 2: use a divisor of 2 "
     "(1, 2)"),
    ({"hybrid_configs": {"sharding_degree": 16}}, 8,
     "hybrid_configs['sharding_degree']=16 is larger than the world size 8: use a divisor of 8 "
     "(1, 2, 4, 8)"),
    ({"sharding_configs": {"sharding_degree": 3}}, 8,
     "sharding_configs['sharding_degree']=3 does not divide the world size 8: use a divisor of 8 "
     "(1, 2, 4, 8)"),
    ({"hybrid_configs": {"dp_degree": 3}}, 8,
     "hybrid_configs['dp_degree']=3 does not divide the world size 8: use a divisor of 8 "
     "(1, 2, 4, 8)"),
    ({"sharding_configs": {"sharding_degree": 4}, "hybrid_configs": {"dp_degree": 4}}, 8,
     "sharding_configs['sharding_degree']=4 x hybrid_configs['dp_degree']=4 is 16 processes, but "
     "the world has 8: make the product 8, or leave one of them unset to infer it"),
    ({"sharding_configs": {"hybrid_dp": True}}, 4,
     "sharding_configs['hybrid_dp']=True replicates sharding groups, but the data-parallel "
     "degree is 1 (one sharding group of all 4 processes): set a sharding_degree below 4 that "
     "divides it, or hybrid_dp=False"),
    ({"sharding_configs": {"hybrid_dp": False, "sharding_degree": 2}}, 8,
     "sharding_configs['hybrid_dp']=False, but the data-parallel degree is 4 (4 sharding groups "
     "of 2 processes): set hybrid_dp=True, or a sharding_degree of 8"),
])
def test_sharding_refusals_name_the_settings_their_numbers_and_the_fix(configs, world, message):
    with pytest.raises(StrategyError) as err:
        resolve(_sharded(**configs), world)
    assert message in str(err.value)


@pytest.mark.parametrize("configs, world, message", [
    ({"hybrid_configs": {"sharding_degree": 2}}, 4,
     "hybrid_configs['sharding_degree']=2 asks for sharding, but strategy.sharding is off: set "
     "strategy.sharding = True, or leave the degree unset"),
    ({"hybrid_configs": {"dp_degree": 3}}, 2,
     "hybrid_configs['dp_degree']=3, but without sharding every one of the 2 processes is a "
     "data-parallel rank: set it to 2, or -1 to infer it"),
])
def test_refusals_with_sharding_off(configs, world, message):
    with pytest.raises(StrategyError) as err:
        resolve(_strategy(**configs), world)
    assert str(err.value) == message


@pytest.mark.parametrize("sharding", [False, True])
@pytest.mark.parametrize("configs, message", [
    ({"tensor_parallel_configs": {"tensor_parallel_degree": 4}, "hybrid_configs": {"mp_degree": 2}},
     "hybrid_configs['mp_degree']=2 and tensor_parallel_configs['tensor_parallel_degree']=4 "
     "disagree: set the same value in both, or set only hybrid_configs['mp_degree']"),
    ({"tensor_parallel_configs": {"tensor_parallel_degree": 2}, "hybrid_configs": {"mp_degree": 1}},
     "hybrid_configs['mp_degree']=1 and tensor_parallel_configs['tensor_parallel_degree']=2 "
     "disagree"),
])
def test_tensor_degrees_in_two_places_must_agree(sharding, configs, message):
    with pytest.raises(StrategyError) as err:
        resolve(_strategy(sharding=sharding, **configs), 4)
    assert message in str(err.value)


@pytest.mark.parametrize("configs, message", [
    ({"tensor_parallel_configs": {"tensor_parallel_degree": 2}},
     "tensor_parallel_configs['tensor_parallel_degree']=2 with strategy.sharding on: sharding "
     "together with tensor or pipeline parallelism is not implemented in fleetx; turn sharding "
     "off, or set the tensor and pipeline degrees to 1"),
    ({"hybrid_configs": {"mp_degree": 2, "pp_degree": 2}},
     "hybrid_configs['mp_degree']=2 and hybrid_configs['pp_degree']=2 with strategy.sharding on"),
])
def test_sharding_with_tensor_or_pipeline_degrees_is_refused(configs, message):
    with pytest.raises(StrategyError) as err:
        resolve(_sharded(**configs), 4)
    assert message in str(err.value)


def test_tensor_parallel_degree_and_mp_degree_set_to_one_agree():
    s = _sharded(tensor_parallel_configs={"tensor_parallel_degree": 1},
                 hybrid_configs={"mp_degree": 1, "pp_degree": 1})
    assert _grid(resolve(s, 2)) == (1, 2)


@pytest.mark.parametrize("key", ["mp_degree", "pp_degree"])
def test_sharding_configs_model_degrees_count_only_with_sharding_on(key):
    s = _strategy(sharding_configs={key: 2})
    assert _grid(resolve(s, 4)) == (4, 1)
    s.sharding = True
    with pytest.raises(StrategyError, match=rf"sharding_configs\['{key}'\]=2 with strategy"):
        resolve(s, 4)
    s.hybrid_configs = {key: 4}
    with pytest.raises(StrategyError, match=rf"hybrid_configs\['{key}'\]=4 and "
                                            rf"sharding_configs\['{key}'\]=2 disagree"):
        resolve(s, 4)


@pytest.mark.parametrize("world", [0, -1, 2.0, True])
def test_a_bad_world_size_is_refused(world):
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1, got {world!r}"):
        resolve(_strategy(), world)


# -- what resolve reads -----------------------------------------------------------------------

def test_resolve_reads_the_sharding_and_model_degree_keys():
    with recording_reads() as reads:
        resolve(_sharded(), 2)
    assert {"sharding", "sharding_configs.sharding_degree", "sharding_configs.dp_degree",
            "sharding_configs.hybrid_dp", "hybrid_configs.sharding_degree",
            "hybrid_configs.dp_degree", "hybrid_configs.mp_degree", "hybrid_configs.pp_degree",
            "tensor_parallel_configs.tensor_parallel_degree"} <= reads


# -- the layout -------------------------------------------------------------------------------

@pytest.mark.parametrize("dp, shard", [(1, 1), (1, 4), (4, 1), (2, 4), (3, 2), (2, 3)])
def test_groups_match_the_device_mesh_layout(dp, shard):
    t = Topology(dp_degree=dp, sharding_degree=shard)
    # init_device_mesh numbers ranks row-major over mesh_shape: rows are the shard dimension's
    # groups, columns the replicate dimension's.
    mesh = torch.arange(t.world_size).reshape(t.mesh_shape)
    assert t.sharding_groups() == mesh.tolist()
    assert t.dp_groups() == mesh.t().tolist()
    for rank in range(t.world_size):
        assert t.sharding_groups()[t.dp_rank(rank)][t.sharding_rank(rank)] == rank
        assert t.dp_groups()[t.sharding_rank(rank)][t.dp_rank(rank)] == rank


def test_a_sharding_group_is_consecutive_ranks():
    t = resolve(_sharded(sharding_configs={"sharding_degree": 2}), 6)
    assert t.sharding_groups() == [[0, 1], [2, 3], [4, 5]]
    assert t.dp_groups() == [[0, 2, 4], [1, 3, 5]]
    assert (t.sharding_rank(5), t.dp_rank(5)) == (1, 2)


@pytest.mark.parametrize("fields, message", [
    ({"dp_degree": 0, "sharding_degree": 1}, "Topology.dp_degree must be an int >= 1, got 0"),
    ({"dp_degree": 1, "sharding_degree": True}, "Topology.sharding_degree must be an int >= 1, "
                                                "got True"),
    ({"dp_degree": 1, "sharding_degree": 1, "mp_degree": 2, "pp_degree": 0},
     "Topology.pp_degree must be an int >= 1, got 0"),
])
def test_a_bad_topology_is_refused(fields, message):
    with pytest.raises(ValueError) as err:
        Topology(**fields)
    assert str(err.value) == message


def test_a_rank_outside_the_world_is_refused():
    t = Topology(dp_degree=2, sharding_degree=2)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4 processes"):
        t.dp_rank(4)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        t.sharding_rank(-1)


def test_topology_is_frozen():
    t = Topology(dp_degree=1, sharding_degree=2)
    with pytest.raises(AttributeError):
        t.dp_degree = 2  # type: ignore[misc]
    assert t == Topology(1, 2) and hash(t) == hash(Topology(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(_sharded(), 2) == t
