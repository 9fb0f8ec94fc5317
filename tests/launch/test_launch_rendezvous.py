"""fleetrun's node-level rendezvous, in one process: two static nodes on loopback addresses meet;
a missing node is named at the timeout; node 0's store refuses a taken port in one sentence."""
import socket
import threading

import pytest

from fleetx.launch.api import LaunchError
from fleetx.launch.rendezvous import StaticRendezvous, serve


def test_two_nodes_meet_on_node0s_store():
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    addrs = ("127.0.0.2", "127.0.0.1")
    node0 = StaticRendezvous(0, addrs, "127.0.0.2", port, timeout=30, say=print)
    results = {}
    joiner = threading.Thread(target=lambda: results.setdefault(
        1, StaticRendezvous(1, addrs, "127.0.0.2", port, timeout=30, say=print).next_rendezvous()))
    joiner.start()
    results[0] = node0.next_rendezvous()
    joiner.join(30)
    assert [(results[n].rank, results[n].world_size) for n in (0, 1)] == [(0, 2), (1, 2)]
    info = results[1].bootstrap_store_info
    assert (info.master_addr, info.master_port) == ("127.0.0.2", port)
    results[0].store.set("k", "v")
    assert results[1].store.get("k") == b"v"
    assert node0.next_rendezvous().rank == 0  # a restart finds every node still there


def test_a_node_that_does_not_come_is_named_at_the_timeout():
    node0 = StaticRendezvous(0, ("127.0.0.1", "127.0.0.2", "127.0.0.3"), "127.0.0.1", 0,
                             timeout=1, say=print)
    with pytest.raises(LaunchError, match=r"^node\(s\) 127\.0\.0\.2, 127\.0\.0\.3 did not join "
                                          r"the rendezvous at 127\.0\.0\.1:0 within 1 s "
                                          r"\(FLEETX_TIMEOUT\)"):
        node0.next_rendezvous()


def test_node0_refuses_a_taken_port_or_an_address_not_its_own():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError) as exc:
            StaticRendezvous(0, ("127.0.0.1",), "127.0.0.1", port, timeout=5)
    assert str(exc.value) == (f"cannot serve the rendezvous store at 127.0.0.1:{port}: port "
                              f"{port} is already in use on 127.0.0.1; choose a free one with "
                              f"--master HOST:PORT (the same on every node)")
    with pytest.raises(LaunchError, match="192.0.2.123 is not an address of this node"):
        serve("192.0.2.123", 6070, "")
