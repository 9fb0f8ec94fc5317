"""The collective plan: devices, backend, nodes, ports and notes, decided with faked probes."""
import pytest

from fleetx.launch import ConfigError, LaunchConfig
from fleetx.launch.collective import DEFAULT_MASTER_PORT, DRY_RUN_UNSET, dry_run_env, plan


def cfg(**kw):
    return LaunchConfig(training_script="train.py", **kw)


def ports(n):
    return list(range(41000, 41000 + n))


def make(config, **kw):
    kw.setdefault("cuda_count", 0)
    kw.setdefault("free_ports", ports)
    kw.setdefault("is_local", lambda ip: False)
    kw.setdefault("interface_of", lambda addr: None)
    return plan(config, **kw)


def test_single_node_cpu_defaults():
    p = make(cfg())
    assert (p.nproc, p.node_rank, p.min_nodes, p.max_nodes) == (1, 0, 1, 1)
    assert (p.master_addr, p.master_port) == ("127.0.0.1", 41000)
    s = p.setup
    assert (s.backend, s.devices, s.visible_devices, s.omp_threads) == ("gloo", (), None, None)
    assert (s.node_addrs, s.own_addr, s.ports) == (("127.0.0.1",), "127.0.0.1", (41001,))
    assert p.notes == ()
    assert "Run collective mode: node 0 of 1, 1 process(es) per node, backend gloo" in p.describe()
    assert "launch train in CPU mode" in p.describe()


def test_several_processes_get_one_omp_thread_unless_the_user_chose():
    p = make(cfg(nproc_per_node=2))
    assert p.setup.omp_threads == 1 and "OMP_NUM_THREADS=1" in p.notes[0]
    assert make(cfg(nproc_per_node=2), user_omp="4").setup.omp_threads is None


def test_gpus_one_process_each_and_nccl():
    p = make(cfg(gpus="2,3"), cuda_count=4)
    assert (p.nproc, p.setup.devices, p.setup.visible_devices) == (2, ("0", "1"), "2,3")
    assert p.setup.backend == "nccl" and "GPU mode, devices 2,3" in p.describe()
    assert make(cfg(gpus="2,3", backend="gloo"), cuda_count=4).setup.backend == "gloo"


def test_gpus_must_be_in_cuda_visible_devices():
    p = make(cfg(gpus="5"), cuda_count=2, visible=["4", "5"])
    assert p.setup.visible_devices == "5"
    with pytest.raises(ConfigError, match=r"argument --gpus: 6 not in CUDA_VISIBLE_DEVICES=4,5"):
        make(cfg(gpus="6"), cuda_count=2, visible=["4", "5"])


def test_gpus_must_exist_on_the_node():
    with pytest.raises(ConfigError) as info:
        make(cfg(gpus="5,1,7"), cuda_count=2)
    assert str(info.value) == ("argument --gpus: 5,7: no such GPU; this node has 2 CUDA "
                               "device(s), ids 0..1")
    with pytest.raises(ConfigError, match=r"argument --gpus: -1: no such GPU"):
        make(cfg(gpus="-1"), cuda_count=2)
    assert make(cfg(gpus="1,0"), cuda_count=2).setup.visible_devices == "1,0"
    # UUIDs are CUDA's to check; so are ids among CUDA_VISIBLE_DEVICES, whatever the count
    assert make(cfg(gpus="GPU-8e2b"), cuda_count=1).setup.visible_devices == "GPU-8e2b"
    assert make(cfg(gpus="7"), cuda_count=1, visible=["7"]).setup.visible_devices == "7"


def test_gpus_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="argument --gpus: no CUDA device is visible"):
        make(cfg(gpus="0"))


def test_visible_gpus_are_used_when_there_are_enough():
    p = make(cfg(), cuda_count=2)
    assert (p.nproc, p.setup.devices, p.setup.backend) == (2, ("0", "1"), "nccl")
    p = make(cfg(nproc_per_node=4), cuda_count=2)
    assert (p.setup.devices, p.setup.backend) == ((), "gloo")
    assert "4 processes but 2 visible GPU(s): the processes run on CPU" in p.notes


def test_nccl_needs_gpus():
    with pytest.raises(ConfigError, match="argument --backend: nccl needs one GPU per process; "
                                          "this node has 0 visible GPU"):
        make(cfg(backend="nccl"))


def test_multi_node_rank_from_local_addresses():
    p = make(cfg(ips="10.0.0.1,10.0.0.2", nproc_per_node=2), is_local=lambda ip: ip == "10.0.0.2")
    assert (p.node_rank, p.master_addr, p.master_port) == (1, "10.0.0.1", DEFAULT_MASTER_PORT)
    assert p.setup.node_addrs == ("10.0.0.1", "10.0.0.2") and p.setup.own_addr == "10.0.0.2"
    assert p.setup.ports == (DEFAULT_MASTER_PORT + 1, DEFAULT_MASTER_PORT + 2)
    assert make(cfg(ips="a,b", host="a")).node_rank == 0
    assert make(cfg(ips="a,b", host="b", master="a:29500")).setup.ports == (29501,)


def test_multi_node_without_exactly_one_local_address_is_refused():
    with pytest.raises(ConfigError, match="argument --ips: none of a,b is an address of this host"):
        make(cfg(ips="a,b"))
    with pytest.raises(ConfigError, match="argument --ips: a, b are all addresses of this host; "
                                          "pass --host"):
        make(cfg(ips="a,b"), is_local=lambda ip: True)


def test_elastic_job_leaves_ranks_to_the_rendezvous():
    p = make(cfg(nnodes="1:3", master="10.0.0.1:29400", host="10.0.0.7", nproc_per_node=2))
    assert (p.elastic, p.node_rank, p.min_nodes, p.max_nodes) == (True, None, 1, 3)
    assert (p.master_addr, p.master_port) == ("10.0.0.1", 29400)
    assert p.setup.node_addrs == () and p.setup.own_addr == "10.0.0.7"
    assert p.setup.ports == (41001, 41002)
    assert "elastic, 1..3 nodes" in p.describe()


def two_nodes(**kw):
    return cfg(ips="10.0.0.1,10.0.0.2", **kw)


def on_node_1(ip):
    return ip == "10.0.0.2"


def eth1_of_node_1(addr):
    return "eth1" if addr == "10.0.0.2" else None


def test_multi_node_sets_the_socket_interfaces_to_that_of_the_nodes_address():
    p = make(two_nodes(), is_local=on_node_1, interface_of=eth1_of_node_1)
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname) == ("eth1", "eth1")
    assert ("setting GLOO_SOCKET_IFNAME=eth1 and NCCL_SOCKET_IFNAME=eth1 for each process (the "
            "interface of 10.0.0.2, this node's address); set them yourself to change it"
            ) in p.notes
    p = make(cfg(nnodes="2:4", master="10.0.0.1:29400", host="10.0.0.2"),
             interface_of=eth1_of_node_1)
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname) == ("eth1", "eth1")


def test_the_users_socket_interfaces_are_kept():
    p = make(two_nodes(), is_local=on_node_1, interface_of=eth1_of_node_1,
             user_ifnames=["GLOO_SOCKET_IFNAME"])
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname) == (None, "eth1")
    assert ("setting NCCL_SOCKET_IFNAME=eth1 for each process (the interface of 10.0.0.2, this "
            "node's address); set it yourself to change it") in p.notes

    def never(addr):
        raise AssertionError("no interface is needed")
    p = make(two_nodes(), is_local=on_node_1, interface_of=never,
             user_ifnames=["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname, p.notes) == (None, None, ())
    p = make(cfg(), interface_of=never)  # one node: nothing to reach
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname) == (None, None)


def test_no_interface_found_sets_nothing():
    p = make(two_nodes(), is_local=on_node_1)
    assert (p.setup.gloo_ifname, p.setup.nccl_ifname, p.notes) == (None, None, ())


def test_the_rendezvous_timeout_is_part_of_the_plan():
    assert make(cfg()).timeout == 300.0
    assert make(cfg(ips="a,b", host="b"), timeout=8).timeout == 8.0


def test_a_dry_run_serves_no_store_so_torch_init_fails_at_once():
    values = dry_run_env(make(cfg(nproc_per_node=4, ips="a,b"), is_local=lambda ip: ip == "a"))
    assert (values["RANK"], values["WORLD_SIZE"], values["FLEETX_DRY_RUN"]) == ("0", "8", "1")
    assert not set(DRY_RUN_UNSET) & set(values)
