"""The parameter server: tables of rows on server processes, updated by rules, fed by workers.

Layers, bottom up: a module imports only modules of its own layer and of the layers listed
before it (a test of the import graph checks it):

* :mod:`.errors`, :mod:`.wire`, :mod:`.specs`, :mod:`.config`, :mod:`.api` - the contract: wire
  format, message kinds, table/rule/cluster specs, errors, written in the first four and taken
  from :mod:`.api` by every other module.
* :mod:`.kernels`, :mod:`.partition` - the hot loops (C :mod:`._kernels` when built, else
  numpy), and the one id -> shard -> server function with dense slicing.
* :mod:`.storage`, :mod:`.index`, :mod:`.changes` - row arrays that grow in place, the id -> row
  index of a sparse table, and what changed since its last save.
* :mod:`.initializers`, :mod:`.rules`, :mod:`.growth`, :mod:`.table` - rows plus a rule:
  per-id initial rows, update rules, admission and shrink, the tables.
* :mod:`.local`, :mod:`.handshake`, :mod:`.buffers`, :mod:`.transport`, :mod:`.links`,
  :mod:`.acceptor`, :mod:`.transport_zmq` - connections: same-machine sockets, the
  shared-secret handshake, framed links (heartbeats, liveness, frame limits, queued replies),
  a service's links, a server's accept loop, and the ZeroMQ transport measured against them.
* :mod:`.latency`, :mod:`.tracker`, :mod:`.failover` - request ids, the handles
  ``push``/``pull`` return, their latency, and a worker's side of server failover.
* :mod:`.requests`, :mod:`.readonly`, :mod:`.rounds`, :mod:`.roster` - every request's fields
  checked against the tables before they change, the requests refused in inference, sync
  rounds and barriers, and the workers a server expects.
* :mod:`.chain`, :mod:`.checkpoint`, :mod:`.snapshots` - what a save holds and what a load
  accepts (atomic and verified through :mod:`fleetx.checkpoint`), and a server's own
  snapshots for failover.
* :mod:`.shard`, :mod:`.shard_requests` - one server's slice of every table, and the requests
  it answers from that slice alone.
* :mod:`.client`, :mod:`.server`, :mod:`.__main__` - a worker's KV client; a server process,
  and the command line that runs one.

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
