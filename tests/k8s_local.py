"""Run the pods of Kubernetes manifests (``fleetrun --k8s``'s) as local processes, so tests can
check that the wiring trains without a cluster.

What stands in for Kubernetes, and how:

* pods: a ``PyTorchJob`` gives ``<job>-<type>-<index>`` for each replica type (the training
  operator's names), an indexed ``Job`` gives ``completions`` pods of host name
  ``<job>-<index>`` carrying the ``batch.kubernetes.io/job-completion-index`` annotation;
* each container's variables are resolved as the kubelet does: ``value`` with ``$(VAR)``
  expanded from the variables above it (``$$`` is a literal ``$``), ``fieldRef`` from the pod's
  metadata (name, namespace, annotations, labels), ``secretKeyRef`` from a ``Secret`` among the
  manifests (a missing one fails, as the kubelet would refuse to start the pod); the Job
  controller's ``JOB_COMPLETION_INDEX`` and the training operator's ``MASTER_ADDR``,
  ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` (container ``pytorch``) are added after them;
  ``$(VAR)`` in the command is expanded from all of them;
* DNS: a PyTorchJob's pods are reached by their names (the operator gives each a Service of its
  name); an indexed Job's pods by ``<hostname>.<subdomain>.<namespace>.svc`` only when a headless
  Service named like the subdomain selects them. Each pod gets its own loopback address
  ``127.A.B.n``, and every DNS name in its variables and command is replaced by the address (no
  ``/etc/hosts``): a name nothing publishes stays a name and fails to resolve, as in a cluster.

Images are not pulled: ``fleetrun`` runs as ``python -m fleetx.launch`` and ``python`` as this
interpreter, each pod in a folder of its own.
"""
from __future__ import annotations

import base64
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_FIELD = re.compile(r"metadata\.(annotations|labels)\['([^']+)'\]")
#: what a pod inherits from the machine (a container has no user environment of its own)
_BASE_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "TMPDIR", "FLEETX_TIMEOUT")


@dataclass
class Pod:
    """One pod of the manifests, resolved."""

    name: str
    namespace: str
    container: dict
    annotations: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    dns: list = field(default_factory=list)  # the names other pods reach it by
    extra_env: list = field(default_factory=list)  # what the controllers add after the spec's
    env: dict = field(default_factory=dict)
    command: list = field(default_factory=list)


def expand(text: str, variables: dict) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, others stay as written."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else
                    variables.get(m.group(1), m.group(0)), text)


def _field_value(pod: Pod, path: str) -> str:
    if path == "metadata.name":
        return pod.name
    if path == "metadata.namespace":
        return pod.namespace
    match = _FIELD.fullmatch(path)
    if not match:
        raise ValueError(f"pod {pod.name}: fieldRef {path!r} is not supported here")
    where = pod.annotations if match.group(1) == "annotations" else pod.labels
    return where.get(match.group(2), "")


def _secret_value(ref: dict, namespace: str, secrets: dict) -> str:
    key = (namespace, ref["name"])
    if key not in secrets or ref["key"] not in secrets[key]:
        raise ValueError(f"secretKeyRef {ref['name']}/{ref['key']}: no such Secret or key in "
                         f"namespace {namespace}")
    return base64.b64decode(secrets[key][ref["key"]]).decode()


def resolve(pod: Pod, secrets: dict) -> None:
    """Fill ``pod.env`` and ``pod.command`` as the kubelet would."""
    values: dict[str, str] = {}
    for item in list(pod.container.get("env", [])) + pod.extra_env:
        if "value" in item:
            values[item["name"]] = expand(str(item["value"]), values)
        elif "fieldRef" in item.get("valueFrom", {}):
            values[item["name"]] = _field_value(pod, item["valueFrom"]["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            values[item["name"]] = _secret_value(item["valueFrom"]["secretKeyRef"],
                                                 pod.namespace, secrets)
        else:
            raise ValueError(f"pod {pod.name}: variable {item['name']} has no supported source")
    pod.env = values
    pod.command = [expand(a, values) for a in pod.container["command"]
                   + pod.container.get("args", [])]


def _selects(service: dict, labels: dict) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pytorchjob_pods(doc: dict) -> list[Pod]:
    name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    specs = doc["spec"]["pytorchReplicaSpecs"]
    ordered = [(kind, specs[kind]) for kind in ("Master", "Worker") if kind in specs]
    total = sum(spec.get("replicas", 1) for _, spec in ordered)
    master = f"{name}-master-0" if "Master" in specs else f"{name}-worker-0"
    pods, rank = [], 0
    for kind, spec in ordered:
        for i in range(spec.get("replicas", 1)):
            pod_name = f"{name}-{kind.lower()}-{i}"
            container = spec["template"]["spec"]["containers"][0]
            pod = Pod(pod_name, ns, container,
                      labels=dict(spec["template"].get("metadata", {}).get("labels", {})),
                      dns=[f"{pod_name}.{ns}.svc.cluster.local", f"{pod_name}.{ns}.svc",
                           f"{pod_name}.{ns}", pod_name])
            if container["name"] == "pytorch":  # the operator's variables, after the spec's
                port = next((p["containerPort"] for p in container.get("ports", [])
                             if p.get("name") == "pytorchjob-port"), 23456)
                pod.extra_env = [
                    {"name": "MASTER_ADDR", "value": "localhost" if pod_name == master
                     else master},
                    {"name": "MASTER_PORT", "value": str(port)},
                    {"name": "WORLD_SIZE", "value": str(total)},
                    {"name": "RANK", "value": str(rank)}]
            pods.append(pod)
            rank += 1
    return pods


def _job_pods(doc: dict, services: list[dict]) -> list[Pod]:
    spec = doc["spec"]
    if spec.get("completionMode") != "Indexed":
        raise ValueError(f"Job {doc['metadata']['name']}: only indexed Jobs are run here")
    name, ns = doc["metadata"]["name"], doc["metadata"].get("namespace", "default")
    template = spec["template"]
    subdomain = template["spec"].get("subdomain")
    pods = []
    for i in range(spec["completions"]):
        labels = {**template.get("metadata", {}).get("labels", {}), "job-name": name,
                  INDEX_ANNOTATION: str(i)}
        container = template["spec"]["containers"][0]
        pod = Pod(f"{name}-{i}-local", ns, container, annotations={INDEX_ANNOTATION: str(i)},
                  labels=labels)
        if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in container.get("env", [])):
            pod.extra_env = [{"name": "JOB_COMPLETION_INDEX", "value": str(i)}]
        published = [s for s in services if s["metadata"]["name"] == subdomain
                     and s["metadata"].get("namespace", "default") == ns
                     and s["spec"].get("clusterIP") == "None" and _selects(s, labels)]
        if published:
            host = f"{name}-{i}.{subdomain}.{ns}"
            pod.dns = [f"{host}.svc.cluster.local", f"{host}.svc", host]
        pods.append(pod)
    return pods


def pods_of(docs: list[dict]) -> list[Pod]:
    """Every pod the manifests make, resolved; DNS names not yet replaced."""
    secrets = {(d["metadata"].get("namespace", "default"), d["metadata"]["name"]): d["data"]
               for d in docs if d["kind"] == "Secret"}
    services = [d for d in docs if d["kind"] == "Service"]
    pods: list[Pod] = []
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            pods += _pytorchjob_pods(doc)
        elif doc["kind"] == "Job":
            pods += _job_pods(doc, services)
    for pod in pods:
        resolve(pod, secrets)
    return pods


def localize(pods: list[Pod], prefix: Optional[str] = None) -> dict[str, str]:
    """Give each pod a loopback address and replace every DNS name in every pod's variables and
    command by its pod's address; returns {name: address}."""
    prefix = prefix or f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
    names = {}
    for n, pod in enumerate(pods, start=1):
        for dns in pod.dns:
            names[dns] = f"{prefix}.{n}"
    if not names:
        return names
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(
        re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")(?![\w.-])")
    swap = lambda text: pattern.sub(lambda m: names[m.group(1)], text)  # noqa: E731
    for pod in pods:
        pod.env = {k: swap(v) for k, v in pod.env.items()}
        pod.command = [swap(a) for a in pod.command]
    return names


def _argv(command: list[str]) -> list[str]:
    head = {"fleetrun": [sys.executable, "-m", "fleetx.launch"], "python": [sys.executable],
            "python3": [sys.executable]}
    if command[0] not in head:
        raise ValueError(f"no local stand-in for the image's {command[0]!r}")
    return head[command[0]] + command[1:]


def run(docs: list[dict], workdir: Path, timeout: float = 120.0) -> dict[str, tuple[int, str]]:
    """Start every pod of ``docs`` as a process (cwd ``workdir/<pod>``), wait for all; returns
    {pod name: (exit code, its output)}.

    Raises:
        TimeoutError: a pod still runs after ``timeout`` seconds (all are killed; the message
            holds each pod's output).
    """
    pods = pods_of(docs)
    localize(pods)
    procs = {}
    for pod in pods:
        folder = Path(workdir) / pod.name
        folder.mkdir(parents=True, exist_ok=True)
        child = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        child.update(pod.env, OMP_NUM_THREADS="1")
        out = open(folder / "output", "wb")
        # a session of its own: a pod that outlives the deadline goes with all it started
        procs[pod.name] = (subprocess.Popen(_argv(pod.command), cwd=folder, env=child,
                                            stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True), out, folder)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _, _ in procs.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("pods still running after %.0f s:\n%s" % (timeout, "\n".join(
                    f"--- {n}:\n{(f / 'output').read_text()[-3000:]}"
                    for n, (_, _, f) in procs.items())))
            time.sleep(0.1)
    finally:
        for p, out, _ in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the pod's fleetrun and its children
                p.wait()
            out.close()
    return {n: (p.returncode, (f / "output").read_text()) for n, (p, _, f) in procs.items()}
