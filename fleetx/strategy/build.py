"""Graph build and execution options (``strategy.build_strategy`` / ``execution_strategy``).

Paddle compiles a static program with a *build strategy* (which fusion and memory passes to run)
and executes it with an *execution strategy* (threads, scope dropping). fleetx keeps both as
plain field bags with Paddle's names and defaults so that code and saved strategies written for
Paddle load unchanged; strategies read the fields that have a PyTorch meaning, and every other
field declares why it has none (``no_effect``).
"""
from dataclasses import dataclass

from fleetx.strategy.config import Config, option

__all__ = ["BuildStrategy", "ExecutionStrategy"]

# Why most of these options have nothing to act on in eager PyTorch (declared per field below).
_EAGER = "eager PyTorch already runs operations in program order"
_FUSION = "kernel fusion: use torch.compile"
_EXECUTOR = "no static-graph executor"
_MEMORY = "memory reuse is PyTorch's own"
_DDP_ORDER = "DDP's gradient communication ends before the step"
_ADDTO = "gradients already accumulate in place in .grad"
_GRAPHS = "capture the step with torch.cuda.graphs in the script"


class _Bag(Config):
    @classmethod
    def label(cls, key: str) -> str:
        return f"{cls.section}.{key}"

    @classmethod
    def what(cls) -> str:
        return f"{cls.section} field"


@dataclass
class BuildStrategy(_Bag):
    """``strategy.build_strategy``: graph fusion and memory options.

    Example:
        >>> bs = BuildStrategy()
        >>> bs.fuse_all_optimizer_ops = True
        >>> bs.enable_backward_optimizer_op_deps
        True
    """

    section = "build_strategy"

    enable_sequential_execution: bool = option(False, "Run ops in program order.",
                                               no_effect=_EAGER)
    fuse_elewise_add_act_ops: bool = option(False, "Fuse elementwise add and activation.",
                                            no_effect=_FUSION)
    fuse_bn_act_ops: bool = option(False, "Fuse batch norm and activation.", no_effect=_FUSION)
    fuse_relu_depthwise_conv: bool = option(False, "Fuse ReLU and depthwise convolution.",
                                            no_effect=_FUSION)
    fuse_broadcast_ops: bool = option(False, "Fuse broadcasts (reduce mode only).",
                                      no_effect=_FUSION)
    fuse_all_optimizer_ops: bool = option(False, "Fuse the optimizer updates of all parameters.")
    enable_inplace: bool = option(False, "Reuse input buffers for outputs where safe.",
                                  no_effect=_MEMORY)
    enable_backward_optimizer_op_deps: bool = option(
        True, "Order backward communication before the optimizer ops.", no_effect=_DDP_ORDER)
    cache_runtime_context: bool = option(False, "Cache each op's runtime context.",
                                         no_effect=_EXECUTOR)
    fuse_bn_add_act_ops: bool = option(True, "Fuse batch norm, add and activation.",
                                       no_effect=_FUSION)
    enable_auto_fusion: bool = option(False, "Let the compiler fuse elementwise subgraphs.",
                                      no_effect=_FUSION)
    enable_addto: bool = option(False, "Accumulate gradients in place (addto).",
                                no_effect=_ADDTO)
    fix_op_run_order: bool = option(False, "Fix the op run order across runs.",
                                    no_effect=_EAGER)
    allow_cuda_graph_capture: bool = option(False, "Allow capturing the step as a CUDA graph.",
                                            no_effect=_GRAPHS)

@dataclass
class ExecutionStrategy(_Bag):
    """``strategy.execution_strategy``: executor threads and scope handling.

    Example:
        >>> ExecutionStrategy(num_threads=4).num_iteration_per_drop_scope
        10
    """

    section = "execution_strategy"

    num_threads: int = option(1, "Executor threads; 0 chooses from the device count.", ge=0)
    num_iteration_per_drop_scope: int = option(
        10, "Iterations between two clean-ups of temporary variables.", ge=1,
        no_effect=_EXECUTOR)
    num_iteration_per_run: int = option(1, "Iterations per executor run.", ge=1,
                                        no_effect=_EXECUTOR)
    use_thread_barrier: bool = option(False, "Synchronise executor threads every iteration.",
                                      no_effect=_EXECUTOR)
