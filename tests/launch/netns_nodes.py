"""Two "machines" on one host: network namespaces joined by a veth pair (needs root and
iproute2's ``ip``).

:func:`two_nodes` builds them with names unique to the test (so concurrent runs never meet) and
always takes them down: it first kills whatever still runs in them (a process left in a
namespace would keep it alive after ``ip netns del``), then deletes them, which deletes the veth
pair. Without root or ``ip`` the test is skipped, or fails under ``CI=true``.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass

import pytest

__all__ = ["Node", "two_nodes", "ip", "pids", "kill_pids"]


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its end of the veth pair and that end's address."""

    ns: str
    link: str
    addr: str

    def __iter__(self):  # unpacks as (ns, link, addr), as the tests of test_fleetrun.py do
        return iter((self.ns, self.link, self.addr))

    def exec(self, *cmd) -> list[str]:
        """``cmd`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *[str(c) for c in cmd]]

    def link_down(self) -> None:
        """Take this end of the pair down: no packet crosses any more, in either direction."""
        ip("-n", self.ns, "link", "set", self.link, "down")


def ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def pids(ns: str) -> list[int]:
    """The processes running in namespace ``ns`` (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in out.stdout.split()]


def kill_pids(found: list[int]) -> None:
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove(names: list[str]) -> None:
    for ns in names:
        for _ in range(50):  # a killed process leaves the namespace when it is reaped
            left = pids(ns)
            if not left:
                break
            kill_pids(left)
            time.sleep(0.1)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _require() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        why = "needs root and iproute2's ip for network namespaces"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the two-node tests: it {why} (scripts/setup.sh)")
        pytest.skip(why)


@pytest.fixture
def two_nodes(request):
    """Two network namespaces, 10.233.<n>.1 and .2 on a veth pair: a list of two :class:`Node`."""
    _require()
    tag = uuid.uuid4().hex[:8]  # interface names have at most 15 characters
    names, links = [f"fxa{tag}", f"fxb{tag}"], [f"fxva{tag}", f"fxvb{tag}"]
    net = 10 + int(tag, 16) % 240
    addrs = [f"10.233.{net}.1", f"10.233.{net}.2"]
    request.addfinalizer(lambda: _remove(names))  # whatever happens below or in the test
    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs):
            ip("link", "set", link, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            ip("-n", ns, "link", "set", link, "up")
            ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True, timeout=30)
        pytest.fail(f"cannot build network namespaces here: {exc.stderr!r}")
    return [Node(*args) for args in zip(names, links, addrs)]
