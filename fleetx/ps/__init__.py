"""The parameter server: tables of rows on server processes, updated by rules, fed by workers.

Layers, bottom up (each imports only the ones below it and the contract in :mod:`.api`):

* :mod:`.api` - wire format, message kinds, table/rule/cluster specs, errors.
* :mod:`.handshake` - the shared-secret handshake every connection starts with, and connect.
* :mod:`.transport` - framed links: heartbeats, liveness, frame limits, queued replies.
* :mod:`.acceptor` - a server's accept loop: handshakes without a thread each, connection caps.
* :mod:`.tracker` - request ids and the handles ``push``/``pull`` return.
* :mod:`.partition` - the one id -> shard -> server function, and dense slicing.
* :mod:`.table`, :mod:`.rules`, :mod:`.kernels`, :mod:`.initializers` - rows plus a rule.
* :mod:`.requests` - every request's fields checked against the tables before they change.
* :mod:`.rounds` - sync rounds and barriers waiting for workers, and who stalls them.
* :mod:`.server` - a server process; :mod:`.client` - a worker's KV client.
* :mod:`.communicator`, :mod:`.async_communicator`, :mod:`.geo` - what a training step sends in
  sync, async and GEO mode; :func:`make_communicator` picks one.
* :mod:`.checkpoint` - what a save holds and what a load accepts (atomic and verified through
  :mod:`fleetx.checkpoint`).

Nothing here imports torch; :mod:`fleetx.ps.layout` and :mod:`fleetx.nn` adapt torch models,
and :mod:`fleetx.ps.runtime` is what the fleet's runtime calls and optimizer steps do.
See ``docs/parameter_server.md``.
"""
from fleetx.ps.api import (AuthError, CommunicatorConfig, ConfigError, DenseTableSpec, InitConfig,
                           Mode, PeerLostError, ProtocolError, PSConfig, PSError, PSTimeoutError,
                           RemoteError, RequestError, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.client import KVClient, PullResult, SparseRows
from fleetx.ps.communicator import Communicator
from fleetx.ps.server import PSServer, run_server
from fleetx.ps.worker import make_communicator

__all__ = [
    "AuthError", "CommunicatorConfig", "ConfigError", "DenseTableSpec", "InitConfig", "Mode",
    "PeerLostError", "ProtocolError", "PSConfig", "PSError", "PSTimeoutError", "RemoteError",
    "RequestError", "RuleConfig", "SparseTableSpec", "Tables", "KVClient", "PullResult", "SparseRows",
    "Communicator", "PSServer", "run_server", "make_communicator",
]
