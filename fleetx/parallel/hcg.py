"""The hybrid communicate group: one process group per axis of the topology, and Paddle's queries.

``fleet.init(is_collective=True, strategy=s)`` resolves the degrees of ``s.hybrid_configs`` into a
:class:`~fleetx.strategy.topology.Topology` and builds a :class:`HybridCommunicateGroup` over it;
``fleet.get_hybrid_communicate_group()`` and :func:`get_hcg` return it. Tests and scripts that
run without ``fleet.init`` build one themselves after ``torch.distributed.init_process_group``.

:func:`get_hcg` reads process-wide state: the group the fleet that initialised last registered
with :func:`set_hcg` (``fleetx/fleet/hybrid.py``; it clears it when that fleet leaves its world).
It exists because Paddle's API reaches the group with no fleet in hand: the tensor-parallel
layers, the pipeline stage and hybrid clipping are built by user code that passes no group, as
in Paddle. Code that has a fleet asks it instead (``fleet.get_hybrid_communicate_group()``).

Every rank creates every group of every axis, in the same order (data, pipe, sharding, model,
then the check groups): ``torch.distributed.new_group`` is a collective call over the world,
and ranks that created groups in different orders would pair the wrong groups.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

import torch.distributed as dist

from fleetx.parallel.api import ParallelError

__all__ = ["HybridCommunicateGroup", "ParallelMode", "get_hcg", "set_hcg"]

# The axes in Paddle's order; the topology's groups(axis) answers for each.
_AXES = ("data", "pipe", "sharding", "model")
_DEGREES = {"data": "dp_degree", "pipe": "pp_degree", "sharding": "sharding_degree",
            "model": "mp_degree"}


class ParallelMode(enum.IntEnum):
    """What the topology mostly does (Paddle's ``ParallelMode``; the pipeline wins over tensor
    parallelism, which wins over sharding)."""

    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3


class _Flag(int):
    """A bool that can also be called: Paddle exposes ``hcg.is_first_stage`` as an attribute,
    and scripts written against the documented query call it; both spellings work."""

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


class HybridCommunicateGroup:
    """This rank's process groups on the hybrid topology, with Paddle's queries.

    Args:
        topology: a :class:`~fleetx.strategy.topology.Topology` (any object with its
            ``dp_degree``, ``pp_degree``, ``sharding_degree``, ``mp_degree``, ``world_size``,
            ``groups(axis)`` and ``coordinate(rank)``).

    Without an initialised ``torch.distributed`` the topology must be of one process; every
    group is then None and every rank 0 (a one-process job needs no communication).

    Raises:
        ParallelError: the degrees' product is not the world size (each degree named as
            ``name=value``), or there is no process group and the topology has more than one
            process.

    Example:
        >>> # on 4 processes, after torch.distributed.init_process_group("gloo")
        >>> hcg = HybridCommunicateGroup(Topology(dp_degree=2, sharding_degree=1, mp_degree=2))
        >>> hcg.get_model_parallel_rank(), hcg.get_data_parallel_rank()  # on rank 3
        (1, 1)
    """

    def __init__(self, topology: Any) -> None:
        self._topo = topology
        initialised = dist.is_available() and dist.is_initialized()
        self.nranks = dist.get_world_size() if initialised else 1
        self.global_rank = dist.get_rank() if initialised else 0
        if topology.world_size != self.nranks:
            degrees = " x ".join(f"{_DEGREES[a]}={getattr(topology, _DEGREES[a])}"
                                 for a in _AXES)
            raise ParallelError(
                f"{degrees} is {topology.world_size} processes, but the world has "
                f"{self.nranks}: make the product of the degrees {self.nranks}")
        self._coord = topology.coordinate(self.global_rank)
        self.stage_id = self._coord.pipe
        self._ranks: dict = {}
        self._groups: dict = {}
        for axis in _AXES:
            self._ranks[axis], self._groups[axis] = self._create(topology.groups(axis), initialised)
        # Paddle's check group: every rank of this rank's replica (same data index), over which
        # a global gradient norm or an inf/nan check is reduced.
        replicas = [[r for r in range(self.nranks) if topology.coordinate(r).data == d]
                    for d in range(topology.dp_degree)]
        self._ranks["check"], self._groups["check"] = self._create(replicas, initialised)
        pp = topology.pp_degree
        self.is_first_stage = _Flag(self.stage_id == 0)
        self.is_last_stage = _Flag(self.stage_id == pp - 1)
        pipe = self._ranks["pipe"]
        # The ring of Paddle's p2p helpers: the first stage's previous rank is the last stage.
        self._prev_rank = pipe[(self.stage_id - 1) % pp]
        self._next_rank = pipe[(self.stage_id + 1) % pp]

    def _create(self, groups: list, initialised: bool) -> tuple[list, Optional[Any]]:
        """Create every group (all ranks, same order); this rank's ranks and its group."""
        mine, handle = None, None
        for ranks in groups:
            group = dist.new_group(ranks=ranks) if initialised else None
            if self.global_rank in ranks:
                mine, handle = list(ranks), group
        assert mine is not None, "every rank sits in one group of every axis"
        return mine, handle

    def __repr__(self) -> str:
        return (f"HybridCommunicateGroup(rank={self.global_rank}, dp={self._topo.dp_degree}, "
                f"pp={self._topo.pp_degree}, sharding={self._topo.sharding_degree}, "
                f"mp={self._topo.mp_degree}, data group={self._ranks['data']}, pipe group="
                f"{self._ranks['pipe']}, sharding group={self._ranks['sharding']}, model group="
                f"{self._ranks['model']})")

    # -- the whole topology ---------------------------------------------------------------------
    def topology(self) -> Any:
        """The :class:`~fleetx.strategy.topology.Topology` the groups were built from."""
        return self._topo

    def get_global_rank(self) -> int:
        """This process's rank in the world."""
        return self.global_rank

    def get_parallel_mode(self) -> ParallelMode:
        """The :class:`ParallelMode` of the topology."""
        if self._topo.pp_degree > 1:
            return ParallelMode.PIPELINE_PARALLEL
        if self._topo.mp_degree > 1:
            return ParallelMode.TENSOR_PARALLEL
        if self._topo.sharding_degree > 1:
            return ParallelMode.SHARDING_PARALLEL
        return ParallelMode.DATA_PARALLEL

    def group_ranks(self, axis: str) -> list:
        """The global ranks of this rank's group on ``axis`` (``data``, ``pipe``,
        ``sharding``, ``model`` or ``check``), in the group's rank order.

        Raises:
            ValueError: ``axis`` is not one of those names.
        """
        if axis not in self._ranks:
            raise ValueError(f"unknown axis {axis!r}: choose one of {', '.join(self._ranks)}")
        return list(self._ranks[axis])

    # -- data parallel --------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self._coord.data

    def get_data_parallel_world_size(self) -> int:
        """``dp_degree``."""
        return self._topo.dp_degree

    def get_data_parallel_group(self) -> Optional[Any]:
        """The torch process group of this rank's data-parallel group."""
        return self._groups["data"]

    def get_data_parallel_group_src_rank(self) -> int:
        """The global rank of the first member of this rank's data-parallel group."""
        return self._ranks["data"][0]

    # -- model (tensor) parallel ----------------------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        """This rank's index in its model-parallel group (which shard of a split weight)."""
        return self._coord.model

    def get_model_parallel_world_size(self) -> int:
        """``mp_degree``."""
        return self._topo.mp_degree

    def get_model_parallel_group(self) -> Optional[Any]:
        """The torch process group of this rank's model-parallel group."""
        return self._groups["model"]

    def get_model_parallel_group_src_rank(self) -> int:
        """The global rank of the first member of this rank's model-parallel group."""
        return self._ranks["model"][0]

    # -- pipeline -------------------------------------------------------------------------------
    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """``pp_degree``: the number of stages."""
        return self._topo.pp_degree

    def get_pipe_parallel_group(self) -> Optional[Any]:
        """The torch process group of this rank's pipeline (its ranks in stage order)."""
        return self._groups["pipe"]

    def get_rank_from_stage(self, stage_id: int) -> int:
        """The global rank of stage ``stage_id`` in this rank's pipeline.

        Raises:
            ValueError: ``stage_id`` is not a stage.
        """
        pp = self._topo.pp_degree
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or \
                not 0 <= stage_id < pp:
            raise ValueError(f"stage_id={stage_id!r} is not a stage: choose 0 to {pp - 1}")
        return self._ranks["pipe"][stage_id]

    def get_p2p_prev_rank(self) -> int:
        """The global rank of the previous stage (the last stage's, on the first stage)."""
        return self._prev_rank

    def get_p2p_next_rank(self) -> int:
        """The global rank of the next stage (the first stage's, on the last stage)."""
        return self._next_rank

    # -- sharding -------------------------------------------------------------------------------
    def get_sharding_parallel_rank(self) -> int:
        """This rank's index in its sharding group."""
        return self._coord.sharding

    def get_sharding_parallel_world_size(self) -> int:
        """``sharding_degree``."""
        return self._topo.sharding_degree

    def get_sharding_parallel_group(self) -> Optional[Any]:
        """The torch process group of this rank's sharding group."""
        return self._groups["sharding"]

    def get_sharding_parallel_group_src_rank(self) -> int:
        """The global rank of the first member of this rank's sharding group."""
        return self._ranks["sharding"][0]

    # -- every group of one replica -------------------------------------------------------------
    def get_check_parallel_group(self) -> Optional[Any]:
        """The process group of every rank with this rank's data-parallel index (one whole
        replica of the model: where a global gradient norm is summed)."""
        return self._groups["check"]


_current: Optional[HybridCommunicateGroup] = None


def get_hcg() -> Optional[HybridCommunicateGroup]:
    """The hybrid communicate group ``fleet.init`` built last, or None if there is none."""
    return _current


def set_hcg(hcg: Optional[HybridCommunicateGroup]) -> None:
    """Make ``hcg`` the group :func:`get_hcg` returns (``fleet.init`` calls this; None clears
    it when the fleet leaves its world).

    Raises:
        TypeError: ``hcg`` is neither None nor a :class:`HybridCommunicateGroup`.
    """
    global _current
    if hcg is not None and not isinstance(hcg, HybridCommunicateGroup):
        raise TypeError(f"set_hcg expects a HybridCommunicateGroup or None, "
                        f"got {type(hcg).__name__}")
    _current = hcg
