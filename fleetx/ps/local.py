"""Same-machine links: a Unix-domain socket beside a server's TCP port.

A worker whose server runs on the same machine (the server's endpoint is a loopback address or
an address of one of this machine's interfaces) connects through a Unix-domain socket instead
of TCP. The handshake, the frames and every limit are the same; what goes away is the TCP/IP
processing of every segment on both sides (and the loopback interface's soft interrupts, which
land on whichever thread happens to run), so a megabyte costs less CPU than over loopback TCP
(no benchmark in ``benchmarks/`` measures by how much). Production jobs that put a server and
its trainers on one node get the same saving for their local links.

Where: ``<temp dir>/fleetx-ps-<uid>/<host>-<port>.sock``, named after the address the server
listens on as well as its port: two servers of one machine may listen on the same port at two
addresses (two network namespaces sharing a file system, or two interfaces), and each must keep
its own socket. The directory must be a real directory (not a link) owned by this user and
closed to everyone else (mode 0700; it is created so): other users cannot connect at all (TCP
loopback is open to every local user) and nobody else can put a socket there. A server binds
its TCP address and port first, which no other process can hold at the same time, so the socket
of an address and port is always that server's; a file left by a server that died is replaced.
If the directory is unsafe, the path too long, or the socket cannot be made, the server listens
on TCP alone (its log says which check failed) and its workers use TCP (they also fall back to
TCP whenever the socket refuses them). ``FLEETX_PS_LOCAL_SOCKETS=0`` turns the path off
(``PSConfig.local_sockets``).

Example:
    >>> path = socket_path("127.0.0.1", 6170)     # doctest: +SKIP
    >>> path.endswith("/127.0.0.1-6170.sock")     # doctest: +SKIP
    True
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import socket
import stat
import tempfile
from typing import Optional

__all__ = ["socket_dir", "socket_path", "listen", "unlink", "is_local_host", "connect_unix"]

log = logging.getLogger("fleetx.ps")

_MAX_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


def socket_dir(create: bool = True) -> Optional[str]:
    """This user's private directory for the sockets, created (mode 0700) when missing; None
    when it is not safe to use (not a directory, a link, another owner, open to others)."""
    return _socket_dir(create)[0]


def _socket_dir(create: bool) -> tuple[Optional[str], str]:
    """``(directory, "")``, or ``(None, which check failed)``."""
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "geteuid"):
        return None, "this platform has no Unix-domain sockets"
    path = os.path.join(tempfile.gettempdir(), f"fleetx-ps-{os.geteuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            return None, f"cannot create {path} ({e.strerror})"
    try:
        st = os.lstat(path)
    except OSError as e:
        return None, f"cannot examine {path} ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return None, f"{path} is a symbolic link, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return None, f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return None, f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if st.st_mode & 0o077:
        return None, (f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, open to other users "
                      "(expected 0700)")
    return path, ""


def socket_path(host: str, port: int, create: bool = True) -> Optional[str]:
    """Where the server of TCP ``host:port`` on this machine listens locally (None: nowhere
    safe)."""
    return _socket_path(host, port, create)[0]


def _socket_path(host: str, port: int, create: bool) -> tuple[Optional[str], str]:
    """``(path, "")``, or ``(None, which check failed)``."""
    folder, problem = _socket_dir(create)
    if folder is None:
        return None, problem
    name = re.sub(r"[^A-Za-z0-9.:-]", "_", str(host)) or "_"
    path = os.path.join(folder, f"{name}-{int(port)}.sock")
    if len(path.encode()) > _MAX_PATH:
        return None, (f"the path {path} is {len(path.encode())} bytes, longer than a socket's "
                      f"{_MAX_PATH}")
    return path, ""


def listen(host: str, port: int, backlog: int) -> Optional[socket.socket]:
    """A non-blocking Unix-domain socket listening for the server of TCP ``host:port`` (which
    the caller has bound already), or None when none can be made (logged, naming the check
    that failed)."""
    path, problem = _socket_path(host, port, True)
    if path is None:
        log.info("port %d: no same-machine socket: %s; TCP only", port, problem)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        unlink(path)  # left by an earlier server of this address: ours now (we hold it)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        log.info("port %d: cannot listen on %s (%s); TCP only", port, path, e.strerror)
        return None
    sock.setblocking(False)
    return sock


def unlink(path: Optional[str]) -> None:
    """Remove a socket file (nothing if it is gone; never anything but a socket)."""
    if not path:
        return
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine: a loopback address, or an address one of its
    interfaces holds (a socket can be bound to it)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        ip = addr[0].split("%")[0]
        if ipaddress.ip_address(ip).is_loopback:
            continue
        probe = socket.socket(family, socket.SOCK_DGRAM)
        try:
            probe.bind((addr[0], 0) if family == socket.AF_INET else addr[:1] + (0,) + addr[2:])
        except OSError:
            return False
        finally:
            probe.close()
    return bool(infos)


def connect_unix(host: str, port: int, timeout: float) -> Optional[socket.socket]:
    """A connected Unix-domain socket to the local server of ``host:port``, or None when there
    is none (no socket file, nobody listening, an unsafe folder)."""
    path = socket_path(host, port, create=False)
    if path is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EACCES, errno.EAGAIN):
            log.debug("local socket %s: %s", path, e)
        return None
    return sock
