"""The contract of :mod:`fleetx.parallel`: its errors and the names shared by its modules.

Siblings (``hcg.py``, ``random.py``, the layers, the pipeline) import from here, not from each
other's internals, except :func:`fleetx.parallel.hcg.get_hcg`, the one way to reach the hybrid
group that ``fleet.init`` built.
"""
from __future__ import annotations

import sys
from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["ParallelError", "NoHybridGroupError", "PipelineError", "StageOptimizer",
           "MODEL_PARALLEL_RNG", "is_dtensor", "local_part"]


class ParallelError(RuntimeError):
    """A model-parallel object was used in a way the topology cannot serve."""


class NoHybridGroupError(ParallelError):
    """No hybrid communicate group exists: ``fleet.init(is_collective=True, ...)`` was not
    called, and the caller gave no explicit group."""


class PipelineError(ParallelError):
    """A pipeline stage failed, or a peer stage died or stayed silent past the timeout."""


@runtime_checkable
class StageOptimizer(Protocol):
    """An optimizer that runs the backward passes itself, as ``fleet.distributed_optimizer``'s
    wrapper does (so amp's loss scale, its step guard and the other strategies' hooks apply).

    ``PipelineParallel.train_batch`` runs the last stage's backward as ``backward(loss)`` and
    every other stage's as ``backward_from(outputs, grads)``: the gradients of the stage's
    outputs came from the next stage's backward and already carry what the loss's backward
    applied (amp's scale), so they are not changed again. A plain ``torch.optim.Optimizer`` has
    neither method; ``train_batch`` then runs ``torch.autograd.backward`` itself.
    """

    def backward(self, loss: Any) -> None: ...

    def backward_from(self, tensors: Sequence[Any], grad_tensors: Sequence[Any]) -> None: ...

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


# The name under which fleet.init registers the per-model-parallel-rank random stream in the
# tracker (Paddle's name, so scripts that say rng_state("model_parallel_rng") work as written).
MODEL_PARALLEL_RNG = "model_parallel_rng"


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (the parameter shards of
    sharding stages 2 and 3), without importing that module: none can exist before something
    imported it, and ``import fleetx`` leaves it to the first use (it costs about 0.7 CPU
    seconds).

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_part(tensor: Any) -> Any:
    """A DTensor's local shard (``to_local()``); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
