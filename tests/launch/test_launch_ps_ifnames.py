"""The socket interface variables of a parameter-server job (pure planning; the real thing runs
in test_netns_jobs.py): several nodes get the interface of each process's address, as a
collective job does, unless the user set them; a single-node job gets none."""
from __future__ import annotations

import threading
import time

from fleetx.comm import blame
from fleetx.comm.progress import Call
from fleetx.launch import hosts, ps
from fleetx.launch.config import LaunchConfig

_IFACES = {"10.0.0.1": "eth1", "10.0.0.2": "eth2", "127.0.0.1": "lo"}


def _plan(user_ifnames=(), **kw):
    config = LaunchConfig(training_script="train.py", servers=("10.0.0.1:6000",),
                          workers=("10.0.0.1", "10.0.0.2"), **kw)
    return ps.plan(config, is_local=lambda ip: ip == "10.0.0.1", user_secret=True,
                   user_ifnames=user_ifnames, interface_of=_IFACES.get)


def test_a_node_of_a_multi_node_job_sets_both_variables_to_its_interface():
    p = _plan()
    assert [proc.label for proc in p.local] == ["server 0", "worker 0"]
    for proc in p.local:
        assert proc.env["GLOO_SOCKET_IFNAME"] == "eth1"
        assert proc.env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert ("setting GLOO_SOCKET_IFNAME=eth1 and NCCL_SOCKET_IFNAME=eth1 for each process of "
            "10.0.0.1 (the interface of that address); set them yourself to change it") in p.notes
    assert "fleetrun: setting GLOO_SOCKET_IFNAME=eth1" in p.describe()


def test_a_variable_the_user_set_is_left_alone():
    p = _plan(user_ifnames=["NCCL_SOCKET_IFNAME"])
    for proc in p.local:
        assert proc.env["GLOO_SOCKET_IFNAME"] == "eth1"
        assert "NCCL_SOCKET_IFNAME" not in proc.env
    assert any(note.startswith("setting GLOO_SOCKET_IFNAME=eth1 for each process") and
               note.endswith("set it yourself to change it") for note in p.notes)
    p = _plan(user_ifnames=hosts.SOCKET_IFNAME_VARS)
    assert all("GLOO_SOCKET_IFNAME" not in proc.env for proc in p.local)
    assert not any("SOCKET_IFNAME" in note for note in p.notes)


def test_a_single_node_job_and_an_unknown_interface_get_nothing():
    config = LaunchConfig(training_script="train.py", server_num=1, worker_num=2)
    ports = iter(range(7000, 7100))
    p = ps.plan(config, free_ports=lambda n: [next(ports) for _ in range(n)],
                interface_of=_IFACES.get)
    assert all("GLOO_SOCKET_IFNAME" not in proc.env for proc in p.local)
    found, notes = hosts.socket_ifnames(["10.9.9.9"], interface_of=_IFACES.get)
    assert found == {} and notes == []


class _SilentStore:
    """A store on a node this rank cannot reach any more: every read blocks."""

    def __init__(self):
        self.release = threading.Event()

    def check(self, keys):
        self.release.wait()
        return False


def test_a_rank_cut_off_from_the_store_blames_its_peers_without_hanging(monkeypatch):
    store = _SilentStore()
    began = time.monotonic()
    records, answered = blame._read_records(store, [0, 2], wait=0.3)
    assert time.monotonic() - began < 2 and not answered and records == {}
    store.release.set()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "6070")
    found = blame._unreachable(Call("all_reduce", "0", 9), [0, 1, 2], [0, 2], 1, 8.0, 3.0)
    assert found.ranks == (0, 2) and found.reporter == 1
    assert found.message == ("ranks 0, 2 did not arrive at all_reduce #9 on group 0 (ranks "
                             "[0, 1, 2]) within 8 s, and the job's store at 10.0.0.1:6070 did "
                             "not answer for 3 s: the network to that node is down or the node "
                             "is gone")
