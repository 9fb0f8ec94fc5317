"""Model parallelism: the hybrid topology's process groups, the model-parallel random streams,
and (beside them) tensor-parallel layers and the pipeline.

Re-exported as ``fleetx.fleet.meta_parallel`` (Paddle's import path). This package never imports
:mod:`fleetx.fleet` or :mod:`fleetx.strategy`: ``fleet.init`` resolves the degrees
(:func:`fleetx.strategy.topology.resolve`) and hands the resulting topology to
:class:`~fleetx.parallel.hcg.HybridCommunicateGroup`; layers and the pipeline take an explicit
group or ask :func:`~fleetx.parallel.hcg.get_hcg` for the one ``fleet.init`` built.
"""
from fleetx.parallel.api import MODEL_PARALLEL_RNG, NoHybridGroupError, ParallelError
from fleetx.parallel.hcg import HybridCommunicateGroup, ParallelMode, get_hcg, set_hcg
from fleetx.parallel.random import (RNGStatesTracker, get_rng_state_tracker,
                                    model_parallel_random_seed)

__all__ = ["MODEL_PARALLEL_RNG", "NoHybridGroupError", "ParallelError", "HybridCommunicateGroup",
           "ParallelMode", "get_hcg", "set_hcg", "RNGStatesTracker", "get_rng_state_tracker",
           "model_parallel_random_seed"]

from fleetx.parallel.cross_entropy import ParallelCrossEntropy, parallel_cross_entropy
from fleetx.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                    VocabParallelEmbedding, sharded_parameters)

__all__ += ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
            "ParallelCrossEntropy", "parallel_cross_entropy", "sharded_parameters"]

from fleetx.parallel.classifier import ShardedClassifier  # noqa: E402

__all__ += ["ShardedClassifier"]
