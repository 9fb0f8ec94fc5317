"""The shared-secret handshake every parameter-server connection starts with.

Mutual HMAC challenge-response (SHA-256), before a single frame is exchanged::

    server -> client  CHALLENGE  b"FXPA", version, 3 zero bytes, server nonce (32 random bytes)
    client -> server  RESPONSE   client nonce (32), HMAC(secret, "client" | sn | cn)
    server -> client  VERDICT    OK + HMAC(secret, "server" | cn | sn), or REJECTED, or BUSY

Fresh nonces on both sides make every transcript single-use: a recorded answer is worthless
against the next challenge, and the server's proof tells the client it reached a process that
holds the secret (not a stranger who took the port). The labels keep a proof of one direction
from being reflected as the other. The secret never travels and no message or log line
contains it or a digest of it.

Without a secret both sides use the empty key: the handshake still runs (one code path), but
anyone who can reach the port passes it, so servers allow that only on loopback addresses.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from typing import Optional

from fleetx.ps import local as local_links
from fleetx.ps.api import AuthError, PSConfigError, PSConfig, PSTimeoutError

__all__ = ["CHALLENGE", "RESPONSE_BYTES", "OK", "REJECTED", "BUSY", "VERDICT_OK_BYTES",
           "resolve_secret", "require_secret", "Challenge", "client_handshake", "is_loopback",
           "SECRET_VARIABLES", "connect"]

log = logging.getLogger("fleetx.ps")

AUTH_MAGIC = b"FXPA"
AUTH_VERSION = 1
NONCE_BYTES = 32
#: magic(4s) version(B) 3 zero bytes, server nonce(32s)
CHALLENGE = struct.Struct("<4sB3x32s")
RESPONSE_BYTES = NONCE_BYTES + hashlib.sha256().digest_size
OK, REJECTED, BUSY = b"\x00", b"\x01", b"\x02"
VERDICT_OK_BYTES = 1 + hashlib.sha256().digest_size
SECRET_VARIABLES = "FLEETX_PS_SECRET or FLEETX_PS_SECRET_FILE"
_HOW = ("every process of a job needs the same secret: fleetrun makes one per job; on several "
        f"nodes give each fleetrun the same --ps_secret_file, or set {SECRET_VARIABLES}")

_HANDSHAKE_TIMEOUT = 30.0
_warned = threading.Event()


def resolve_secret(config: PSConfig) -> Optional[bytes]:
    """The key both sides use: ``config.secret``, else the content of ``config.secret_file``
    (surrounding whitespace removed), else None.

    Raises:
        PSConfigError: both are set, or the secret file cannot be read or is empty (the message
            names the file, never its content).
    """
    if config.secret and config.secret_file:
        raise PSConfigError("both FLEETX_PS_SECRET and FLEETX_PS_SECRET_FILE are set; set one")
    if config.secret:
        return config.secret.encode()
    if not config.secret_file:
        return None
    try:
        with open(config.secret_file, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise PSConfigError(f"FLEETX_PS_SECRET_FILE={config.secret_file}: cannot read the "
                          f"secret ({e.strerror})") from None
    if not key:
        raise PSConfigError(f"FLEETX_PS_SECRET_FILE={config.secret_file}: the file is empty")
    return key


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                               for a in addrs)


def require_secret(config: PSConfig, host: str, who: str) -> bytes:
    """The key a server listening on ``host`` uses (the empty key when none is set).

    Raises:
        PSConfigError: no secret is set and ``host`` is not a loopback address (anyone on the
            network could then take over the job), or the secret file is unreadable.
    """
    key = resolve_secret(config)
    if key is not None:
        return key
    if not is_loopback(host):
        raise PSConfigError(f"{who}: refusing to listen on {host}, which is not a loopback "
                          f"address, without a shared secret: set {SECRET_VARIABLES} "
                          "(fleetrun sets one per job; give every node's fleetrun the same "
                          "--ps_secret_file)")
    if not _warned.is_set():
        _warned.set()
        log.warning("%s: no shared secret (%s): any process on this machine may connect; "
                    "fleetrun sets one per job", who, SECRET_VARIABLES)
    return b""


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, b"fleetx-ps-auth-v1 " + label + first + second,
                    hashlib.sha256).digest()


class Challenge:
    """The server side of one handshake: a fresh nonce and the check of the answer."""

    __slots__ = ("nonce", "_key")

    def __init__(self, key: bytes) -> None:
        self.nonce, self._key = os.urandom(NONCE_BYTES), key

    def message(self) -> bytes:
        return CHALLENGE.pack(AUTH_MAGIC, AUTH_VERSION, self.nonce)

    def verdict(self, response: bytes) -> Optional[bytes]:
        """The OK verdict (with the server's proof) for a valid response, else None."""
        if len(response) != RESPONSE_BYTES:
            return None
        client_nonce, proof = response[:NONCE_BYTES], response[NONCE_BYTES:]
        if not hmac.compare_digest(proof, _mac(self._key, b"client", self.nonce, client_nonce)):
            return None
        return OK + _mac(self._key, b"server", client_nonce, self.nonce)


class Retry(ConnectionError):
    """The server closed the handshake without a verdict or said BUSY: try again later."""


def _recv_exact(sock: socket.socket, n: int, deadline: float, name: str) -> bytes:
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Retry(f"{name}: no complete handshake within the deadline")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except socket.timeout:
            continue
        if not chunk:
            raise Retry(f"{name}: closed the connection during the handshake")
        data += chunk
    return bytes(data)


def client_handshake(sock: socket.socket, key: bytes, name: str, timeout: float) -> None:
    """Prove to the server that this side holds ``key`` and check that the server does too.

    Raises:
        AuthError: the server rejected the secret, or did not prove it holds it, or does not
            speak this protocol (names ``name``; never the secret).
        Retry: the server was busy or closed the connection first (try again).
        OSError: the connection failed.
    """
    deadline = time.monotonic() + timeout
    magic, version, server_nonce = CHALLENGE.unpack(
        _recv_exact(sock, CHALLENGE.size, deadline, name))
    if magic != AUTH_MAGIC or version != AUTH_VERSION:
        raise AuthError(f"{name} is not a fleetx parameter server of this version (its "
                        f"greeting starts with {magic!r}, version {version})")
    client_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _mac(key, b"client", server_nonce, client_nonce))
    verdict = _recv_exact(sock, 1, deadline, name)
    if verdict == REJECTED:
        raise AuthError(f"{name} rejected this process's secret: {_HOW}")
    if verdict == BUSY:
        raise Retry(f"{name} has no room for another connection")
    proof = _recv_exact(sock, VERDICT_OK_BYTES - 1, deadline, name) if verdict == OK else b""
    if not hmac.compare_digest(proof, _mac(key, b"server", client_nonce, server_nonce)):
        raise AuthError(f"{name} did not prove that it holds the job's secret (another "
                        f"program on that port, or another job's server): {_HOW}")


def connect(host: str, port: int, name: str, timeout: float, key: bytes = b"",
            local: bool = False) -> socket.socket:
    """Connect and pass the handshake, retrying while the peer is not listening yet (servers
    may start later than workers) or is busy. ``local``: when ``host`` is this machine, each
    try goes to the server's same-machine socket first (:mod:`fleetx.ps.local`), then to TCP.

    Raises:
        PSTimeoutError: no connection within ``timeout`` seconds; the message names ``name``.
        AuthError: the server rejected this process's secret or did not prove it holds it.
    """
    deadline, delay, last = time.monotonic() + timeout, 0.05, None
    here = local and local_links.is_local_host(host)
    while True:
        left = max(0.1, deadline - time.monotonic())
        try:
            sock = (local_links.connect_unix(host, port, min(10.0, left)) if here else None) or \
                socket.create_connection((host, port), timeout=min(10.0, left))
            try:
                client_handshake(sock, key, name, min(_HANDSHAKE_TIMEOUT, left))
            except BaseException:
                sock.close()
                raise
            return sock
        except AuthError:
            raise
        except (OSError, Retry) as e:
            last = e
        if time.monotonic() + delay > deadline:
            raise PSTimeoutError(f"{name} is not reachable at {host}:{port} after {timeout:.0f} s "
                                 f"({last})")
        time.sleep(delay)
        delay = min(1.0, delay * 2)
