"""What ``fleet.save_persistables(dirname, mode)`` does on the first worker, with servers or alone.

With servers: send what is queued, ask every server to write its shards in ``mode``, write the
dense weights, and commit the save with a manifest whose ``info`` names the mode and, for a
delta, the base of its chain and the save it follows (every server must report the same chain;
otherwise nothing is committed). Alone (no servers), the local tables are written as one
server's shards, with the same chain bookkeeping (:class:`LocalChain`).

A save that fails leaves the chain where it was for the servers, which already advanced it:
the next delta would then follow a save that was never committed. So after a failed save the
first worker refuses deltas until a full save (mode 0 or 1) succeeds.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from fleetx.checkpoint import CheckpointError, SaveWriter
from fleetx.ps import checkpoint
from fleetx.ps.api import StateError
from fleetx.ps.checkpoint import Chain
from fleetx.ps.rules import make_rule
from fleetx.ps.table import DenseTable, SparseTable

__all__ = ["MODES", "check_mode", "save_remote", "LocalChain"]

#: save_persistables modes: everything, a base (weights), a delta since the last save
MODES = (0, 1, 2)


def check_mode(mode: Any) -> int:
    """``mode`` if it is a save mode.

    Raises:
        ValueError: anything else (names the modes).
    """
    if isinstance(mode, bool) or mode not in MODES:
        raise ValueError(f"save_persistables(mode={mode!r}): expected 0 (everything, with the "
                         "optimizer state of every row), 1 (a base: weights) or 2 (a delta: the "
                         "rows changed since the last save)")
    return mode


def _info(mode: int, chain: Optional[Chain]) -> dict:
    info: dict = {"mode": mode}
    if mode == 2:
        info.update(base_save_id=chain.base, prev_save_id=chain.prev)
    return info


def save_remote(comm: Any, dense_names: list, dirname: str, mode: int) -> dict:
    """The first worker's part of a save with servers; returns rows saved per sparse table.

    Raises:
        CheckpointError: the servers continue different chains, or a file or the commit
            cannot be written (nothing is committed).
        fleetx.ps.RemoteError: a server refused (a delta without a base, NaN rows...).
    """
    comm.flush()
    writer = SaveWriter(dirname)
    rows, files, replies = comm.client.save_with_chain(writer.dirname, writer.save_id,
                                                       mode).wait()
    writer.add(files)
    chain = None
    if mode == 2:
        chains = {(r["chain"]["base"], r["chain"]["prev"]) for r in replies}
        if len(chains) != 1:
            raise CheckpointError(f"cannot commit delta {writer.save_id}: the servers follow "
                                  f"different saves {sorted(chains)}; make a full save (mode 0 "
                                  "or 1)", writer.dirname)
        base, prev = chains.pop()
        chain = Chain(base, prev, False)
    if dense_names:
        checkpoint.save_dense(writer, comm.client.pull(dense=dense_names).wait().dense, mode)
    writer.commit(_info(mode, chain))
    return rows


class LocalChain:
    """A one-process job's tables saved as one server's shards, with the delta chain the
    servers keep (:meth:`fleetx.ps.shard.Shard.save`)."""

    def __init__(self, sparse: Mapping[str, SparseTable],
                 chain: Optional[Chain] = None) -> None:
        self.sparse, self.chain = sparse, None
        if chain is not None:
            self.restart(chain)

    def restart(self, chain: Chain) -> None:
        self.chain = chain
        for t in self.sparse.values():
            t.changes.start(len(t))

    def save(self, dirname: str, mode: int, dense: Mapping[str, Any], specs) -> None:
        """Write the tables and ``dense`` weights (``specs``: the dense tables' specs) and
        commit.

        Raises:
            StateError: a delta without a base save or load before it, or after a load of
                some of the chain's tables only.
        """
        if mode == 2 and self.chain is None:
            raise StateError("save_persistables(mode=2): a delta needs a base: make a full save "
                             "(mode 0 or 1) first, or load one (init_server)")
        if mode == 2:
            self.chain.check_delta(StateError, "save_persistables(mode=2)")
        tables = {}
        for spec in specs:
            t = DenseTable(spec, make_rule(spec.rule), 0, spec.numel)
            t.assign(dense[spec.name])
            tables[spec.name] = t
        writer = SaveWriter(dirname)
        checkpoint.save_server(writer, 0, 1, 1, self.sparse, tables, mode, self.chain)
        checkpoint.save_dense(writer, dense, mode)
        writer.commit(_info(mode, self.chain))
        if mode == 2:
            self.restart(self.chain._replace(prev=writer.save_id))
        else:
            self.restart(Chain(writer.save_id, writer.save_id, mode == 0))
