"""The manifests of ``fleetrun --k8s`` train, end to end: ``tests/k8s_local.py`` runs each pod's
command with its resolved variables (downward API, job completion index, the Secret) as a local
process, the pods' DNS names replaced by loopback addresses of their own."""
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetx.launch import cli, k8s

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import k8s_local  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _manifests(*argv: str) -> list[dict]:
    return k8s.manifests(cli.parse_config(["--k8s", "--image", "me/train:1", *argv]))


def _result(text: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.startswith("RESULT"))


@pytest.mark.slow  # ~15 s on 2 busy cores: four processes import torch
def test_collective_pytorchjob_trains_two_nodes(tmp_path):
    docs = _manifests("--nnodes", "2", "--nproc_per_node", "1", "--name", "ddp",
                      str(SCRIPTS / "cluster_train.py"))
    results = k8s_local.run(docs, tmp_path, timeout=120)
    for name, (code, output) in results.items():
        assert code == 0, f"{name}:\n{output[-3000:]}"
    # rank 0's output is the master pod's fleetrun output; rank 1's is in the worker pod's log
    rank0 = _result(results["ddp-master-0"][1])
    rank1 = _result((tmp_path / "ddp-worker-0" / "log" / "workerlog.1").read_text())
    assert rank0[1:3] == ["0", "2"] and rank1[1:3] == ["1", "2"]
    assert rank0[4:] == rank1[4:]  # the all-reduce kept the two replicas equal


@pytest.mark.slow  # ~20 s on 2 busy cores
def test_ps_jobs_train_two_servers_two_workers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    docs = _manifests("--server_num", "2", "--worker_num", "2", "--name", "ctr",
                      str(SCRIPTS / "ps_fleet_train.py"), "--out", str(out), "--steps", "4")
    pods = k8s_local.pods_of(docs)
    assert sorted(p.name for p in pods) == ["ctr-server-0-local", "ctr-server-1-local",
                                            "ctr-worker-0-local", "ctr-worker-1-local"]
    assert all(p.env["FLEETX_PS_SECRET"] for p in pods)  # from the Secret, through the kubelet
    results = k8s_local.run(docs, tmp_path / "pods", timeout=120)
    for name, (code, output) in results.items():
        assert code == 0, f"{name}:\n{output[-3000:]}"
    w0, w1 = (np.load(out / f"worker{r}.npz") for r in (0, 1))
    for w in (w0, w1):
        assert len(w["losses"]) == 4 and float(w["eval_after"]) < float(w["eval_before"])
    for key in w0.files:  # sync mode: both read the same rows back from the two servers
        if key.startswith(("emb", "tags", "mlp")):
            np.testing.assert_allclose(w0[key], w1[key], rtol=0, atol=1e-6)


def test_a_pod_without_its_headless_service_cannot_resolve_the_servers(tmp_path):
    """The harness publishes DNS names only where Kubernetes would: without the Service the
    endpoint variables keep names nothing resolves (the wiring, not the harness, carries the
    job)."""
    docs = [d for d in _manifests("--server_num", "1", "--worker_num", "1", "t.py")
            if d["kind"] != "Service"]
    pods = k8s_local.pods_of(docs)
    k8s_local.localize(pods)
    assert all(".svc:" in p.env["PADDLE_PSERVERS_IP_PORT_LIST"] for p in pods)


def test_harness_resolves_variables_as_the_kubelet_does():
    assert k8s_local.expand("a-$(X).b $$(X) $(NOPE)", {"X": "1"}) == "a-1.b $(X) $(NOPE)"
    docs = _manifests("--server_num", "1", "--worker_num", "2", "--name", "j", "t.py")
    pods = {p.name: p for p in k8s_local.pods_of(docs)}
    w1 = pods["j-worker-1-local"]
    assert (w1.env["PADDLE_TRAINER_ID"], w1.env["POD_IP"]) == ("1", "j-worker-1.j.default.svc")
    names = k8s_local.localize(list(pods.values()), prefix="127.9.9")
    assert w1.env["POD_IP"] == names["j-worker-1.j.default.svc"]
    assert w1.env["PADDLE_PSERVERS_IP_PORT_LIST"] == f"{names['j-server-0.j.default.svc']}:6170"
    with pytest.raises(ValueError, match="no such Secret"):
        k8s_local.pods_of([d for d in docs if d["kind"] != "Secret"])
