"""The parameter-server contract: wire format, message kinds, table and rule specs, cluster
settings, errors.

This is the one module the rest of :mod:`fleetx.ps` (and :mod:`fleetx.ps_torch`,
:mod:`fleetx.nn`, users' scripts) imports the shared vocabulary from. It defines nothing
itself: the vocabulary is written in four small modules beneath it, which import only one
another (and :mod:`fleetx.env`) and which no other module imports directly:

* :mod:`fleetx.ps.wire` - the frame layout (``HEADER``, ``DESCRIPTOR``, flags, limits),
  :class:`Kind`, the dtype codes, :class:`Message` and its encoding and checks;
* :mod:`fleetx.ps.errors` - :class:`PSError` and its subclasses (their names read
  ``fleetx.ps.api.*`` in tracebacks);
* :mod:`fleetx.ps.specs` - :class:`RuleConfig`, :class:`InitConfig`, the admission entries,
  :class:`AccessorConfig`, :class:`SparseTableSpec`, :class:`DenseTableSpec`, :class:`Tables`;
* :mod:`fleetx.ps.config` - :class:`PSMode`, :class:`PSConfig`, :class:`CommunicatorConfig`,
  and :func:`settings_from_env`, where servers and workers read the parameter-server variables
  (the launcher only asks whether a secret is set, to make one when none is).

For everything else the modules of the package import one another in the layer order that
:mod:`fleetx.ps` describes. The byte-level wire format is specified in
``docs/parameter_server.md``; nothing on the wire is pickled.
"""
from __future__ import annotations

from fleetx.ps.config import (NONFINITE, TRANSPORTS, CommunicatorConfig, Mode, PSConfig, PSMode,
                              PSSettings, endpoint_of, settings_from_env)
from fleetx.ps.errors import (AuthError, ConfigError, PeerLostError, ProtocolError, PSConfigError,
                              PSError, PSTimeoutError, RemoteError, RequestError, StateError)
from fleetx.ps.specs import (DEFAULT_MAX_PENDING, AccessorConfig, CountFilterEntry,
                             DenseTableSpec, InitConfig, ProbabilityEntry, RuleConfig,
                             ShowClickEntry, SparseTableSpec, Tables)
from fleetx.ps.wire import (DEFAULT_MAX_FRAME_BYTES, DESCRIPTOR, DTYPE_CODES, DTYPES, FLAG_ERROR,
                            FLAG_REPLY, HEADER, MAX_BUFFERS, MAX_META_BYTES, WIRE_MAGIC,
                            WIRE_VERSION, Kind, Message, encode_frame, parse_header,
                            read_descriptors)

__all__ = [
    "WIRE_MAGIC", "WIRE_VERSION", "HEADER", "DESCRIPTOR", "FLAG_REPLY", "FLAG_ERROR",
    "MAX_META_BYTES", "MAX_BUFFERS", "Kind", "DTYPES", "DTYPE_CODES", "PSMode",
    "PSError", "PSConfigError", "ConfigError", "ProtocolError", "PeerLostError", "RemoteError",
    "PSTimeoutError",
    "StateError", "AuthError", "RequestError", "NONFINITE", "DEFAULT_MAX_FRAME_BYTES",
    "TRANSPORTS", "RuleConfig", "InitConfig", "CountFilterEntry", "ProbabilityEntry",
    "ShowClickEntry", "AccessorConfig", "DEFAULT_MAX_PENDING", "SparseTableSpec",
    "DenseTableSpec", "Tables", "PSConfig", "CommunicatorConfig",
    "Message", "encode_frame", "parse_header", "read_descriptors", "Mode", "endpoint_of",
    "PSSettings", "settings_from_env",
]
