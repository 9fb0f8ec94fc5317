"""The hybrid topology of a collective job: built by ``fleet.init``, returned by
``fleet.get_hybrid_communicate_group()``.

``fleet.init(is_collective=True, strategy=s)`` resolves the degrees of ``s.hybrid_configs``
(:func:`fleetx.strategy.topology.resolve`: impossible degrees fail here, before any model is
built), and once the process group exists creates every group of the
:class:`~fleetx.parallel.hcg.HybridCommunicateGroup`. With ``mp_degree > 1`` it then seeds the
model-parallel random streams from ``tensor_parallel_configs['tensor_init_seed']``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from fleetx.fleet.api import FleetError
from fleetx.parallel.hcg import HybridCommunicateGroup, get_hcg, set_hcg
from fleetx.parallel.random import agreed_seed, model_parallel_random_seed
from fleetx.strategy.algorithms.tensor_parallel import init_seed
from fleetx.strategy.topology import resolve

__all__ = ["HybridQueries"]


class HybridQueries:
    """``Fleet``'s part that owns the hybrid communicate group (``Fleet`` supplies ``_strategy``,
    ``_comm`` and ``_rm``)."""

    _hcg: Optional[HybridCommunicateGroup] = None

    def get_hybrid_communicate_group(self) -> HybridCommunicateGroup:
        """The :class:`~fleetx.parallel.hcg.HybridCommunicateGroup` ``fleet.init`` built.

        Raises:
            FleetError: ``fleet.init`` was not called, the job is not collective, or its
                processes have not joined a process group (a dry run, or a role maker that
                describes processes fleetx did not launch).
        """
        rm = self._rm("get_hybrid_communicate_group")
        if self._hcg is None:
            why = ("the job is not collective" if not rm.is_collective else
                   "this process joined no process group (dry run, or a role maker whose "
                   "processes were not launched by fleetrun / torchrun)")
            raise FleetError(f"no hybrid communicate group: {why}; call "
                             f"fleet.init(is_collective=True, strategy=...) under fleetrun")
        return self._hcg

    def _resolve_hybrid(self, world_size: int) -> Any:
        """The topology of ``world_size`` processes; raises before any rendezvous when the
        degrees cannot fill the world."""
        self._clear_hybrid()
        return resolve(self._strategy, world_size)

    def _init_hybrid(self, topology: Any) -> None:
        """Build the groups over ``topology`` and seed the streams, if the world's process group
        exists (a one-process job needs none)."""
        joined = dist.is_available() and dist.is_initialized()
        if topology.world_size > 1 and not joined:
            return
        self._hcg = HybridCommunicateGroup(topology)
        set_hcg(self._hcg)
        seed = init_seed(self._strategy, topology.mp_degree)
        if seed is not None:
            host = self._comm.host_group if self._comm is not None else None
            model_parallel_random_seed(agreed_seed(seed, host),
                                       self._hcg.get_model_parallel_rank())

    def _clear_hybrid(self) -> None:
        """Forget the group (its process groups go with the world's)."""
        if self._hcg is not None and get_hcg() is self._hcg:
            set_hcg(None)
        self._hcg = None

    # what the mixin reads from Fleet (declared for readers; Fleet sets them)
    _strategy: Any
    _comm: Any
