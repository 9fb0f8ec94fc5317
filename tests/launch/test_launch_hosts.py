"""Address ownership by bind test; node rank from --ips / --host; free ports; the interface that
holds an address."""
import socket
import sys

import pytest

from fleetx.launch import ConfigError
from fleetx.launch import hosts


def test_local_addresses():
    assert hosts.is_local_address("127.0.0.1")
    assert not hosts.is_local_address("192.0.2.123")  # TEST-NET-1, never assigned
    assert not hosts.is_local_address("no-such-host.invalid")


def test_node_rank():
    assert hosts.node_rank(["10.0.0.9"]) == 0  # one node: no probing
    assert hosts.node_rank(["a", "b"], is_local=lambda ip: ip == "b") == 1
    assert hosts.node_rank(["a", "b"], host="a", is_local=lambda ip: True) == 0
    with pytest.raises(ConfigError, match="argument --host: c is not one of --ips"):
        hosts.node_rank(["a", "b"], host="c")


def test_free_ports_are_distinct():
    ports = hosts.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces are found on Linux")
def test_interface_of_an_address():
    loopback = {name for _, name in socket.if_nameindex() if name.startswith("lo")}
    assert hosts.interface_of("127.0.0.1") in loopback
    assert hosts.interface_of("localhost") in loopback
    assert hosts.interface_of("192.0.2.123") is None or hosts.is_local_address("192.0.2.123")
    assert hosts.interface_of("no-such-host.invalid") is None


def test_ipv6_interfaces_from_the_kernel_table(tmp_path):
    table = tmp_path / "if_inet6"
    table.write_text("fd000000000000000000000000000002 04 40 00 82     eth0\n"
                     "00000000000000000000000000000001 01 80 10 80       lo\n")
    assert hosts._ipv6_interfaces(str(table)) == {"fd00::2": "eth0", "::1": "lo"}
    assert hosts._ipv6_interfaces(str(tmp_path / "missing")) == {}


def test_listen_binds_the_given_address_only_and_port_in_use_says_why():
    with hosts.listen("127.0.0.2", 0) as sock:
        port = sock.getsockname()[1]
        assert sock.getsockname()[0] == "127.0.0.2"
        assert hosts.port_in_use("127.0.0.2", port) == "Address already in use"
        assert hosts.port_in_use("127.0.0.1", port) is None  # another address, another socket
    assert hosts.port_in_use("127.0.0.2", port) is None
    assert hosts.port_in_use("192.0.2.123", port) == "Cannot assign requested address"
