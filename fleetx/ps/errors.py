"""The parameter server's errors: one base class, :class:`PSError`, and one subclass per way a
request, a peer or a setting can fail.

Their public home is :mod:`fleetx.ps.api`, the package's contract: users and the other modules
import them from there, and a traceback names them there (``fleetx.ps.api.StateError: ...``),
so the module they are written in stays an implementation detail.
"""
from __future__ import annotations

__all__ = [
    "PSError", "PSConfigError", "ConfigError", "ProtocolError", "PeerLostError", "RemoteError",
    "PSTimeoutError", "AuthError", "StateError", "RequestError", "require",
]


class PSError(RuntimeError):
    """Base class of every parameter-server failure."""


class PSConfigError(PSError, ValueError):
    """A table, rule or cluster setting is invalid; the message names the field."""


# The name ``fleetx.ps`` exported before ``fleetx.launch.ConfigError`` (a bad fleetrun flag)
# made it ambiguous; kept so that scripts catching ``fleetx.ps.ConfigError`` go on working.
ConfigError = PSConfigError


class ProtocolError(PSError):
    """A frame is malformed, of another wire version, or a reply does not match its request."""


class PeerLostError(PSError):
    """A server or worker died, closed its connection or stopped sending heartbeats.

    Attributes:
        peer: who was lost, e.g. ``"server 1 (10.0.0.2:6001)"`` or ``"worker 3 (pid 41 on h)"``.
    """

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer} lost: {reason}")
        self.peer = peer
        self.reason = reason


class RemoteError(PSError):
    """The peer failed while handling a request; ``remote_type`` is its error class name."""

    def __init__(self, peer: str, remote_type: str, message: str) -> None:
        super().__init__(f"{peer} failed: {remote_type}: {message}")
        self.peer = peer
        self.remote_type = remote_type


class PSTimeoutError(PSError, TimeoutError):
    """A bounded wait (connect, registration, an explicit timeout) ran out."""


class AuthError(PSError):
    """A connection failed the shared-secret handshake: the peer does not hold the job's secret
    (or holds another one), or it is not a fleetx parameter server at all. The message names the
    endpoint; it never contains a secret or a digest of one."""


class StateError(PSError):
    """A call out of order or on the wrong role (training before ``init_worker``, serving on
    a worker); the message says what to call first."""


class RequestError(PSError, ValueError):
    """A server refused a request: a field is malformed or out of range (a shape that does not
    match its table, an unknown table, a non-finite value, a learning rate out of range, a
    path outside the save root, a table that would exceed its row limit). The message names
    the request kind, the table or field, and what was expected; the tables are unchanged."""



def require(cond: bool, message: str) -> None:
    """Raise :class:`PSConfigError` with ``message`` unless ``cond`` holds (the specs' checks).

    Raises:
        PSConfigError: ``cond`` is false.
    """
    if not cond:
        raise PSConfigError(message)


for _cls in (PSError, PSConfigError, ProtocolError, PeerLostError, RemoteError, PSTimeoutError,
             AuthError, StateError, RequestError):
    _cls.__module__ = "fleetx.ps.api"  # the name tracebacks, pickles and doc links use
del _cls
