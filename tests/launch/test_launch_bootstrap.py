"""The per-process variables the bootstrap derives from a NodeSetup and the agent's ranks, and
the order in which it sets them."""
import json
import os
import subprocess
import sys
import textwrap

from fleetx.launch.api import NodeSetup
from fleetx.launch.bootstrap import (endpoint_env, local_env, own_endpoint, process_env,
                                     static_endpoints)


def setup(**kw):
    base = dict(log_dir="/x/log", backend="gloo", node_addrs=("10.0.0.1", "10.0.0.2"),
                own_addr="10.0.0.2", ports=(6071, 6072))
    return NodeSetup(**{**base, **kw})


def test_setup_round_trips_through_json():
    s = setup(devices=("0", "1"), visible_devices="4,5", omp_threads=1, launcher_pid=12)
    assert NodeSetup.from_json(s.to_json()) == s


def test_static_endpoints_node_by_node():
    assert static_endpoints(setup()) == ["10.0.0.1:6071", "10.0.0.1:6072", "10.0.0.2:6071",
                                         "10.0.0.2:6072"]
    assert static_endpoints(setup(node_addrs=("::1",), ports=(7,))) == ["[::1]:7"]


def test_cpu_process_env():
    s = setup()
    values = process_env(s, 3, 1, 4, static_endpoints(s))
    assert values == {
        "PADDLE_TRAINER_ID": "3", "PADDLE_TRAINERS_NUM": "4",
        "PADDLE_TRAINER_ENDPOINTS": "10.0.0.1:6071,10.0.0.1:6072,10.0.0.2:6071,10.0.0.2:6072",
        "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:6072", "PADDLE_RANK_IN_NODE": "1",
        "PADDLE_LOCAL_DEVICE_IDS": "", "PADDLE_WORLD_DEVICE_IDS": "",
        "PADDLE_DISTRI_BACKEND": "gloo", "PADDLE_TRAINING_ROLE": "TRAINER",
        "FLEETX_LOG_DIR": "/x/log"}


def test_gpu_process_env():
    s = setup(backend="nccl", devices=("0", "1"), visible_devices="2,3", omp_threads=1)
    values = process_env(s, 2, 0, 4, static_endpoints(s))
    assert values["PADDLE_LOCAL_DEVICE_IDS"] == values["FLAGS_selected_gpus"] == "0"
    assert values["PADDLE_WORLD_DEVICE_IDS"] == "0,1,0,1"
    assert (values["CUDA_VISIBLE_DEVICES"], values["OMP_NUM_THREADS"]) == ("2,3", "1")


def test_unknown_endpoints_leave_only_the_current_one():
    values = process_env(setup(node_addrs=()), 5, 1, 8, None)
    assert values["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:6072"
    assert "PADDLE_TRAINER_ENDPOINTS" not in values


def test_socket_interfaces_are_passed_on():
    values = process_env(setup(gloo_ifname="eth1", nccl_ifname="eth2"), 0, 0, 4, None)
    assert (values["GLOO_SOCKET_IFNAME"], values["NCCL_SOCKET_IFNAME"]) == ("eth1", "eth2")
    assert "GLOO_SOCKET_IFNAME" not in process_env(setup(), 0, 0, 4, None)


def test_local_and_endpoint_variables_split_the_process_env():
    s = setup(devices=("0", "1"), visible_devices="2,3", omp_threads=1)
    local, endpoints = local_env(s, 3, 1, 4), endpoint_env(s, 3, 1, static_endpoints(s))
    assert set(endpoints) == {"PADDLE_CURRENT_ENDPOINT", "PADDLE_TRAINER_ENDPOINTS"}
    assert not set(local) & set(endpoints)
    assert {**local, **endpoints} == process_env(s, 3, 1, 4, static_endpoints(s))
    assert own_endpoint(setup(own_addr="fd00::2"), 1) == "[fd00::2]:6072"


def test_torch_variables_are_set_before_anything_imports_torch(tmp_path):
    """The bootstrap path of an elastic job, in a fresh interpreter: the endpoint exchange (here
    faked) is the first thing that may import torch, and it finds the variables in place."""
    code = textwrap.dedent("""
        import json, os, sys
        from fleetx.launch import bootstrap
        from fleetx.launch.api import NodeSetup

        seen = {}

        def gather(own, rank, world_size):
            seen.update(torch_imported="torch" in sys.modules, own=own,
                        omp=os.environ.get("OMP_NUM_THREADS"),
                        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                        trainer_id=os.environ.get("PADDLE_TRAINER_ID"),
                        endpoints=os.environ.get("PADDLE_TRAINER_ENDPOINTS"))
            return ["10.0.0.1:7001", own]

        setup = NodeSetup("/tmp/log", "gloo", (), "10.0.0.2", (7001,), omp_threads=1,
                          visible_devices="3")
        seen["returned"] = bootstrap.configure(setup, 1, 0, 2, gather)
        seen["after"] = os.environ["PADDLE_TRAINER_ENDPOINTS"]
        print(json.dumps(seen))
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PADDLE_TRAINER_ENDPOINTS")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen == {"torch_imported": False, "own": "10.0.0.2:7001", "omp": "1", "visible": "3",
                    "trainer_id": "1", "endpoints": None,
                    "returned": ["10.0.0.1:7001", "10.0.0.2:7001"],
                    "after": "10.0.0.1:7001,10.0.0.2:7001"}


def test_a_fresh_ps_worker_forgets_the_throughput_an_earlier_job_left(tmp_path):
    """Only node 0 moves an earlier job's files aside: on other nodes a fresh worker removes
    its own rank's throughput file, so fleetrun's summary never shows an earlier job's figure
    for a process that reported none; a restarted one keeps it, and other ranks' stay."""
    script = tmp_path / "quiet.py"
    script.write_text("pass\n")
    for name in ("throughput.0", "throughput.1"):
        (tmp_path / name).write_text('{"samples_per_s": 99.0, "steps": 3}')

    def start(fresh):
        setup = json.dumps({"log": str(tmp_path / "workerlog.0"), "launcher_pid": os.getpid(),
                            "fresh": fresh})
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "TRAINING"))}
        env.update(TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID="0")
        subprocess.run([sys.executable, "-m", "fleetx.launch.bootstrap", "--ps", setup,
                        str(script)], env=env, check=True, timeout=60)
    start(fresh=False)  # a restart: this job's own figure stays
    assert (tmp_path / "throughput.0").exists()
    start(fresh=True)
    assert not (tmp_path / "throughput.0").exists() and (tmp_path / "throughput.1").exists()
