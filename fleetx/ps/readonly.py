"""Which requests change the tables, and the refusal of those in inference.

A server started ``read_only`` serves an inference-only job, and a worker that sent INFER has
turned to inference (``docs/ps_inference.md``): for them PUSH, INIT, SET_LR, SHRINK and a PULL that may
create rows are refused, naming the mode. Pure functions over a request's kind and meta.
"""
from __future__ import annotations

from typing import Optional

from fleetx.ps.api import Kind, RequestError

__all__ = ["write_of", "refusal"]

_WRITES = (Kind.PUSH, Kind.INIT, Kind.SET_LR, Kind.SHRINK)  # SHRINK decays and removes rows


def write_of(kind: Kind, meta: dict) -> Optional[str]:
    """How a request that would change a table is named in a refusal; None for a read (a
    PULL with ``create=false``, or of dense tables only, creates nothing)."""
    if kind in _WRITES:
        return kind.name
    if kind == Kind.PULL and meta.get("create", True) is not False and meta.get("sparse"):
        return "a PULL that may create rows (create=true)"
    return None


def refusal(what: str, server: str, read_only: bool, worker: Optional[str]) -> RequestError:
    """The error for write ``what``: on a read-only ``server``, or from ``worker`` (its name)
    that turned to inference."""
    if read_only:
        return RequestError(f"{what} refused: {server} serves an inference-only job "
                            "(read-only tables: no updates, no new rows)")
    return RequestError(f"{what} refused: {worker} turned to inference "
                        "(DistributedInfer.init_distributed_infer_env); the tables are "
                        "read-only for it")
