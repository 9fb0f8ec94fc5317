"""The fields of :class:`~fleetx.strategy.distributed_strategy.DistributedStrategy`.

:class:`TopLevelConfig` holds its scalar fields (switches and communication flags) and
:data:`MESSAGES` its message fields (the ``*_configs`` dataclasses and the build / execution
strategies), both in Paddle's protobuf field-number order. :func:`resolve_name` turns any name a
user may write (a field, Paddle's attribute spelling, an old name) into the field it means. The
strategy object, the file readers and the generated overview and reference all read these
declarations, so a field added here appears everywhere at once.

A strategy outside Paddle's list is declared with :func:`declare` (at the end of this module):
a bool switch after Paddle's fields and, with its config class, the ``<switch>_configs``
message after Paddle's messages. :func:`top_level` is then the scalar fields' class (Paddle's
and the declared switches) and :func:`field_names` every field's name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from fleetx.strategy.algorithms.a_sync import AsyncConfig
from fleetx.strategy.algorithms.adaptive_localsgd import AdaptiveLocalSGDConfig
from fleetx.strategy.algorithms.amp import AmpConfig
from fleetx.strategy.algorithms.anomaly_guard import AnomalyGuardConfig
from fleetx.strategy.algorithms.dgc import DGCConfig
from fleetx.strategy.algorithms.gradient_merge import GradientMergeConfig
from fleetx.strategy.algorithms.gradient_scale import GradientScaleConfig
from fleetx.strategy.algorithms.hybrid import HybridConfig
from fleetx.strategy.algorithms.lamb import LambConfig
from fleetx.strategy.algorithms.lars import LarsConfig
from fleetx.strategy.algorithms.localsgd import LocalSGDConfig
from fleetx.strategy.algorithms.pipeline import PipelineConfig
from fleetx.strategy.algorithms.recompute import RecomputeConfig
from fleetx.strategy.algorithms.sharding import ShardingConfig
from fleetx.strategy.algorithms.tensor_parallel import TensorParallelConfig
from fleetx.strategy.algorithms.trainer_desc import TrainerDescConfig
from fleetx.strategy.build import BuildStrategy, ExecutionStrategy
from fleetx.strategy.config import Config, option, unknown_name, warn_old_name

__all__ = ["TopLevelConfig", "MESSAGES", "BAGS", "SPELLINGS", "ALIASES", "resolve_name",
           "declare", "undeclare", "top_level", "field_names"]


@dataclass
class TopLevelConfig(Config):
    """The scalar fields of :class:`DistributedStrategy`, in protobuf field-number order (1-35)."""

    mode: str = option("COLLECTIVE", "Job architecture as recorded in saved strategies.",
                       enum={"COLLECTIVE": 1, "PS": 2, "PIPELINE": 3, "HETER": 4},
                       no_effect="fleetx takes the mode from fleet.init(is_collective=...)")
    amp: bool = option(False, "Automatic mixed precision (amp_configs).")
    recompute: bool = option(False, "Recompute / activation checkpointing (recompute_configs).",
                             no_effect=RecomputeConfig.no_effect)
    localsgd: bool = option(False, "Local SGD (localsgd_configs).")
    dgc: bool = option(False, "Deep gradient compression (dgc_configs).")
    gradient_merge: bool = option(False, "Gradient accumulation (gradient_merge_configs).")
    lars: bool = option(False, "LARS optimizer (lars_configs).")
    lamb: bool = option(False, "LAMB optimizer (lamb_configs).")
    pipeline: bool = option(False, "Pipeline parallelism (pipeline_configs).",
                            no_effect="pipelines run when hybrid_configs['pp_degree'] > 1 "
                            "(a PipelineLayer under fleet.distributed_model); this switch is the "
                            "static graph's")
    elastic: bool = option(False, "Elastic training (Paddle 2.2 does not act on it either).",
                           no_effect="elastic jobs come from fleetrun --nnodes MIN:MAX")
    auto: bool = option(False, "Choose amp, recompute and the sharding stage left unset by "
                        "measuring a few real steps of each candidate plan at the first training "
                        "forward: the fastest that fits in memory per rank (FLEETX_AUTO_MEMORY_MB "
                        "or the free memory).")
    a_sync: bool = option(True, "Parameter server: async (True) or sync (False); assigning it "
                          "resets a_sync_configs['k_steps'] to 0 (a_sync_configs).")
    sync_nccl_allreduce: bool = option(True, "Wait for each all-reduce before computing on.",
                                       no_effect="DDP always synchronises its gradient buckets")
    nccl_comm_num: int = option(1, "Communicators (streams) used for gradient all-reduce.", ge=1)
    use_hierarchical_allreduce: bool = option(
        False, "All-reduce inside each node first, then across nodes.")
    hierarchical_allreduce_inter_nranks: int = option(
        1, "Ranks per node for hierarchical all-reduce.", ge=1)
    sync_batch_norm: bool = option(False, "Batch-norm statistics over all workers.")
    fuse_all_reduce_ops: bool = option(True, "Fuse gradient all-reduces into buckets.")
    fuse_grad_size_in_MB: int = option(32, "Bucket size in MB of fused all-reduce.", gt=0)
    fuse_grad_size_in_TFLOPS: float = option(
        50.0, "Layers per fused all-reduce (Paddle attribute _fuse_grad_size_in_TFLOPS).", gt=0,
        no_effect="buckets are sized in MB (fuse_grad_size_in_MB)")
    cudnn_exhaustive_search: bool = option(
        False, "Benchmark convolution algorithms.",
        no_effect="set torch.backends.cudnn.benchmark in the script")
    conv_workspace_size_limit: int = option(512, "cuDNN workspace limit in MB.", gt=0,
                                            no_effect="no cuDNN workspace knob in PyTorch")
    cudnn_batchnorm_spatial_persistent: bool = option(
        False, "Use cuDNN's persistent spatial batch-norm mode.",
        no_effect="no such cuDNN switch in PyTorch")
    adaptive_localsgd: bool = option(False, "Adaptive local SGD (adaptive_localsgd_configs).")
    fp16_allreduce: bool = option(False, "Cast gradients to float16 for all-reduce.")
    sharding: bool = option(
        False, "ZeRO-style sharding of optimizer state, gradients, parameters by stage "
        "(sharding_configs).")
    last_comm_group_size_MB: float = option(
        1.0, "Size in MB of the last gradient bucket (filled first in backward).", gt=0,
        no_effect="DDP sizes its first bucket itself")
    find_unused_parameters: bool = option(
        False, "Data parallel: look for parameters that got no gradient.")
    tensor_parallel: bool = option(
        False, "Paddle's static-graph switch of tensor parallelism (tensor_parallel_configs).",
        no_effect="no switch is needed: hybrid_configs['mp_degree'] (or "
        "tensor_parallel_configs['tensor_parallel_degree']) turns tensor parallelism on, as in "
        "Paddle 2.2's dynamic graph")
    without_graph_optimization: bool = option(
        False, "Insert all-reduces directly instead of through the graph executor.",
        no_effect="no static graph")
    fuse_grad_size_in_num: int = option(
        8, "Gradients per fused all-reduce without graph optimization.", ge=1,
        no_effect="buckets are sized in MB (fuse_grad_size_in_MB)")
    calc_comm_same_stream: bool = option(
        False, "Compute and communicate on one stream (Paddle attribute _calc_comm_same_stream).",
        no_effect="DDP chooses its streams")
    asp: bool = option(False, "2:4 structured sparsity.", no_effect="not implemented")
    fuse_grad_merge: bool = option(
        False, "Fuse the gradient-merge buffers.",
        no_effect="gradient merge accumulates in the parameters' .grad")
    semi_auto: bool = option(False, "Semi-automatic parallelism (experimental).",
                             no_effect="no auto-parallel planner")


# The message fields in protobuf field-number order: *_configs 101-114, build_strategy 201,
# execution_strategy 202, gradient_scale_configs 203. Prototxt output follows this order.
MESSAGES: dict[str, type[Config]] = {cls.section: cls for cls in (
    RecomputeConfig, AmpConfig, LocalSGDConfig, GradientMergeConfig, DGCConfig, PipelineConfig,
    AsyncConfig, LarsConfig, LambConfig, AdaptiveLocalSGDConfig, ShardingConfig, HybridConfig,
    TensorParallelConfig, TrainerDescConfig, BuildStrategy, ExecutionStrategy,
    GradientScaleConfig)}
BAGS = ("build_strategy", "execution_strategy")
# Paddle's attribute spellings of two proto fields: accepted silently.
SPELLINGS = {"_fuse_grad_size_in_TFLOPS": "fuse_grad_size_in_TFLOPS",
             "_calc_comm_same_stream": "calc_comm_same_stream"}
# Older names from earlier releases and their docs: accepted with a DeprecationWarning.
ALIASES = {"fp16_compress": "fp16_allreduce"}


# The switches strategy modules declared (name -> help), the scalar fields' class with them, and
# every field's name; declare / undeclare rebuild the last two.
_DECLARED: dict[str, str] = {}
_top: type[Config] = TopLevelConfig
_DeclaredTopLevel: Optional[type[Config]] = None
_names: tuple[str, ...] = tuple(TopLevelConfig.specs()) + tuple(MESSAGES)


def top_level() -> type[Config]:
    """The class of the scalar fields: :class:`TopLevelConfig`, plus the declared switches."""
    return _top


def field_names() -> tuple[str, ...]:
    """Every field's name: the scalar fields, then the messages (Paddle's, then declared)."""
    return _names


def declare(switch: str, help: str, config: Optional[type[Config]] = None) -> None:
    """Give ``DistributedStrategy`` the field of a strategy defined outside this list: the bool
    switch ``strategy.<switch>`` (default False) and, with ``config``, its ``<switch>_configs``
    message. They behave as Paddle's fields do (checked assignment, dict, files, overview);
    strategy objects built before the declaration do not have them.

    Args:
        switch: the switch's name, the strategy's ``name``.
        help: what the switch turns on, for the overview and the reference.
        config: the strategy's config class; its ``section`` must be ``<switch>_configs``.

    Raises:
        ValueError: the switch or section is a field already, or the section is misnamed.

    Example:
        >>> declare("echo", "Print each loss.")
        >>> resolve_name("echo"), top_level()().echo
        ('echo', False)
        >>> undeclare("echo")
    """
    section = config.section if config is not None else None
    if config is not None and section != f"{switch}_configs":
        raise ValueError(f"the config of switch {switch!r} must have section "
                         f"'{switch}_configs', got {section!r}")
    taken = sorted({switch, section} & set(_names + tuple(SPELLINGS) + tuple(ALIASES)))
    if taken:
        raise ValueError(f"{', '.join(taken)} is a DistributedStrategy field already")
    _DECLARED[switch] = help
    if config is not None:
        MESSAGES[section] = config
    _rebuild()


def undeclare(switch: str) -> None:
    """Remove a field :func:`declare` added (a test that declared one cleans up with it).

    Raises:
        ValueError: ``switch`` was not declared.
    """
    if switch not in _DECLARED:
        raise ValueError(unknown_name("declared switch", switch, _DECLARED))
    del _DECLARED[switch]
    MESSAGES.pop(f"{switch}_configs", None)
    _rebuild()


def _rebuild() -> None:
    global _top, _names, _DeclaredTopLevel
    _top = _DeclaredTopLevel = TopLevelConfig
    if _DECLARED:
        # A subclass with the switches after Paddle's fields, bound to this module's name so
        # that a strategy holding one pickles (a process that declares the same fields
        # unpickles it).
        _top = _DeclaredTopLevel = dataclasses.make_dataclass(
            "_DeclaredTopLevel", [(name, bool, option(False, text))
                                  for name, text in _DECLARED.items()],
            bases=(TopLevelConfig,))
        _top.__module__ = __name__
    _names = tuple(_top.specs()) + tuple(MESSAGES)


def resolve_name(name: str) -> str:
    """The field that attribute ``name`` means: itself, or the field of a Paddle spelling or an
    old name (the latter with a DeprecationWarning).

    Raises:
        TypeError: ``name`` is no field (the message lists the fields).
    """
    if name in _names:
        return name
    if name in SPELLINGS:
        return SPELLINGS[name]
    if name in ALIASES:
        warn_old_name(f"strategy.{name} is an old name; use strategy.{ALIASES[name]}")
        return ALIASES[name]
    raise TypeError(unknown_name("DistributedStrategy attribute", name, _names))


# Strategies outside Paddle's list are declared (declare) once everything above exists, so every
# DistributedStrategy has their fields.
declare("anomaly_guard", "Skip NaN/inf and loss-spike updates, roll back after a run of them "
        "(anomaly_guard_configs; a fleetx extension).", AnomalyGuardConfig)
