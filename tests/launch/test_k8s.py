"""``fleetrun --k8s``: the manifests are valid objects of their APIs (deserialised into the
official ``kubernetes`` client's models and the Kubeflow training SDK's, then serialised back
unchanged, so a misspelt or misplaced field fails), carry what the role maker needs, keep the
secret off every command line, and bad flags are refused naming the flag."""
import base64
import json
import subprocess
import sys

import pytest

from fleetx.launch import cli, k8s
from fleetx.launch.api import ConfigError
from fleetx.launch.config import LaunchConfig

kubernetes = pytest.importorskip("kubernetes")  # the k8s-test extra; CI=true fails a skip
training = pytest.importorskip("kubeflow.training")


def _config(*argv: str) -> LaunchConfig:
    return cli.parse_config(["--k8s", "--image", "me/train:1", *argv])


def _roundtrip(client, doc: dict, klass: str):
    """The model of ``doc``; its serialisation must be ``doc`` itself (nothing dropped)."""
    obj = client._ApiClient__deserialize(json.loads(json.dumps(doc)), klass)
    assert client.sanitize_for_serialization(obj) == doc
    return obj


def _k8s_model(doc: dict):
    return _roundtrip(kubernetes.client.ApiClient(), doc, f"V1{doc['kind']}")


def _kubeflow_model(doc: dict):
    from kubeflow.training.api_client import ApiClient

    return _roundtrip(ApiClient(), doc, "KubeflowOrgV1PyTorchJob")


def _env(container) -> dict:
    return {e.name: e for e in container.env}


def test_collective_is_a_pytorchjob_whose_pods_run_fleetrun_for_their_node():
    (doc,) = k8s.manifests(_config("--nnodes", "3", "--gpus", "0,1", "--name", "gpt",
                                   "--namespace", "ml", "/app/train.py", "--lr", "$(HOME)"))
    job = _kubeflow_model(doc)
    assert (job.api_version, job.kind, job.metadata.namespace) == ("kubeflow.org/v1",
                                                                    "PyTorchJob", "ml")
    specs = job.spec.pytorch_replica_specs
    assert {k: s.replicas for k, s in specs.items()} == {"Master": 1, "Worker": 2}
    assert job.spec.elastic_policy is None
    assert job.spec.run_policy.backoff_limit == 0  # static: restarts happen inside the pods
    pod = specs["Worker"].template.spec
    (container,) = pod.containers
    assert container.name == "pytorch"  # the operator sets its variables there only
    assert container.resources.limits == {"nvidia.com/gpu": "2"}
    assert _env(container)["POD_NAME"].value_from.field_ref.field_path == "metadata.name"
    cmd = container.command
    assert cmd[0] == "fleetrun"
    flags = dict(zip(cmd[1:-3:2], cmd[2:-3:2]))
    assert flags["--nnodes"] == "3"
    assert flags["--ips"] == "gpt-master-0,gpt-worker-0,gpt-worker-1"
    assert flags["--host"] == "$(POD_NAME)" and flags["--master"] == "gpt-master-0:23456"
    assert flags["--gpus"] == "0,1"
    # the script's own $(...) is escaped, so Kubernetes passes it on as written
    assert cmd[-3:] == ["/app/train.py", "--lr", "$$(HOME)"]


def test_elastic_collective_has_an_elastic_policy_and_worker_pods_only():
    (doc,) = k8s.manifests(_config("--nnodes", "2:4", "--nproc_per_node", "2",
                                   "--max_restarts", "3", "t.py"))
    job = _kubeflow_model(doc)
    policy = job.spec.elastic_policy
    assert (policy.min_replicas, policy.max_replicas, policy.max_restarts) == (2, 4, 3)
    assert list(job.spec.pytorch_replica_specs) == ["Worker"]
    worker = job.spec.pytorch_replica_specs["Worker"]
    assert (worker.replicas, worker.restart_policy) == (4, "OnFailure")
    cmd = worker.template.spec.containers[0].command
    assert "--ips" not in cmd and cmd[cmd.index("--master") + 1] == "t-worker-0:23456"
    assert cmd[cmd.index("--nnodes") + 1] == "2:4"
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[cmd.index("--max_restarts") + 1] == "3"
    assert worker.template.spec.containers[0].resources is None  # no --gpus: no GPU request
    # the operator counts pod restarts against backoffLimit: an elastic job sets none
    assert "backoffLimit" not in doc["spec"]["runPolicy"]


def test_ps_is_a_secret_a_headless_service_and_an_indexed_job_per_role():
    docs = k8s.manifests(_config("--server_num", "2", "--worker_num", "3", "--namespace", "ml",
                                 "/app/ctr.py"), make_secret=lambda: "s3cret")
    secret, service, servers, workers = (_k8s_model(d) for d in docs)
    assert base64.b64decode(secret.data["secret"]).decode() == "s3cret"
    assert service.spec.cluster_ip == "None" and service.spec.selector == {"fleetx/job": "ctr"}
    for job, role, count in ((servers, "server", 2), (workers, "worker", 3)):
        assert job.metadata.name == f"ctr-{role}"
        assert (job.spec.completion_mode, job.spec.completions, job.spec.parallelism) == \
            ("Indexed", count, count)
        pod = job.spec.template
        assert pod.spec.subdomain == service.metadata.name
        assert all(pod.metadata.labels[k] == v for k, v in service.spec.selector.items())
        (container,) = pod.spec.containers
        env = _env(container)
        assert env["JOB_COMPLETION_INDEX"].value_from.field_ref.field_path == \
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        assert env["PADDLE_PSERVERS_IP_PORT_LIST"].value == \
            "ctr-server-0.ctr.ml.svc:6170,ctr-server-1.ctr.ml.svc:6170"
        assert env["PADDLE_TRAINERS_NUM"].value == "3"
        assert env["POD_IP"].value == f"ctr-{role}-$(JOB_COMPLETION_INDEX).ctr.ml.svc"
        assert env["PADDLE_PORT"].value == "6170"
        ref = env["FLEETX_PS_SECRET"].value_from.secret_key_ref
        assert (ref.name, ref.key) == (secret.metadata.name, "secret")
        assert "s3cret" not in json.dumps(container.command)  # never on a command line
        assert container.command == ["python", "-u", "-m", "fleetx.run", "/app/ctr.py"]
    assert _env(servers.spec.template.spec.containers[0])["TRAINING_ROLE"].value == "PSERVER"
    wenv = _env(workers.spec.template.spec.containers[0])
    assert wenv["TRAINING_ROLE"].value == "TRAINER"
    assert wenv["PADDLE_TRAINER_ID"].value == "$(JOB_COMPLETION_INDEX)"


def test_ps_secret_comes_from_the_secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from-a-file\n")
    docs = k8s.manifests(_config("--server_num", "1", "--worker_num", "1", "--ps_secret_file",
                                 str(path), "t.py"))
    assert base64.b64decode(docs[0]["data"]["secret"]) == b"from-a-file"


def test_formats_yaml_documents_and_json_list():
    yaml = pytest.importorskip("yaml")
    docs = k8s.manifests(_config("--server_num", "1", "--worker_num", "2", "t.py"),
                         make_secret=lambda: "x")
    text = k8s.render(docs, "yaml")
    assert "&id" not in text and "*id" not in text  # written out in full, no aliases
    assert list(yaml.safe_load_all(text)) == docs
    assert json.loads(k8s.render(docs, "json")) == {"apiVersion": "v1", "kind": "List",
                                                    "items": docs}


def test_default_name_comes_from_the_script():
    assert k8s.job_name(_config("/app/My_Train.py")) == "my-train"
    assert k8s.job_name(_config("-m", "pkg.train2")) == "train2"
    assert k8s.job_name(_config("/app/3d.py")) == "fleetx-3d"


@pytest.mark.parametrize("argv, flag, words", [
    (["--ips", "10.0.0.1,10.0.0.2"], "--ips", "makes no sense with --k8s"),
    (["--host", "10.0.0.1"], "--host", "makes no sense with --k8s"),
    (["--master", "a:1"], "--master", "makes no sense with --k8s"),
    (["--servers", "a:1", "--worker_num", "1"], "--servers", "give --server_num"),
    (["--dry-run"], "--dry_run", "prints manifests"),
    (["--server_num", "1", "--worker_num", "1", "--max_restarts", "1"], "--max_restarts",
     "parameter-server"),
    (["--server_num", "1", "--worker_num", "1", "--gpus", "0"], "--gpus", "parameter-server"),
    (["--server_num", "1"], "--worker_num", "needs --server_num and --worker_num"),
    (["--heter_worker_num", "1", "--server_num", "1", "--worker_num", "1"], "--heter_worker_num",
     "not generated"),
    (["--server_num", "1", "--worker_num", "1", "--log_dir", "x"], "--log_dir",
     "parameter-server"),
    (["--server_num", "1", "--worker_num", "1", "--backend", "gloo"], "--backend",
     "parameter-server"),
    (["--nnodes", "2", "--ps_secret_file", "s"], "--ps_secret_file", "this is a collective job"),
])
def test_flags_that_make_no_sense_with_k8s_are_refused(argv, flag, words):
    with pytest.raises(ConfigError) as err:
        k8s.manifests(_config(*argv, "t.py"))
    assert err.value.flag == flag and words in err.value.message


def test_a_namespace_may_start_with_a_digit_and_be_63_characters_long():
    ns = "1" + "a" * 62
    (doc,) = k8s.manifests(_config("--nnodes", "2", "--namespace", ns, "t.py"))
    assert doc["metadata"]["namespace"] == ns


@pytest.mark.parametrize("argv, flag, words", [
    (["--k8s", "t.py"], "--k8s", "needs --image IMAGE"),
    (["--image", "x", "t.py"], "--image", "only means something with --k8s"),
    (["--k8s-format", "json", "t.py"], "--k8s_format", "only means something with --k8s"),
    (["--k8s", "--image", "x", "--k8s-format", "xml", "t.py"], "--k8s_format",
     "choose from yaml, json"),
    (["--k8s", "--image", "x", "--name", "Bad_Name", "t.py"], "--name", "not a Kubernetes name"),
    (["--k8s", "--image", "x", "--namespace", "ml-", "t.py"], "--namespace",
     "not a Kubernetes namespace"),
    (["--k8s", "--image", "x", "--namespace", "n" * 64, "t.py"], "--namespace",
     "at most 63 characters"),
])
def test_bad_kubernetes_flags_name_the_flag(argv, flag, words):
    with pytest.raises(ConfigError) as err:
        LaunchConfig(**vars(cli.build_parser().parse_args(argv)))
    assert err.value.flag == flag and words in err.value.message


def test_fleetrun_k8s_prints_only_the_manifests(tmp_path):
    """stdout is the manifests alone (no banner), ready for kubectl apply -f -; a bad flag
    exits 2 naming it."""
    ok = subprocess.run([sys.executable, "-m", "fleetx.launch", "--k8s", "--image", "i",
                         "--k8s-format", "json", "--nnodes", "2", "train.py"],
                        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert [d["kind"] for d in json.loads(ok.stdout)["items"]] == ["PyTorchJob"]
    bad = subprocess.run([sys.executable, "-m", "fleetx.launch", "--k8s", "--image", "i",
                          "--ips", "1.2.3.4", "train.py"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "argument --ips: makes no sense with --k8s" in bad.stderr
