"""Jobs across two "machines" for real: network namespaces joined by a veth pair
(``netns_nodes.py``), one fleetrun per namespace as on two hosts.

* a collective job (``--ips A,B``, DDP over gloo) ends with the parameters of the same SGD on
  the union batches, computed here in numpy;
* a parameter-server job with its servers on one node and workers on both ends with the
  single-process result of the sync contract;
* taking the link down mid-training ends both jobs on both nodes within the timeouts, each
  node's error naming the peer it lost, and leaves no process in either namespace.

Each test starts torch in four processes or more: slow stage.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import netns_nodes  # noqa: E402
from netns_nodes import pids  # noqa: E402
from test_fleetrun import fleetrun_cmd, wait_for  # noqa: E402

two_nodes = netns_nodes.two_nodes
pytestmark = [pytest.mark.slow,  # torch's sparse Adagrad in the PS reference warns about itself
              pytest.mark.filterwarnings("ignore:Sparse invariant checks")]

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_TIMEOUT = 8       # FLEETX_TIMEOUT: a collective waits this long for a peer
_DEAD_AFTER = 4    # FLEETX_PS_DEAD_AFTER: a silent PS link is dead after this long
_STEPS = 6


def _start(nodes, tmp_path: Path, args, **variables) -> list[subprocess.Popen]:
    """One fleetrun per node, each in ``tmp_path/node<i>`` (its log folder is there)."""
    procs = []
    for i, node in enumerate(nodes):
        cwd = tmp_path / f"node{i}"
        cwd.mkdir()
        extra = [f"{k}={v}" for k, v in variables.items()]
        # the user's own interface choice would defeat fleetrun's (and name no veth here)
        cmd = node.exec("env", "-u", "GLOO_SOCKET_IFNAME", "-u", "NCCL_SOCKET_IFNAME", *extra,
                        *fleetrun_cmd(*[str(a).replace("{out}", str(cwd)) for a in args]))
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs, timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each fleetrun."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


def _reference(steps: int) -> tuple[np.ndarray, float]:
    """netns_train.py's SGD with momentum on each step's union batch, in float64 numpy: torch's
    update (the first step's buffer is the gradient, then buf = momentum * buf + grad)."""
    from netns_train import FEATURES, LR, MOMENTUM, union_batch
    w, b = np.zeros(FEATURES), 0.0
    buf_w, buf_b = None, None
    for step in range(steps):
        x, y = union_batch(step)
        err = x @ w + b - y
        grad_w, grad_b = 2 * x.T @ err / len(y), 2 * err.mean()
        buf_w = grad_w if buf_w is None else MOMENTUM * buf_w + grad_w
        buf_b = grad_b if buf_b is None else MOMENTUM * buf_b + grad_b
        w, b = w - LR * buf_w, b - LR * buf_b
    return w, b


def _collective(nodes, tmp_path, steps: int, pause: float):
    ips = ",".join(node.addr for node in nodes)
    return _start(nodes, tmp_path, ["--ips", ips, SCRIPTS / "netns_train.py", "{out}", steps,
                                    pause], FLEETX_TIMEOUT=_TIMEOUT)


def _ps(nodes, tmp_path, *args):
    """Servers on node 0 only, one worker per node, the same secret on both."""
    secret = tmp_path / "secret"
    secret.write_text(uuid.uuid4().hex)
    servers = f"{nodes[0].addr}:6000,{nodes[0].addr}:6001"
    return _start(nodes, tmp_path, ["--servers", servers, "--workers",
                                    ",".join(n.addr for n in nodes), "--ps_secret_file", secret,
                                    SCRIPTS / "ps_fleet_train.py", "--out", "{out}", *args],
                  FLEETX_TIMEOUT=_TIMEOUT, FLEETX_PS_DEAD_AFTER=_DEAD_AFTER,
                  FLEETX_PS_HEARTBEAT_INTERVAL=1)


def _cut_when(nodes, path: Path, text: str) -> float:
    """Take the link down once ``text`` is in ``path``; the time it went down."""
    assert wait_for(lambda: path.exists() and text in path.read_text(), 150), \
        f"training never reached {text!r}"
    nodes[0].link_down()
    return time.monotonic()


def test_collective_job_on_two_nodes_equals_sgd_on_the_union_batch(tmp_path, two_nodes):
    results = _finish(_collective(two_nodes, tmp_path, _STEPS, 0), 180)
    for code, out, err in results:
        assert code == 0, out[-3000:] + err[-3000:]
    for node, (_, out, _) in zip(two_nodes, results):  # gloo bound to the veth, not lo
        assert f"setting GLOO_SOCKET_IFNAME={node.link} and NCCL_SOCKET_IFNAME={node.link}" in out
    got = json.loads((tmp_path / "node0" / "params.json").read_text())
    w, b = _reference(_STEPS)
    np.testing.assert_allclose(got["weight"], w, rtol=1e-12, atol=1e-12)
    assert abs(got["bias"] - b) < 1e-12
    assert np.abs(w).min() > 0.1  # it did train: the start is all zeros
    from netns_train import union_batch
    x, y = union_batch(99)
    assert np.mean((x @ w + b - y) ** 2) < np.mean(y ** 2) / 2  # and learned


def test_ps_job_with_servers_on_one_node_and_workers_on_both(tmp_path, two_nodes):
    from ps_fleet_model import reference
    results = _finish(_ps(two_nodes, tmp_path, "--mode", "sync", "--steps", 3), 240)
    for code, out, err in results:
        assert code == 0, out[-3000:] + err[-3000:]
    assert "this node starts server 0, server 1, worker 0" in results[0][1]
    assert "this node starts worker 1" in results[1][1]
    for node, (_, out, _) in zip(two_nodes, results):  # PS jobs get the interface too
        assert (f"fleetrun: setting GLOO_SOCKET_IFNAME={node.link} and NCCL_SOCKET_IFNAME="
                f"{node.link} for each process of {node.addr}") in out
    expected = reference(3)
    for rank in range(2):
        got = np.load(tmp_path / f"node{rank}" / f"worker{rank}.npz")
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5, err_msg=key)


def _left(nodes) -> dict:
    return {node.ns: pids(node.ns) for node in nodes if pids(node.ns)}


def test_link_down_stops_a_collective_job_on_both_nodes_naming_the_lost_peer(tmp_path,
                                                                             two_nodes):
    procs = _collective(two_nodes, tmp_path, 200, 0.3)
    down = _cut_when(two_nodes, tmp_path / "node1" / "log" / "workerlog.1", "step 3 ")
    results = _finish(procs, 120)
    took = time.monotonic() - down
    for code, _, err in results:
        assert code == 1, err[-3000:]
    abort = [next(line for line in err.splitlines() if line.startswith("ABORT!!!"))
             for _, _, err in results]
    # node 0 hosts the store: it sees rank 1 fall silent
    # (DDP's gradient all_reduce, or the broadcast of its buffers before the forward)
    assert re.search(r"rank=\[1\] was at fault: rank 1 did not arrive at (all_reduce|broadcast) "
                     r"#\d+ on group 0", abort[0]), abort[0]
    assert "it has not reported for" in abort[0], abort[0]
    # node 1 is cut off from rank 0 and from the store, and says so
    master = f"{two_nodes[0].addr}:6070"
    assert re.search(r"rank=\[0\] was at fault: rank 0 did not arrive at (all_reduce|broadcast) "
                     r"#\d+ on group 0", abort[1]), abort[1]
    assert f"and the job's store at {master} did not answer" in abort[1], abort[1]
    print(f"collective: link down -> both fleetruns exited in {took:.1f} s")  # docs/reliability
    assert took < 3 * _TIMEOUT + 30, took  # the collective timeout, the diagnosis, the exits
    assert wait_for(lambda: not _left(two_nodes), 10), _left(two_nodes)


def test_link_down_stops_a_ps_job_on_both_nodes_naming_the_lost_peer(tmp_path, two_nodes):
    procs = _ps(two_nodes, tmp_path, "--mode", "sync", "--steps", 400, "--pause", 0.3)
    down = _cut_when(two_nodes, tmp_path / "node1" / "log" / "workerlog.1", "worker 1 step 3")
    results = _finish(procs, 120)
    took = time.monotonic() - down
    for code, _, err in results:
        assert code == 1, err[-3000:]
    servers = f"{two_nodes[0].addr}:6000"
    # node 0: a server lost worker 1 and worker 0's next request fails with it
    assert "ABORT!!! Out of all 2 server(s) and 2 worker(s), worker 0 failed." in results[0][2]
    assert "PeerLostError: worker 1 (pid " in results[0][2]
    assert f"no frame or heartbeat for {_DEAD_AFTER} s (reported by server " in results[0][2]
    # node 1: worker 1 lost the servers
    assert "ABORT!!! Out of all 2 server(s) and 2 worker(s), worker 1 failed." in results[1][2]
    assert f"PeerLostError: server 0 ({servers}) lost: no frame or heartbeat" in \
        results[1][2] or f"PeerLostError: server 1 ({two_nodes[0].addr}:6001) lost" in \
        results[1][2], results[1][2][-3000:]
    print(f"parameter server: link down -> both fleetruns exited in {took:.1f} s")
    assert took < 2 * _DEAD_AFTER + 30, took
    assert wait_for(lambda: not _left(two_nodes), 10), _left(two_nodes)
