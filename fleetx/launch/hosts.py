"""Where this node stands: which of the listed node addresses is ours, the network interface
that holds it, and free ports.

An address is this host's exactly when a socket can be bound to it (the kernel refuses
addresses that belong to no local interface), which covers every interface, secondary
addresses and IPv6 without listing interfaces. Hosts that set ``net.ipv4.ip_nonlocal_bind``
defeat the test; pass ``--host`` there.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
import sys
from typing import Callable, Collection, Optional, Sequence

from fleetx.launch.api import ConfigError

__all__ = ["is_local_address", "node_rank", "free_ports", "listen", "port_in_use", "route_address",
           "interface_of", "SOCKET_IFNAME_VARS", "socket_ifnames"]

#: What gloo and NCCL bind to; fleetrun sets them on multi-node jobs unless the user did.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: the IPv4 address of an interface
_IF_INET6 = "/proc/net/if_inet6"


def is_local_address(address: str) -> bool:
    """True if ``address`` (an IP or a host name) is an address of this host."""
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(sockaddr)
                return True
            except OSError:
                continue
    return False


def node_rank(ips: Sequence[str], host: Optional[str] = None,
              is_local: Callable[[str], bool] = is_local_address) -> int:
    """The index of this node in ``ips``.

    A single-node list is always node 0. Otherwise ``host`` decides when given, else the one
    entry of ``ips`` that is an address of this host.

    Raises:
        ConfigError: ``host`` is not in ``ips``, or not exactly one entry is local.
    """
    if host is not None:
        if host not in ips:
            raise ConfigError("--host", f"{host} is not one of --ips ({','.join(ips)})")
        return list(ips).index(host)
    if len(ips) == 1:
        return 0
    mine = [i for i, ip in enumerate(ips) if is_local(ip)]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        raise ConfigError("--ips", f"none of {','.join(ips)} is an address of this host; "
                                   f"list this node's address or pass --host")
    raise ConfigError("--ips", f"{', '.join(ips[i] for i in mine)} are all addresses of this "
                               f"host; pass --host to say which node this is")


def free_ports(count: int, host: str = "") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago (held together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def listen(address: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``address:port`` only (not on every interface).

    ``SO_REUSEADDR`` is set, as servers do, so a port whose last connection is in TIME_WAIT can be
    taken again, while a port some process listens on cannot.

    Raises:
        OSError: the port is in use on that address (``EADDRINUSE``), or the address is not one
            of this host's (``EADDRNOTAVAIL``), or it does not resolve.
    """
    error: OSError = OSError(f"{address} does not resolve")
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"{address} does not resolve: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(backlog)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


def port_in_use(address: str, port: int) -> Optional[str]:
    """Why a server could not listen on ``address:port`` right now (None: it could)."""
    try:
        listen(address, port, backlog=1).close()
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def route_address(peer: str) -> str:
    """The local address this host would use to reach ``peer`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((peer, 9))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _ipv4_interfaces() -> dict[str, str]:
    """{IPv4 address: interface name}, one (primary) address per interface."""
    import fcntl  # POSIX only; interface_of asks on Linux alone

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])  # struct ifreq: name, then address
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # the interface has no IPv4 address
                continue
            found.setdefault(socket.inet_ntoa(reply[20:24]), name)  # sockaddr_in's sin_addr
    return found


def _ipv6_interfaces(table: str = _IF_INET6) -> dict[str, str]:
    """{IPv6 address: interface name}, from the kernel's table (every address)."""
    found = {}
    try:
        with open(table) as f:
            for line in f:
                cols = line.split()  # address, index, prefix length, scope, flags, name
                if len(cols) == 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(cols[0])))] = cols[5]
    except OSError:  # no IPv6 on this host
        pass
    return found


def interface_of(address: str) -> Optional[str]:
    """The name of the network interface that holds ``address`` (an IP or a host name), or None.

    On Linux: an IPv4 address is found when it is an interface's primary address
    (``SIOCGIFADDR``), an IPv6 address always (``/proc/net/if_inet6``). Elsewhere: None.

    Example:
        >>> interface_of("127.0.0.1")
        'lo'
    """
    if not sys.platform.startswith("linux"):  # the ioctl number and /proc are Linux's
        return None
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    # A link-local IPv6 sockaddr carries its scope ("fe80::1%eth0"); the table has none.
    candidates = [str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos]
    table = {**_ipv4_interfaces(), **_ipv6_interfaces()}
    return next((table[ip] for ip in candidates if ip in table), None)


def socket_ifnames(addresses: Sequence[str], user_set: Collection[str] = (),
                   interface_of: Callable[[str], Optional[str]] = interface_of,
                   where: str = "of {address} (the interface of that address)"
                   ) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The socket interface variables for processes bound to ``addresses`` (this node's), and
    one note per address for the user.

    Each address gets ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (those not in
    ``user_set``) naming the interface that holds it: gloo and NCCL otherwise bind to the
    address the host name resolves to, often a loopback one (Debian's 127.0.1.1). An address
    whose interface is unknown gets nothing.

    Args:
        where: which processes a note speaks of, after "for each process" (``{address}``
            is replaced by the address).

    Example:
        >>> socket_ifnames(["127.0.0.1"], interface_of=lambda a: "lo")[0]
        {'127.0.0.1': {'GLOO_SOCKET_IFNAME': 'lo', 'NCCL_SOCKET_IFNAME': 'lo'}}
    """
    wanted = [name for name in SOCKET_IFNAME_VARS if name not in user_set]
    found: dict[str, dict[str, str]] = {}
    notes = []
    for address in dict.fromkeys(addresses) if wanted else ():
        ifname = interface_of(address)
        if not ifname:
            continue
        found[address] = {name: ifname for name in wanted}
        notes.append(f"setting {' and '.join(f'{name}={ifname}' for name in wanted)} for each "
                     f"process {where.format(address=address)}; set "
                     f"{'it' if len(wanted) == 1 else 'them'} yourself to change it")
    return found, notes
