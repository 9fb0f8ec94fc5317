"""Kubernetes manifests for the job the other flags describe (``fleetrun --k8s``): decided by
pure functions from a :class:`LaunchConfig`, printed as YAML or JSON; nothing runs here.

* A collective job (``--nnodes N --nproc_per_node P``, ``--gpus``) becomes a Kubeflow
  ``PyTorchJob`` (``kubeflow.org/v1``): pod ``<name>-master-0`` and pods
  ``<name>-worker-<i>`` (one per node), each running ``fleetrun`` for its node. The training
  operator gives every pod a headless Service of the pod's own name, so the pods reach each
  other by those names: they are fleetrun's ``--ips``, ``--host`` is the pod's own name
  (``POD_NAME``, from the downward API) and the rendezvous store is on the master pod. fleetrun,
  not the operator's variables, makes the ranks: the operator's ``RANK`` / ``WORLD_SIZE`` count
  pods, not processes, and its ``MASTER_ADDR`` is ``localhost`` on the master pod; fleetrun's
  elastic agent sets every process's variables itself, with ``--nproc_per_node``, GPUs, logs and
  restarts as on any machine. ``--nnodes MIN:MAX`` gives an elastic job: worker pods only, an
  ``elasticPolicy``, the store on ``<name>-worker-0``, pods restarted on failure to rejoin.
* A parameter-server job (``--server_num S --worker_num W``) becomes an indexed ``Job`` per role
  (``<name>-server``, ``<name>-worker``; ``completionMode: Indexed``), a headless ``Service``
  ``<name>`` whose DNS names the pods are reached by (``<job>-<index>.<name>.<ns>.svc``) and a
  ``Secret`` ``<name>-ps-secret`` with the job's shared secret. Every pod runs the script with
  ``python -m fleetx.run`` and gets each variable the role maker reads; its index comes from the
  indexed-job annotation through the downward API (``JOB_COMPLETION_INDEX``), and the secret
  reaches it through a ``secretKeyRef`` (``FLEETX_PS_SECRET``), never on a command line.

Example:
    >>> cfg = LaunchConfig(training_script="/app/train.py", k8s=True, image="me/train:1",
    ...                    server_num=1, worker_num=2)
    >>> [d["kind"] for d in manifests(cfg, make_secret=lambda: "s")]
    ['Secret', 'Service', 'Job', 'Job']
"""
from __future__ import annotations

import base64
import json
import secrets
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from fleetx.launch.api import EXIT_OK, ConfigError, RunMode
from fleetx.launch.config import LaunchConfig

__all__ = ["manifests", "render", "launch", "job_name", "MASTER_PORT", "PS_PORT", "CONTAINER",
           "JOB_LABEL", "INDEX_ANNOTATION", "SECRET_KEY"]

#: the rendezvous store's port on the master pod; the processes' endpoints are the next ports
MASTER_PORT = 23456
#: every parameter server and worker pod listens on this port of its own address
PS_PORT = 6170
#: the training operator sets its variables in the container of this name only
CONTAINER = "pytorch"
#: the label every pod of a parameter-server job carries; the headless Service selects it
JOB_LABEL = "fleetx/job"
#: where an indexed Job's pod finds its index (the downward API reads it)
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: the key of the job's secret in its Secret
SECRET_KEY = "secret"
DEFAULT_NAMESPACE = "default"

#: flags that say where processes run on machines fleetrun can see: the pods decide that
_NO_MEANING = {
    "ips": "the pods are the nodes (their names are listed for you)",
    "host": "each pod knows its own name",
    "master": "the rendezvous store is on the first pod",
    "servers": "the servers are pods: give --server_num",
    "workers": "the workers are pods: give --worker_num",
    "heter_worker_num": "heter workers are not generated for Kubernetes yet",
    "heter_workers": "heter workers are not generated for Kubernetes yet",
    "dry_run": "--k8s prints manifests and runs nothing already",
    "checkpoint_dir": "parameter-server failover is not generated for Kubernetes yet",
    "checkpoint_interval": "parameter-server failover is not generated for Kubernetes yet",
}


def job_name(config: LaunchConfig) -> str:
    """``--name``, else the script's (or module's) name made a Kubernetes name."""
    if config.name:
        return config.name
    stem = Path(config.training_script).stem if not config.module else \
        config.training_script.rpartition(".")[2]
    name = "".join(c if c.isalnum() else "-" for c in stem.lower()).strip("-")[:40].rstrip("-")
    if not name or not name[0].isalpha():
        name = f"fleetx-{name}".rstrip("-")[:40].rstrip("-")
    return name


def _refuse(config: LaunchConfig) -> None:
    for name, why in _NO_MEANING.items():
        value = getattr(config, name)
        if value and not (name == "ips" and value == ("127.0.0.1",)):
            raise ConfigError(f"--{name}", f"makes no sense with --k8s: {why}")


def _escape(arg: str) -> str:
    """Kubernetes expands ``$(VAR)`` in a container's command; the user's text stays as is."""
    return arg.replace("$(", "$$(")


def _script(config: LaunchConfig) -> list[str]:
    return (["-m"] if config.module else []) + [_escape(a) for a in (
        config.training_script, *config.training_script_args)]


def _container(image: str, command: list[str], env: list[dict], port: int,
               resources: Optional[dict] = None, name: str = "fleetx") -> dict:
    container = {"name": name, "image": image, "command": command, "env": env,
                 "ports": [{"name": "fleetx", "containerPort": port}]}
    if resources:
        container["resources"] = resources
    return container


def _field(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


# -- collective: a PyTorchJob ------------------------------------------------------------------
def _fleetrun(config: LaunchConfig, ips: list[str], master: str) -> list[str]:
    """The command each pod runs: fleetrun for its node, its addresses the pods' names."""
    low, high = config.node_range()
    cmd = ["fleetrun", "--nnodes", config.nnodes or "1", "--host", "$(POD_NAME)",
           "--master", master, "--backend", config.backend, "--log_dir", _escape(config.log_dir)]
    if low == high:
        cmd += ["--ips", ",".join(ips)]
    if config.gpus:  # inside a pod its GPUs are 0..n-1, whichever the device plugin gave it
        cmd += ["--gpus", ",".join(str(i) for i in range(len(config.gpus)))]
    elif config.nproc_per_node:
        cmd += ["--nproc_per_node", str(config.nproc_per_node)]
    if config.max_restarts:
        cmd += ["--max_restarts", str(config.max_restarts)]
    if config.tee:
        cmd += ["--tee"]
    elif config.log_ranks is not None:
        cmd += ["--log_ranks", "all" if config.log_ranks == "all"
                else ",".join(map(str, config.log_ranks))]
    return cmd + _script(config)


def _pytorchjob(config: LaunchConfig, name: str, namespace: str) -> dict:
    low, high = config.node_range()
    elastic = low < high
    # Pod names are the operator's: <job>-<replica type>-<index>, each with a Service of its name.
    if elastic:
        replicas = {"Worker": high}
        ips = []
        master = f"{name}-worker-0:{MASTER_PORT}"
    else:
        replicas = {"Master": 1, **({"Worker": high - 1} if high > 1 else {})}
        ips = [f"{name}-master-0"] + [f"{name}-worker-{i}" for i in range(high - 1)]
        master = f"{ips[0]}:{MASTER_PORT}"
    resources = {"limits": {"nvidia.com/gpu": str(len(config.gpus))}} if config.gpus else None
    container = _container(config.image, _fleetrun(config, ips, master),
                           [_field("POD_NAME", "metadata.name")], MASTER_PORT, resources,
                           CONTAINER)
    container["ports"][0]["name"] = "pytorchjob-port"  # the operator's name for the port
    restart = "OnFailure" if elastic else "Never"
    # The operator counts the pods' restarts against backoffLimit: an elastic job, whose failed
    # pods come back (OnFailure) and rejoin, sets none; a static one restarts inside its pods.
    policy = {"cleanPodPolicy": "Running",
              **({} if elastic else {"backoffLimit": config.max_restarts})}
    spec: dict[str, Any] = {
        "runPolicy": policy,
        "pytorchReplicaSpecs": {
            kind: {"replicas": count, "restartPolicy": restart,
                   "template": {"metadata": {"labels": {JOB_LABEL: name}},
                                "spec": {"containers": [container]}}}
            for kind, count in replicas.items()}}
    if elastic:
        spec["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high,
                                 "maxRestarts": config.max_restarts, "rdzvBackend": "c10d",
                                 "rdzvHost": f"{name}-worker-0", "rdzvPort": MASTER_PORT}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "labels": {JOB_LABEL: name}},
            "spec": spec}


# -- parameter server: Secret, headless Service, an indexed Job per role ------------------------
def _given(config: LaunchConfig, name: str) -> Any:
    """The flag's value when it differs from its default, else None."""
    value = getattr(config, name)
    return value if value != LaunchConfig.__dataclass_fields__[name].default else None


def _ps_refuse(config: LaunchConfig) -> None:
    given = {"--nproc_per_node": config.nproc_per_node, "--gpus": config.gpus,
             "--nnodes": config.nnodes,
             "--max_restarts": config.max_restarts or None,
             "--log_ranks": config.log_ranks, "--tee": config.tee or None,
             "--log_dir": _given(config, "log_dir"), "--backend": _given(config, "backend")}
    for flag, value in given.items():
        if value is not None:
            raise ConfigError(flag, "makes no sense with --k8s in a parameter-server job: each "
                                    "server and worker is a pod of its own (its output: kubectl "
                                    "logs); failover (--max_restarts) is not generated yet")


def _ps_pod_env(role: str, name: str, host: str, servers: list[str], workers: list[str],
                secret_name: str) -> list[dict]:
    env = [
        _field("JOB_COMPLETION_INDEX", f"metadata.annotations['{INDEX_ANNOTATION}']"),
        {"name": "TRAINING_ROLE", "value": "PSERVER" if role == "server" else "TRAINER"},
        {"name": "PADDLE_PSERVERS_IP_PORT_LIST", "value": ",".join(servers)},
        {"name": "PADDLE_TRAINER_ENDPOINTS", "value": ",".join(workers)},
        {"name": "PADDLE_TRAINERS_NUM", "value": str(len(workers))},
        # $(...) refers to a variable defined above it: the pod's index, hence its DNS name
        {"name": "POD_IP", "value": f"{name}-{role}-$(JOB_COMPLETION_INDEX).{host}"},
        {"name": "PADDLE_PORT", "value": str(PS_PORT)},
        {"name": "FLEETX_PS_SECRET",
         "valueFrom": {"secretKeyRef": {"name": secret_name, "key": SECRET_KEY}}},
    ]
    if role == "worker":
        env.insert(5, {"name": "PADDLE_TRAINER_ID", "value": "$(JOB_COMPLETION_INDEX)"})
    return env


def _ps_job(config: LaunchConfig, role: str, count: int, name: str, namespace: str,
            env: list[dict]) -> dict:
    command = ["python", "-u", "-m", "fleetx.run", *_script(config)]
    labels = {JOB_LABEL: name, "fleetx/role": role}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-{role}", "namespace": namespace, "labels": labels},
            "spec": {"completionMode": "Indexed", "completions": count, "parallelism": count,
                     "backoffLimit": 0,
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"subdomain": name, "restartPolicy": "Never",
                                           "containers": [_container(config.image, command,
                                                                     env, PS_PORT)]}}}}


def _secret_value(config: LaunchConfig, make_secret: Callable[[], str]) -> str:
    if not config.ps_secret_file:
        return make_secret()
    try:
        value = Path(config.ps_secret_file).read_text().strip()
    except OSError as exc:
        raise ConfigError("--ps_secret_file", f"{config.ps_secret_file}: {exc.strerror}") \
            from None
    if not value:
        raise ConfigError("--ps_secret_file", f"{config.ps_secret_file} is empty")
    return value


def _ps_manifests(config: LaunchConfig, name: str, namespace: str,
                  make_secret: Callable[[], str]) -> list[dict]:
    _ps_refuse(config)
    for flag, count in (("--server_num", config.server_num), ("--worker_num", config.worker_num)):
        if not count:
            raise ConfigError(flag, "a parameter-server job on Kubernetes needs --server_num "
                                    "and --worker_num")
    host = f"{name}.{namespace}.svc"
    servers = [f"{name}-server-{i}.{host}:{PS_PORT}" for i in range(config.server_num)]
    workers = [f"{name}-worker-{i}.{host}:{PS_PORT}" for i in range(config.worker_num)]
    secret_name = f"{name}-ps-secret"
    value = base64.b64encode(_secret_value(config, make_secret).encode()).decode()
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": secret_name, "namespace": namespace,
                           "labels": {JOB_LABEL: name}},
              "data": {SECRET_KEY: value}}
    # Headless, and publishing pods before they are ready: a server resolves its own name to
    # listen on it, and workers resolve the servers' while those start.
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": namespace, "labels": {JOB_LABEL: name}},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": {JOB_LABEL: name},
                        "ports": [{"name": "fleetx", "port": PS_PORT}]}}
    jobs = [_ps_job(config, role, count, name, namespace,
                    _ps_pod_env(role, name, host, servers, workers, secret_name))
            for role, count in (("server", config.server_num), ("worker", config.worker_num))]
    return [secret, service, *jobs]


# -- the whole job --------------------------------------------------------------------------------
def manifests(config: LaunchConfig,
              make_secret: Callable[[], str] = lambda: secrets.token_hex(32)) -> list[dict]:
    """The Kubernetes objects of the job ``config`` describes, as plain dicts.

    Args:
        config: the launch configuration, with ``k8s`` and ``image`` set.
        make_secret: the parameter-server job's secret when ``--ps_secret_file`` is not given
            (256 random bits).

    Raises:
        ConfigError: a flag that makes no sense on Kubernetes, or a job that cannot be
            described there (the message names the flag).
    """
    _refuse(config)
    name, namespace = job_name(config), config.namespace or DEFAULT_NAMESPACE
    if config.resolved_mode() is RunMode.PS:
        return _ps_manifests(config, name, namespace, make_secret)
    for flag in ("--server_num", "--worker_num", "--ps_secret_file"):  # with --run_mode collective
        if getattr(config, flag[2:]):
            raise ConfigError(flag, "is a parameter-server flag; this is a collective job")
    return [_pytorchjob(config, name, namespace)]


def _plain_dumper() -> type:
    import yaml

    class PlainDumper(yaml.SafeDumper):
        """Writes a repeated object (the pod template of both replica types) out in full
        each time: anchors and aliases are valid YAML but hard to read and to edit."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

    return PlainDumper


def render(docs: list[dict], fmt: str = "yaml") -> str:
    """``docs`` as multi-document YAML or as one JSON ``v1`` ``List``.

    Raises:
        ConfigError: YAML without pyyaml installed (names ``--k8s_format`` and the extra).
    """
    if fmt == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2)
    try:
        import yaml
    except ImportError:
        raise ConfigError("--k8s_format", "yaml needs the pyyaml package (pip install "
                                          "'fleetx[yaml]'); or choose --k8s-format json") from None
    return yaml.dump_all(docs, Dumper=_plain_dumper(), sort_keys=False,
                         default_flow_style=False).rstrip("\n")


def launch(config: LaunchConfig) -> int:
    """Print the manifests of ``config``'s job on stdout; returns 0.

    Raises:
        ConfigError: as :func:`manifests` and :func:`render`.
    """
    text = render(manifests(config), config.k8s_format)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return EXIT_OK
