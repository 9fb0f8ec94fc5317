"""The parameter server: tables of rows on server processes, updated by rules, fed by workers.

Layers, bottom up (each imports only the ones below it and the contract in :mod:`.api`):

* :mod:`.api` - the contract: wire format, message kinds, table/rule/cluster specs, errors,
  written in :mod:`.wire`, :mod:`.errors`, :mod:`.specs` and :mod:`.config` and taken from
  :mod:`.api` by every other module.
* :mod:`.handshake` - the shared-secret handshake every connection starts with, and connect.
* :mod:`.transport` - framed links: heartbeats, liveness, frame limits, queued replies.
* :mod:`.acceptor` - a server's accept loop: handshakes without a thread each, connection caps.
* :mod:`.tracker` - request ids and the handles ``push``/``pull`` return.
* :mod:`.partition` - the one id -> shard -> server function, and dense slicing.
* :mod:`.table`, :mod:`.rules`, :mod:`.kernels`, :mod:`.initializers` - rows plus a rule.
* :mod:`.requests` - every request's fields checked against the tables before they change.
* :mod:`.rounds` - sync rounds and barriers waiting for workers, and who stalls them.
* :mod:`.readonly` - which requests change a table, refused in inference.
* :mod:`.server` - a server process; :mod:`.client` - a worker's KV client.
* :mod:`.checkpoint` - what a save holds and what a load accepts (atomic and verified through
  :mod:`fleetx.checkpoint`).

This package is the server-side core (the ps-lite shape) and nothing here imports torch or any
other fleetx package but :mod:`fleetx.env` and :mod:`fleetx.checkpoint`. What a training step
sends (the communicators) and how a torch model is split into tables live in the adapter,
:mod:`fleetx.ps_torch`, which imports this package and never the other way round.
See ``docs/parameter_server.md``.
"""
from fleetx.ps.api import (AuthError, CommunicatorConfig, ConfigError, DenseTableSpec, InitConfig,
                           Mode, PeerLostError, ProtocolError, PSConfig, PSConfigError, PSError,
                           PSMode, PSTimeoutError, RemoteError, RequestError, RuleConfig,
                           SparseTableSpec, Tables)
from fleetx.ps.client import KVClient, PullResult, SparseRows
from fleetx.ps.server import PSServer, run_server

__all__ = [
    "AuthError", "CommunicatorConfig", "PSConfigError", "ConfigError", "DenseTableSpec",
    "InitConfig", "Mode", "PSMode", "PeerLostError", "ProtocolError", "PSConfig", "PSError",
    "PSTimeoutError", "RemoteError", "RequestError", "RuleConfig", "SparseTableSpec", "Tables",
    "KVClient", "PullResult", "SparseRows", "PSServer", "run_server",
]
