"""DistributedStrategy: defaults, validation messages, config merging, PS modes, aliases, copies."""
import copy
import pickle
import warnings

import pytest

from fleetx.strategy.algorithms.amp import AmpConfig
from fleetx.strategy.algorithms.pipeline import PipelineConfig
from fleetx.strategy.build import BuildStrategy, ExecutionStrategy
from fleetx.strategy.distributed_strategy import DistributedStrategy

# Written out from the Paddle 2.2 reference (fleet_api.md §2.2-2.4), not from the code.
DEFAULTS = {
    "mode": "COLLECTIVE", "amp": False, "recompute": False, "localsgd": False, "dgc": False,
    "gradient_merge": False, "lars": False, "lamb": False, "pipeline": False, "elastic": False,
    "auto": False, "a_sync": True, "sync_nccl_allreduce": True, "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False, "hierarchical_allreduce_inter_nranks": 1,
    "sync_batch_norm": False, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32,
    "fuse_grad_size_in_TFLOPS": 50.0, "cudnn_exhaustive_search": False,
    "conv_workspace_size_limit": 512, "cudnn_batchnorm_spatial_persistent": False,
    "adaptive_localsgd": False, "fp16_allreduce": False, "sharding": False,
    "last_comm_group_size_MB": 1.0, "find_unused_parameters": False, "tensor_parallel": False,
    "without_graph_optimization": False, "fuse_grad_size_in_num": 8,
    "calc_comm_same_stream": False, "asp": False, "fuse_grad_merge": False, "semi_auto": False,
    "anomaly_guard": False,
    "recompute_configs": {"checkpoints": [], "enable_offload": False, "checkpoint_shape": []},
    "amp_configs": {
        "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0, "decr_ratio": 0.8, "use_dynamic_loss_scaling": True,
        "custom_white_list": [], "custom_black_list": [], "custom_black_varnames": [],
        "use_pure_fp16": False, "use_fp16_guard": True},
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": []},
    "pipeline_configs": {"micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
                         "p2p_cache_shape": True},
    "a_sync_configs": {
        "k_steps": -1, "max_merge_var_num": 1, "send_queue_size": 16,
        "independent_recv_thread": False, "min_send_grad_num_before_recv": 1,
        "thread_pool_size": 1, "send_wait_times": 1, "runtime_split_send_recv": False,
        "launch_barrier": True, "heter_worker_device_guard": "cpu", "lr_decay_steps": 10,
        "use_ps_gpu": 0},
    "lars_configs": {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
                     "exclude_from_weight_decay": []},
    # always_adapt is fleetx's key (the lamb kernel's attribute, which Fleet 2.2 cannot set).
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": [],
                     "always_adapt": False},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "sharding_configs": {
        "sharding_segment_strategy": "segment_broadcast_MB", "segment_broadcast_MB": 32.0,
        "segment_anchors": [], "sharding_degree": 8, "mp_degree": 1, "dp_degree": 1,
        "hybrid_dp": False, "gradient_merge_acc_step": 1, "optimize_offload": False,
        "pp_allreduce_in_optimize": False, "pp_degree": 1, "optimize_cast": False,
        "_dp_as_optimizer_sharding": False, "stage": 1,  # stage: a later Paddle field
        "units": []},  # units: a fleetx key (docs/differences.md)
    "hybrid_configs": {"dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1},
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "trainer_desc_configs": {"dump_fields_path": "", "dump_fields": [], "dump_param": [],
                             "stat_var_names": []},
    "build_strategy": {
        "enable_sequential_execution": False, "fuse_elewise_add_act_ops": False,
        "fuse_bn_act_ops": False, "fuse_relu_depthwise_conv": False, "fuse_broadcast_ops": False,
        "fuse_all_optimizer_ops": False, "enable_inplace": False,
        "enable_backward_optimizer_op_deps": True, "cache_runtime_context": False,
        "fuse_bn_add_act_ops": True, "enable_auto_fusion": False, "enable_addto": False,
        "fix_op_run_order": False, "allow_cuda_graph_capture": False},
    "execution_strategy": {"num_threads": 1, "num_iteration_per_drop_scope": 10,
                           "num_iteration_per_run": 1, "use_thread_barrier": False},
    "gradient_scale_configs": {"scale_strategy": "avg"},
    # fleetx's own (docs/differences.md): declared by its strategy module, after Paddle's
    "anomaly_guard_configs": {"spike_factor": 10.0, "window": 50, "min_history": 5,
                              "check_gradients": True, "max_consecutive": 3,
                              "rollback": "memory", "snapshot_every": 50},
}


# -- defaults --------------------------------------------------------------------------------------
def test_every_default_and_proto_order():
    d = DistributedStrategy().to_dict()
    assert d == DEFAULTS
    assert list(d) == list(DEFAULTS)  # field-number order: scalars 1-35, 101-114, 201-203
    for name, configs in DEFAULTS.items():
        if isinstance(configs, dict):
            assert list(d[name]) == list(configs), name


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_each_attribute_reads_its_default(name):
    value = getattr(DistributedStrategy(), name)
    if name in ("build_strategy", "execution_strategy"):
        value = value.to_dict()
    assert value == DEFAULTS[name]
    assert type(value) is type(DEFAULTS[name])


def test_float_values_stay_python_floats():
    s = DistributedStrategy()
    s.amp_configs = {"decr_ratio": 0.8, "init_loss_scaling": 1024}
    assert s.amp_configs["decr_ratio"] == 0.8  # Paddle reads back 0.800000011920929
    assert type(s.amp_configs["init_loss_scaling"]) is float


# -- exact error messages --------------------------------------------------------------------------
def test_unknown_attribute():
    s = DistributedStrategy()
    with pytest.raises(TypeError) as e:
        s.ampp = True
    msg = str(e.value)
    assert msg.startswith("unknown DistributedStrategy attribute 'ampp' (did you mean 'amp'?); "
                          "known: a_sync, a_sync_configs, adaptive_localsgd, ")
    assert msg.endswith(", use_hierarchical_allreduce, without_graph_optimization")
    with pytest.raises(AttributeError, match="unknown DistributedStrategy attribute 'ampp'"):
        s.ampp
    assert not hasattr(s, "unknown_key")


def test_unknown_config_key():
    s = DistributedStrategy()
    with pytest.raises(ValueError) as e:
        s.amp_configs = {"init_loss_scale": 1.0}
    assert str(e.value) == (
        "unknown amp_configs key 'init_loss_scale' (did you mean 'init_loss_scaling'?); known: "
        "custom_black_list, custom_black_varnames, custom_white_list, decr_every_n_nan_or_inf, "
        "decr_ratio, incr_every_n_steps, incr_ratio, init_loss_scaling, "
        "use_dynamic_loss_scaling, use_fp16_guard, use_pure_fp16")


@pytest.mark.parametrize("assign, exc, message", [
    (("nccl_comm_num", True), TypeError, "nccl_comm_num must be an int, got bool True"),
    (("nccl_comm_num", 1.0), TypeError, "nccl_comm_num must be an int, got float 1.0"),
    (("amp", 1), TypeError, "amp must be a bool, got int 1"),
    (("amp", "true"), TypeError, "amp must be a bool, got str 'true'"),
    (("fuse_grad_size_in_TFLOPS", False), TypeError,
     "fuse_grad_size_in_TFLOPS must be a float, got bool False"),
    (("amp_configs", {"incr_ratio": "2"}), TypeError,
     "amp_configs['incr_ratio'] must be a float, got str '2'"),
    (("amp_configs", {"incr_every_n_steps": True}), TypeError,
     "amp_configs['incr_every_n_steps'] must be an int, got bool True"),
    (("amp_configs", {"custom_white_list": "conv2d"}), TypeError,
     "amp_configs['custom_white_list'] must be a list of str, got str 'conv2d'"),
    (("amp_configs", {"custom_white_list": ["conv2d", 3]}), TypeError,
     "amp_configs['custom_white_list'][1] must be a str, got int 3"),
    (("amp_configs", [("decr_ratio", 0.5)]), TypeError,
     "amp_configs must be a dict (or AmpConfig), got list [('decr_ratio', 0.5)]"),
    (("build_strategy", 3), TypeError, "build_strategy must be a BuildStrategy or a dict, got int 3"),
    (("nccl_comm_num", 0), ValueError, "nccl_comm_num must be >= 1, got 0"),
    (("fuse_grad_size_in_MB", 0), ValueError, "fuse_grad_size_in_MB must be > 0, got 0"),
    (("last_comm_group_size_MB", -1), ValueError,
     "last_comm_group_size_MB must be > 0, got -1.0"),
    (("mode", "HYBRID"), ValueError,
     "mode must be one of 'COLLECTIVE', 'PS', 'PIPELINE', 'HETER', got 'HYBRID'"),
    (("amp_configs", {"decr_ratio": 1.5}), ValueError,
     "amp_configs['decr_ratio'] must be in (0, 1), got 1.5"),
    (("amp_configs", {"incr_ratio": 1}), ValueError,
     "amp_configs['incr_ratio'] must be > 1, got 1.0"),
    (("amp_configs", {"init_loss_scaling": 0}), ValueError,
     "amp_configs['init_loss_scaling'] must be > 0, got 0.0"),
    (("amp_configs", {"init_loss_scaling": float("nan")}), ValueError,
     "amp_configs['init_loss_scaling'] must be > 0, got nan"),
    (("gradient_merge_configs", {"k_steps": 0}), ValueError,
     "gradient_merge_configs['k_steps'] must be >= 1, got 0"),
    (("localsgd_configs", {"k_steps": -3}), ValueError,
     "localsgd_configs['k_steps'] must be >= 1, got -3"),
    (("dgc_configs", {"sparsity": [0.9, 1.0]}), ValueError,
     "dgc_configs['sparsity'][1] must be in [0, 1), got 1.0"),
    (("lars_configs", {"lars_coeff": 0}), ValueError,
     "lars_configs['lars_coeff'] must be > 0, got 0.0"),
    (("a_sync_configs", {"k_steps": -2}), ValueError,
     "a_sync_configs['k_steps'] must be >= -1, got -2"),
    (("a_sync_configs", {"heter_worker_device_guard": "tpu"}), ValueError,
     "a_sync_configs['heter_worker_device_guard'] must be one of 'cpu', 'gpu', 'xpu', "
     "got 'tpu'"),
    (("pipeline_configs", {"schedule_mode": "GPipe"}), ValueError,
     "pipeline_configs['schedule_mode'] must be one of '1F1B', 'FThenB', 'F-then-B', got 'GPipe'"),
    (("sharding_configs", {"sharding_segment_strategy": "none"}), ValueError,
     "sharding_configs['sharding_segment_strategy'] must be one of 'segment_broadcast_MB', "
     "'segment_anchors', got 'none'"),
    (("gradient_scale_configs", {"scale_strategy": "mean"}), ValueError,
     "gradient_scale_configs['scale_strategy'] must be one of 'avg', 'sum', 'customized', "
     "got 'mean'"),
    (("hybrid_configs", {"dp_degree": 0}), ValueError,
     "hybrid_configs['dp_degree'] must be >= 1 or -1, got 0"),
    (("execution_strategy", {"num_iteration_per_run": 0}), ValueError,
     "execution_strategy.num_iteration_per_run must be >= 1, got 0"),
    (("build_strategy", {"enable_inplace": 1}), TypeError,
     "build_strategy.enable_inplace must be a bool, got int 1"),
    (("build_strategy", {"enable_inplac": True}), ValueError,
     "unknown build_strategy field 'enable_inplac' (did you mean 'enable_inplace'?); known: "
     "allow_cuda_graph_capture, cache_runtime_context, enable_addto, enable_auto_fusion, "
     "enable_backward_optimizer_op_deps, enable_inplace, enable_sequential_execution, "
     "fix_op_run_order, fuse_all_optimizer_ops, fuse_bn_act_ops, fuse_bn_add_act_ops, "
     "fuse_broadcast_ops, fuse_elewise_add_act_ops, fuse_relu_depthwise_conv"),
])
def test_rejected_assignments(assign, exc, message):
    s = DistributedStrategy()
    before = s.to_dict()
    with pytest.raises(exc) as e:
        setattr(s, *assign)
    assert str(e.value) == message
    assert s.to_dict() == before  # nothing written


def test_accepted_number_forms():
    s = DistributedStrategy()
    s.fuse_grad_size_in_TFLOPS = 20  # int for a float field
    s.a_sync_configs = {"k_steps": -1}
    s.hybrid_configs = {"dp_degree": -1}
    s.dgc_configs = {"sparsity": (0, 0.5, 0.999)}  # tuple accepted, stored as a list
    assert s.fuse_grad_size_in_TFLOPS == 20.0 and type(s.fuse_grad_size_in_TFLOPS) is float
    assert s.dgc_configs["sparsity"] == [0.0, 0.5, 0.999]


# -- config dict semantics -------------------------------------------------------------------------
def test_config_assignment_merges():
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024}
    s.amp_configs = {"decr_ratio": 0.5}
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert s.amp_configs["decr_ratio"] == 0.5
    assert s.amp_configs["incr_ratio"] == 2.0


def test_config_assignment_is_all_or_nothing():
    s = DistributedStrategy()
    with pytest.raises(ValueError):
        s.amp_configs = {"init_loss_scaling": 1024, "decr_ratio": 2.0}
    with pytest.raises(ValueError):
        s.amp_configs = {"init_loss_scaling": 1024, "bogus": 1}
    assert s.amp_configs["init_loss_scaling"] == 32768.0
    assert not s.is_set("amp_configs")


def test_list_value_replaces_old_list():
    s = DistributedStrategy()
    s.recompute_configs = {"checkpoints": ["x"]}
    s.recompute_configs = {"checkpoints": ["x"]}  # Paddle would give ["x", "x"]
    assert s.recompute_configs["checkpoints"] == ["x"]
    s.recompute_configs = {"checkpoints": ["y", "z"]}
    assert s.recompute_configs["checkpoints"] == ["y", "z"]


def test_returned_dicts_are_copies():
    s = DistributedStrategy()
    configs = s.recompute_configs
    configs["checkpoints"].append("x")
    configs["enable_offload"] = True
    assert s.recompute_configs == {"checkpoints": [], "enable_offload": False,
                                   "checkpoint_shape": []}
    given = ["a"]
    s.recompute_configs = {"checkpoints": given}
    given.append("b")
    assert s.recompute_configs["checkpoints"] == ["a"]
    assert s.amp_configs is not s.amp_configs


def test_typed_config_instance_can_be_assigned():
    s = DistributedStrategy()
    s.amp_configs = AmpConfig(decr_ratio=0.5)
    assert s.amp_configs == AmpConfig(decr_ratio=0.5).to_dict()
    assert s.is_set("amp_configs.incr_ratio")  # every field of the instance is assigned


def test_typed_config_returns_a_copy():
    s = DistributedStrategy()
    s.pipeline_configs = {"accumulate_steps": 4}
    cfg = s.typed_config("pipeline")
    assert cfg == PipelineConfig(accumulate_steps=4)
    cfg.accumulate_steps = 8
    assert s.pipeline_configs["accumulate_steps"] == 4
    assert type(s.typed_config("hybrid")).__name__ == "HybridConfig"
    assert s.typed_config("pipeline_configs") == cfg.merged({"accumulate_steps": 4})
    with pytest.raises(ValueError) as e:
        s.typed_config("ampp")
    assert str(e.value) == (
        "unknown strategy config 'ampp' (did you mean 'amp'?); known: a_sync, "
        "adaptive_localsgd, amp, anomaly_guard, dgc, gradient_merge, gradient_scale, hybrid, "
        "lamb, lars, "
        "localsgd, pipeline, recompute, sharding, tensor_parallel, trainer_desc")


# -- build / execution strategy --------------------------------------------------------------------
def test_build_strategy_getter_returns_a_new_bag():
    s = DistributedStrategy()
    bs = s.build_strategy
    bs.fuse_all_optimizer_ops = True
    assert s.build_strategy.fuse_all_optimizer_ops is False  # edits need assigning back
    s.build_strategy = bs
    assert s.build_strategy.fuse_all_optimizer_ops is True
    assert s.build_strategy is not s.build_strategy
    assert s.is_set("build_strategy.enable_inplace")  # a bag assignment copies every field


def test_execution_strategy_from_dict_and_from_any_object():
    s = DistributedStrategy()
    s.execution_strategy = {"num_threads": 4}
    assert s.execution_strategy == ExecutionStrategy(num_threads=4)
    assert not s.is_set("execution_strategy.use_thread_barrier")

    class PaddleLike:  # e.g. paddle.static.ExecutionStrategy: known attributes are copied
        num_threads = 10
        num_iteration_per_drop_scope = 10
        num_iteration_per_run = 10
        something_else = 1

    s.execution_strategy = PaddleLike()
    assert s.execution_strategy.to_dict() == {
        "num_threads": 10, "num_iteration_per_drop_scope": 10, "num_iteration_per_run": 10,
        "use_thread_barrier": False}
    with pytest.raises(TypeError, match="execution_strategy must be an? ExecutionStrategy"):
        s.execution_strategy = BuildStrategy()


def test_bag_assignment_validates():
    bs = BuildStrategy()
    with pytest.raises(TypeError, match=r"build_strategy.fuse_bn_act_ops must be a bool"):
        bs.fuse_bn_act_ops = "yes"


# -- PS modes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, mode", [
    ([], "async"),  # a_sync never set: k_steps -1 counts as async
    ([("a_sync", False)], "sync"),
    ([("a_sync", True)], "async"),
    ([("a_sync", True), ("a_sync_configs", {"k_steps": 100})], "geo"),
    ([("a_sync_configs", {"k_steps": 100})], "geo"),  # a_sync defaults to True
    ([("a_sync_configs", {"k_steps": 100}), ("a_sync", True)], "async"),  # order matters
    ([("a_sync", False), ("a_sync_configs", {"k_steps": 0})], "sync"),
])
def test_ps_mode_table(steps, mode):
    s = DistributedStrategy()
    for name, value in steps:
        setattr(s, name, value)
    assert s.ps_mode() == mode


def test_a_sync_setter_resets_k_steps():
    s = DistributedStrategy()
    assert s.a_sync_configs["k_steps"] == -1
    s.a_sync_configs = {"k_steps": 7}
    s.a_sync = True
    assert s.a_sync_configs["k_steps"] == 0
    assert s.is_set("a_sync_configs.k_steps")
    with pytest.raises(TypeError, match="a_sync must be a bool, got int 1"):
        s.a_sync = 1


def test_ps_mode_invalid_combination():
    s = DistributedStrategy()
    s.a_sync = False
    s.a_sync_configs = {"k_steps": 5}
    with pytest.raises(ValueError) as e:
        s.ps_mode()
    assert str(e.value) == (
        "a_sync=False (sync) cannot be combined with a_sync_configs['k_steps']=5 (GEO); "
        "set a_sync=True for GEO, or k_steps=0 for sync")


# -- aliases ---------------------------------------------------------------------------------------
def test_paddle_underscore_spellings_are_silent():
    s = DistributedStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s._fuse_grad_size_in_TFLOPS = 20.0
        s._calc_comm_same_stream = True
    assert s.fuse_grad_size_in_TFLOPS == 20.0 and s._fuse_grad_size_in_TFLOPS == 20.0
    assert s.calc_comm_same_stream is True


def test_fp16_compress_alias():
    s = DistributedStrategy()
    with pytest.warns(DeprecationWarning, match="strategy.fp16_compress is an old name; "
                                                "use strategy.fp16_allreduce"):
        s.fp16_compress = True
    assert s.fp16_allreduce is True
    assert "fp16_compress" not in s.to_dict()


def test_config_key_aliases():
    s = DistributedStrategy()
    with pytest.warns(DeprecationWarning, match=r"pipeline_configs\['micro_batch'\] is an old "
                                                r"name; use pipeline_configs\['accumulate_steps'\]"):
        s.pipeline_configs = {"micro_batch": 12}
    assert s.pipeline_configs["accumulate_steps"] == 12
    assert s.pipeline_configs["micro_batch_size"] == 1
    with pytest.warns(DeprecationWarning):
        s.sharding_configs = {"fuse_broadcast_MB": 16, "sharding_group_size": 2, "hybrid_dp": True}
    assert s.sharding_configs["segment_broadcast_MB"] == 16.0
    assert s.sharding_configs["sharding_degree"] == 2
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError) as e:
        s.pipeline_configs = {"micro_batch": 2, "accumulate_steps": 3}
    assert str(e.value) == ("pipeline_configs['micro_batch'] and "
                            "pipeline_configs['accumulate_steps'] name the same setting; "
                            "give only one")


# -- copies and equality ---------------------------------------------------------------------------
def test_deepcopy_is_independent():
    s = DistributedStrategy()
    s.recompute = True
    s.recompute_configs = {"checkpoints": ["a"]}
    c = copy.deepcopy(s)
    assert c == s and c is not s
    c.recompute_configs = {"checkpoints": ["b"]}
    c.nccl_comm_num = 3
    c.build_strategy = {"enable_inplace": True}
    assert s.recompute_configs["checkpoints"] == ["a"]
    assert s.nccl_comm_num == 1
    assert s.build_strategy.enable_inplace is False
    assert not s.is_set("nccl_comm_num") and c.is_set("nccl_comm_num")
    assert c != s


def test_pickle_round_trip_keeps_values_and_set_fields():
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = {"custom_white_list": ["conv2d"]}
    t = pickle.loads(pickle.dumps(s))
    assert t == s
    assert t.is_set("amp") and t.is_set("amp_configs.custom_white_list")
    assert not t.is_set("amp_configs.decr_ratio")


def test_equality_is_by_value_not_by_set_fields():
    a, b = DistributedStrategy(), DistributedStrategy()
    b.amp = False  # explicitly set to its default
    assert a == b
    b.amp = True
    assert a != b
    assert a != object()


def test_is_set_tracks_assignments():
    s = DistributedStrategy()
    assert not s.is_set("amp")
    s.amp = False
    assert s.is_set("amp")
    assert not s.is_set("amp_configs")
    s.amp_configs = {"decr_ratio": 0.8}
    assert s.is_set("amp_configs") and s.is_set("amp_configs.decr_ratio")
    assert not s.is_set("amp_configs.incr_ratio")


def test_dir_lists_fields():
    names = dir(DistributedStrategy())
    assert "amp_configs" in names and "nccl_comm_num" in names and "ps_mode" in names
