"""``fleet.meta_parallel``: Paddle's import path for the model-parallel pieces.

Everything here lives in :mod:`fleetx.parallel`; this module only re-exports its public names,
so that ``from fleetx.fleet import meta_parallel`` and ``fleet.meta_parallel.X`` work as in
Paddle.
"""
from fleetx.parallel import (HybridCommunicateGroup, ParallelMode, RNGStatesTracker,
                             get_rng_state_tracker, model_parallel_random_seed)

__all__ = ["HybridCommunicateGroup", "ParallelMode", "RNGStatesTracker", "get_rng_state_tracker",
           "model_parallel_random_seed"]

from fleetx.parallel import (ColumnParallelLinear, ParallelCrossEntropy,  # noqa: E402
                             RowParallelLinear, VocabParallelEmbedding)

__all__ += ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
            "ParallelCrossEntropy"]

from fleetx.parallel import ShardedClassifier  # noqa: E402

__all__ += ["ShardedClassifier"]

from fleetx.parallel.tp_plan import PlanError, full_state_dict, parallelize  # noqa: E402

__all__ += ["parallelize", "full_state_dict", "PlanError"]

from fleetx.parallel.api import PipelineError  # noqa: E402
from fleetx.parallel.pipeline import LayerDesc, PipelineLayer, SharedLayerDesc  # noqa: E402
from fleetx.parallel.pipeline_parallel import PipelineParallel  # noqa: E402

__all__ += ["LayerDesc", "SharedLayerDesc", "PipelineLayer", "PipelineParallel", "PipelineError"]
