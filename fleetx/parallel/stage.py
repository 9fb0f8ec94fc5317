"""Where this process sits in its pipeline: the pipe group, the stage id, the stages' ranks.

The group comes from an explicit argument (a fleetx extension, for use without ``fleet.init``)
or else from the hybrid topology that ``fleet.init`` built (``fleetx.parallel.hcg.get_hcg()``).
Without ``torch.distributed`` there is one stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from fleetx.parallel.api import NoHybridGroupError
from fleetx.parallel.hcg import get_hcg

__all__ = ["PipeGroup", "resolve_pipe_group", "transfer_device"]


@dataclass
class PipeGroup:
    """One pipeline as seen from one of its stages.

    Attributes:
        group: the pipe group (None with a single process).
        stage: this process's stage id (its rank in ``group``).
        ranks: the global rank of every stage, in stage order.
    """

    group: Optional[dist.ProcessGroup]
    stage: int
    ranks: list[int]
    _all: Optional[list[list[int]]] = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        """Where the transfers' own tensors (headers, a stage's zero loss) live: see
        :func:`transfer_device`."""
        return transfer_device(self.group)

    @property
    def num_stages(self) -> int:
        return len(self.ranks)

    @property
    def prev_rank(self) -> Optional[int]:
        return self.ranks[self.stage - 1] if self.stage > 0 else None

    @property
    def next_rank(self) -> Optional[int]:
        return self.ranks[self.stage + 1] if self.stage + 1 < self.num_stages else None

    @property
    def all_pipelines(self) -> list[list[int]]:
        """The ranks of every pipeline of the job, the same list on every rank (a collective
        over the world the first time: every rank must ask, e.g. while building the model)."""
        if self._all is None:
            if self.group is None or dist.get_world_size() == self.num_stages:  # one pipeline
                self._all = [list(self.ranks)]
            else:
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, list(self.ranks))
                self._all = sorted({tuple(r) for r in gathered})  # type: ignore[arg-type]
                self._all = [list(r) for r in self._all]
        return self._all


def transfer_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device a tensor must be on to travel over ``group``: the current GPU for an NCCL
    group (NCCL moves CUDA tensors only and refuses a CPU one), else the CPU (gloo, or no
    group at all).

    Example:
        >>> transfer_device(None)
        device(type='cpu')
    """
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hybrid_pipe() -> PipeGroup:
    """The pipeline of the hybrid topology that ``fleet.init`` built.

    Raises:
        NoHybridGroupError: there is none.
    """
    hcg = get_hcg()
    if hcg is None:
        raise NoHybridGroupError(
            "PipelineLayer needs a pipe group: call fleet.init(is_collective=True, strategy=s) "
            "with s.hybrid_configs = {'pp_degree': N, ...}, or pass group= (a torch process "
            "group whose ranks are the stages in order)")
    pipelines = [list(r) for r in hcg.topology().groups("pipe")]
    return PipeGroup(hcg.get_pipe_parallel_group(), hcg.get_stage_id(),
                     hcg.group_ranks("pipe"), pipelines)


def resolve_pipe_group(group: Optional[dist.ProcessGroup] = None,
                       num_stages: Optional[int] = None, topology: Any = None) -> PipeGroup:
    """This process's pipeline.

    Args:
        group: an explicit pipe group (its ranks are the stages, in order); by default the
            hybrid topology's. Without ``torch.distributed`` there is one stage.
        num_stages: when given, must equal the pipe group's size.
        topology: Paddle's ``CommunicateTopology``; when given, its ``get_dim("pipe")`` must
            equal the pipe group's size.

    Raises:
        ValueError: ``num_stages`` or the topology's pipe degree disagrees with the pipe group.
        NoHybridGroupError: ``torch.distributed`` is initialised, but neither ``group`` nor a
            hybrid topology is there.
    """
    initialised = dist.is_available() and dist.is_initialized()
    if group is not None:
        ranks = dist.get_process_group_ranks(group)
        pipe = PipeGroup(group, ranks.index(dist.get_rank()), ranks)
    elif initialised:
        pipe = _hybrid_pipe()
    else:
        pipe = PipeGroup(None, 0, [0])
    wanted = {"num_stages": num_stages}
    if topology is not None:
        wanted["topology pipe degree"] = topology.get_dim("pipe")
    for name, value in wanted.items():
        if value is not None and value != pipe.num_stages:
            where = ("without torch.distributed initialised (call fleet.init)"
                     if pipe.group is None else
                     f"the pipe group has {pipe.num_stages} processes")
            raise ValueError(f"PipelineLayer {name}={value}, but {where}")
    return pipe
