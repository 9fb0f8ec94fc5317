"""Picks the worker-side communicator for a mode."""
from __future__ import annotations

from typing import Optional

from fleetx.ps.api import CommunicatorConfig, PSMode, PSConfig, Tables
from fleetx.ps_torch.async_communicator import AsyncCommunicator
from fleetx.ps_torch.communicator import Communicator, SyncCommunicator
from fleetx.ps_torch.geo import GeoCommunicator

__all__ = ["make_communicator"]

_BY_MODE = {c.mode: c for c in (SyncCommunicator, AsyncCommunicator, GeoCommunicator)}


def make_communicator(config: PSConfig, rank: int, tables: Tables,
                      comm: Optional[CommunicatorConfig] = None) -> Communicator:
    """The communicator for ``config.mode`` (not started: call ``start``).

    Example:
        >>> comm = make_communicator(config, rank, tables)      # doctest: +SKIP
        >>> dense = comm.start(dense=initial_weights)
    """
    return _BY_MODE[PSMode(config.mode)](config, rank, tables, comm)
