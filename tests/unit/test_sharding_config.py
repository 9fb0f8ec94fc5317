"""``sharding_configs``: the ``stage`` key, ``offload`` as another name of ``optimize_offload``,
and the keys declared without effect in fleetx's sharding (named in the plan, with why)."""
import warnings

import pytest

from fleetx.strategy.algorithms.sharding import ShardingConfig
from fleetx.strategy.api import PlanInput, WorldInfo
from fleetx.strategy.distributed_strategy import DistributedStrategy, markdown_reference
from fleetx.strategy.planner import make_plan


def _sharded(**configs):
    s = DistributedStrategy()
    s.sharding = True
    s.sharding_configs = configs
    return s


# -- stage ------------------------------------------------------------------------------------

def test_stage_defaults_to_one():
    assert ShardingConfig().stage == 1
    assert DistributedStrategy().sharding_configs["stage"] == 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_is_accepted(stage):
    assert _sharded(stage=stage).typed_config("sharding").stage == stage


@pytest.mark.parametrize("value, error, message", [
    (0, ValueError, "sharding_configs['stage'] must be one of 1, 2, 3, got 0"),
    (4, ValueError, "sharding_configs['stage'] must be one of 1, 2, 3, got 4"),
    (True, TypeError, "sharding_configs['stage'] must be an int, got bool True"),
    ("2", TypeError, "sharding_configs['stage'] must be an int, got str '2'"),
    (2.0, TypeError, "sharding_configs['stage'] must be an int, got float 2.0"),
])
def test_a_bad_stage_is_refused_naming_the_choices(value, error, message):
    s = DistributedStrategy()
    with pytest.raises(error) as err:
        s.sharding_configs = {"stage": value}
    assert str(err.value) == message
    assert s.sharding_configs["stage"] == 1  # nothing written


def test_stage_round_trips_through_files(tmp_path):
    s = _sharded(stage=3)
    for name, save, load in [("s.prototxt", "save_to_prototxt", "load_from_prototxt"),
                             ("s.json", "save_to_json", "load_from_json")]:
        getattr(s, save)(tmp_path / name)
        loaded = DistributedStrategy()
        getattr(loaded, load)(tmp_path / name)
        assert loaded.sharding_configs["stage"] == 3 and loaded.sharding


# -- offload ----------------------------------------------------------------------------------

def test_offload_is_another_name_of_optimize_offload_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = _sharded(offload=True)
    assert s.sharding_configs["optimize_offload"] is True
    assert "offload" not in s.sharding_configs  # dicts and files use the field's name
    assert s.is_set("sharding_configs.optimize_offload")


def test_offload_and_optimize_offload_together_are_refused():
    s = DistributedStrategy()
    with pytest.raises(ValueError) as err:
        s.sharding_configs = {"optimize_offload": True, "offload": False}
    assert str(err.value) == ("sharding_configs['optimize_offload'] and "
                              "sharding_configs['offload'] name the same setting; give only one")


def test_offload_is_read_from_files_and_written_as_optimize_offload(tmp_path):
    path = tmp_path / "paddle.prototxt"
    path.write_text("sharding: true\nsharding_configs {\n  offload: true\n  stage: 2\n}\n")
    s = DistributedStrategy()
    s.load_from_prototxt(path)
    assert (s.sharding_configs["optimize_offload"], s.sharding_configs["stage"]) == (True, 2)
    s.save_to_prototxt(tmp_path / "out.prototxt")
    text = (tmp_path / "out.prototxt").read_text()
    assert "optimize_offload: true" in text and "offload: true" not in text.replace(
        "optimize_offload: true", "")


def test_an_unknown_key_suggests_the_synonym_too():
    with pytest.raises(ValueError) as err:
        DistributedStrategy().sharding_configs = {"ofload": True}
    text = str(err.value)
    assert text.startswith("unknown sharding_configs key 'ofload' (did you mean 'offload'?); "
                           "known: _dp_as_optimizer_sharding, ")
    assert ", offload, optimize_cast, optimize_offload, " in text


def test_the_reference_lists_the_synonym():
    row = "| `offload` | synonym | | | another name of `optimize_offload` |"
    assert row in markdown_reference()


# -- keys without effect ----------------------------------------------------------------------

_BUCKETS = "ZeroRedundancyOptimizer and FSDP2 choose their own communication buckets"


@pytest.mark.parametrize("configs, named", [
    ({"segment_broadcast_MB": 64.0}, f"sharding_configs.segment_broadcast_MB ({_BUCKETS})"),
    ({"sharding_segment_strategy": "segment_anchors", "segment_anchors": ["fc_0"]},
     f"sharding_configs.sharding_segment_strategy, sharding_configs.segment_anchors ({_BUCKETS})"),
    ({"gradient_merge_acc_step": 4},
     "sharding_configs.gradient_merge_acc_step (use gradient_merge_configs['k_steps'], which "
     "works with sharding)"),
    ({"offload": True},
     "sharding_configs.optimize_offload (offload is not implemented: on CPU the state is in "
     "host memory already)"),
    ({"optimize_cast": True}, "sharding_configs.optimize_cast (parameters stay float32 and amp "
                              "casts per operation, so there is no cast phase)"),
    ({"pp_allreduce_in_optimize": True}, "sharding_configs.pp_allreduce_in_optimize (sharding "
                                         "together with pipeline parallelism is not "
                                         "implemented)"),
    ({"_dp_as_optimizer_sharding": True}, "sharding_configs._dp_as_optimizer_sharding (with no "
                                          "sharding_degree set the sharding group already is the "
                                          "data-parallel group)"),
])
def test_the_plan_names_sharding_keys_without_effect_and_why(configs, named):
    plan = make_plan(PlanInput(_sharded(**configs), WorldInfo()))
    entry = next(e for e in plan.entries if e.name == "no_effect")
    assert entry.warn and named in entry.reason


@pytest.mark.parametrize("key", ["sharding_degree", "dp_degree", "hybrid_dp", "stage"])
def test_the_keys_sharding_acts_on_declare_no_reason_of_their_own(key):
    # They share the config's declaration (ShardingConfig.no_effect) until sharding acts.
    assert ShardingConfig.specs()[key].no_effect is None
