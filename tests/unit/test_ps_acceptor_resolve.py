"""A server whose endpoint is its own DNS name (a Kubernetes pod's) waits, bounded, for the name
to resolve before it listens, instead of failing at once."""
import socket

import pytest

from fleetx.ps.acceptor import Acceptor
from fleetx.ps.api import PeerLostError


def _acceptor(host, wait):
    return Acceptor(host, 0, b"", "server 0", lambda: True, lambda sock, peer: None,
                    resolve_wait=wait)


def test_a_name_that_resolves_late_is_waited_for(monkeypatch):
    bind, failures = socket.socket.bind, []

    def late(self, address):
        if address[0] == "pod-0.svc" and len(failures) < 2:  # unknown twice, then known
            failures.append(address)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return bind(self, ("127.0.0.1", address[1]))
    monkeypatch.setattr(socket.socket, "bind", late)
    acc = _acceptor("pod-0.svc", 10)
    try:
        assert len(failures) == 2 and acc.port > 0
    finally:
        acc.close()


def test_a_name_that_never_resolves_fails_naming_it_after_the_wait():
    with pytest.raises(PeerLostError, match=r"'no-such-host\.invalid' did not resolve within "
                                            r"1 s"):
        _acceptor("no-such-host.invalid", 1)


def test_without_a_wait_it_fails_at_once():
    with pytest.raises(PeerLostError, match="cannot listen"):
        _acceptor("no-such-host.invalid", 0)
