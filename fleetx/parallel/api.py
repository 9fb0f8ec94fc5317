"""The contract of :mod:`fleetx.parallel`: its errors and the names shared by its modules.

Siblings (``hcg.py``, ``random.py``, the layers, the pipeline) import from here, not from each
other's internals, except :func:`fleetx.parallel.hcg.get_hcg`, the one way to reach the hybrid
group that ``fleet.init`` built.
"""
from __future__ import annotations

__all__ = ["ParallelError", "NoHybridGroupError", "MODEL_PARALLEL_RNG"]


class ParallelError(RuntimeError):
    """A model-parallel object was used in a way the topology cannot serve."""


class NoHybridGroupError(ParallelError):
    """No hybrid communicate group exists: ``fleet.init(is_collective=True, ...)`` was not
    called, and the caller gave no explicit group."""


# The name under which fleet.init registers the per-model-parallel-rank random stream in the
# tracker (Paddle's name, so scripts that say rng_state("model_parallel_rng") work as written).
MODEL_PARALLEL_RNG = "model_parallel_rng"
