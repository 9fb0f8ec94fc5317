"""``LaunchConfig``: everything fleetrun was asked to do, typed and validated.

Each field carries its flag's help text, its group and a parser from the command-line string;
``cli.py`` generates the argument parser from these fields, so a new flag is one new field here.
The config never reads the environment: what the environment says is resolved by the
controllers, which may probe the machine.

Example:
    >>> cfg = LaunchConfig(training_script="train.py", nproc_per_node="2", backend="gloo")
    >>> cfg.nproc_per_node, cfg.resolved_mode().value
    (2, 'collective')
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from fleetx.launch.api import ConfigError, RunMode

__all__ = ["LaunchConfig", "BACKENDS", "RUN_MODES", "PS_FIELDS", "K8S_FORMATS", "K8S_FIELDS"]

BACKENDS = ("auto", "gloo", "nccl")
FAULT_TOLERANCES = ("restart", "heal")
RUN_MODES = tuple(m.value for m in RunMode)
K8S_FORMATS = ("yaml", "json")
#: Flags that only mean something with ``--k8s``.
K8S_FIELDS = ("image", "namespace", "name")
#: Fields whose presence selects parameter-server mode when ``--run_mode`` is not given.
PS_FIELDS = ("server_num", "worker_num", "servers", "workers", "heter_worker_num",
             "heter_workers")


# -- parsers (command-line string -> value) and checks (value -> problem or None) --------------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid int value: {text!r}") from None


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(text: str) -> float:
    """Seconds from ``30``, ``30s``, ``2.5m`` or ``1h``."""
    t = text.strip().lower()
    scale = _UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise ValueError(f"invalid duration {text!r}: expected seconds, or a number followed by "
                         "s, m or h (30, 30s, 2.5m, 1h)") from None
    return value


def _positive(value: Any) -> Optional[str]:
    if value is None:
        return None
    return None if value == value and 0 < value < float("inf") else \
        f"must be a finite duration > 0, got {value!r}"


def _items(text: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in text.split(","))
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"{text!r} is not a comma-separated list (empty item)")
    return items


def _at_least(low: int) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            return f"expected an int, got {value!r}"
        return None if value >= low else f"must be >= {low}, got {value}"
    return check


def _one_of(choices: tuple[str, ...], optional: bool = False) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        if value is None and optional:
            return None
        if value in choices:
            return None
        return f"invalid choice {value!r} (choose from {', '.join(choices)})"
    return check


def _unique_items(value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        return f"expected a comma-separated list, got {value!r}"
    dupes = sorted({v for v in value if value.count(v) > 1})
    return f"lists {', '.join(dupes)} more than once" if dupes else None


def _host_port(value: Any) -> Optional[str]:
    if value is None:
        return None
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"expected host:port with a port in 1..65535, got {value!r}"
    return None


def _node_range(value: Any) -> Optional[str]:
    if value is None:
        return None
    parts = str(value).split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        return f"expected N or MIN:MAX (positive ints), got {value!r}"
    low, high = int(parts[0]), int(parts[-1])
    if low < 1 or high < low:
        return f"expected 1 <= MIN <= MAX, got {value!r}"
    return None


def _k8s_label(pattern: str, what: str, rules: str) -> Callable[[Any], Optional[str]]:
    """A check that a value (when given) is a Kubernetes label matching ``pattern``."""
    def check(value: Any) -> Optional[str]:
        if value is None or re.fullmatch(pattern, str(value)):
            return None
        return f"{value!r} is not a Kubernetes {what}: lower-case letters, digits and '-', {rules}"
    return check


# A name that prefixes pod host names: an RFC 1035 label of at most 40 characters (a pod's host
# name, ``<name>-worker-<index>``, must stay within 63).
_dns_label = _k8s_label(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", "name",
                        "starting with a letter, not ending with '-', at most 40 characters")
# A namespace: an RFC 1123 label (at most 63 characters, may start with a digit).
_namespace = _k8s_label(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", "namespace",
                        "not starting or ending with '-', at most 63 characters")


def _ranks(text: str) -> Any:
    """``all``, or comma-separated ranks as a sorted tuple of ints."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return tuple(sorted({int(item) for item in _items(text)}))
    except ValueError:
        raise ValueError(f"expected 'all' or comma-separated ranks such as 0,1, got {text!r}") \
            from None


def _rank_list(value: Any) -> Optional[str]:
    if value is None or value == "all":
        return None
    if not isinstance(value, tuple) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return f"expected 'all' or ranks >= 0, got {value!r}"
    return None


def _endpoint_list(value: Any) -> Optional[str]:
    if value is None:
        return None
    bad = [item for item in value if ":" in item and _host_port(item)]
    return f"bad endpoint(s) {', '.join(bad)} (expected ip or ip:port)" if bad else None


def _flag(help: str, default: Any = None, *, group: str = "base", parse: Callable = str,
          check: Optional[Callable[[Any], Optional[str]]] = None, aliases: tuple = (),
          metavar: Optional[str] = None, positional: bool = False,
          rest: bool = False, switch: bool = False) -> Any:
    """A field with its command-line facts; ``rest`` takes every remaining argument; a
    ``switch`` is an on/off flag that takes no value."""
    return field(default=default, metadata={
        "help": help, "group": group, "parse": parse, "check": check, "aliases": aliases,
        "metavar": metavar, "positional": positional, "rest": rest, "switch": switch})


@dataclass(frozen=True)
class LaunchConfig:
    """What fleetrun was asked to launch. Strings are parsed as on the command line.

    Raises:
        ConfigError: on construction, for a bad value or a contradiction; the message names
            the flag and, where there is a fixed set, the valid choices.
    """

    training_script: str = _flag(
        "the script every process runs (with `python -u`); with -m, a module name",
        None, positional=True)
    training_script_args: tuple[str, ...] = _flag(
        "arguments passed on to the training script", (), positional=True, rest=True,
        parse=lambda s: (s,))
    nproc_per_node: Optional[int] = _flag(
        "processes on each node; default: one per GPU in --gpus (or visible), else 1",
        parse=_int, check=_at_least(1), metavar="N")
    gpus: Optional[tuple[str, ...]] = _flag(
        "GPU ids to use, comma-separated, one process per GPU; default: every visible GPU",
        parse=_items, check=_unique_items, aliases=("--selected_gpus",), metavar="IDS")
    log_dir: str = _flag(
        "folder of the per-process logs workerlog.N and endpoints.log", "log", metavar="DIR")
    backend: str = _flag(
        "communication backend; auto: nccl when the processes have GPUs, else gloo", "auto",
        check=_one_of(BACKENDS), metavar="{" + ",".join(BACKENDS) + "}")
    run_mode: Optional[str] = _flag(
        "collective or ps; default: ps when a parameter-server flag is given, else collective",
        check=_one_of(RUN_MODES, optional=True), metavar="{" + ",".join(RUN_MODES) + "}")
    dry_run: bool = _flag(
        "run the script once as rank 0 of the requested world (worker 0 of a parameter-server "
        "job), without peers: it prints the plan of strategies at fleet.distributed_optimizer "
        "and exits 0 before any communication",
        False, aliases=("--dry-run",), switch=True, parse=lambda s: s)
    module: bool = _flag(
        "run training_script as a module, as `python -m` would (the current folder first on "
        "sys.path)", False, aliases=("-m",), switch=True, parse=lambda s: s)
    log_ranks: Any = _flag(
        "ranks whose output is shown live here, comma-separated, or all (a parameter-server "
        "job: worker indices); with several, each line starts with [rank N]. Every rank's "
        "output is in its log file either way; default: 0",
        parse=_ranks, check=_rank_list, metavar="RANKS|all")
    tee: bool = _flag(
        "show every rank's output live here, each line starting with [rank N]: the same as "
        "--log_ranks all", False, switch=True, parse=lambda s: s)
    max_restarts: int = _flag(
        "times the whole worker group is restarted after a failure before fleetrun gives up; "
        "in a parameter-server job: turns failover on (servers snapshot their shards, a server "
        "that dies is restarted up to N times from its latest snapshot, workers reconnect; a "
        "worker that dies is restarted up to N times and rejoins)",
        0, parse=_int, check=_at_least(0), metavar="N")
    fault_tolerance: str = _flag(
        "what a failed process costs a collective job: restart (the worker group restarts, up "
        "to --max_restarts times) or heal (one node, data parallel: the other ranks are not "
        "restarted, they go on with the live ones; the dead rank is restarted alone, up to "
        "--max_restarts times, and rejoins at a step boundary; docs/reliability.md)", "restart",
        group="collective", check=_one_of(FAULT_TOLERANCES),
        metavar="{" + ",".join(FAULT_TOLERANCES) + "}")
    ips: tuple[str, ...] = _flag(
        "addresses of every node, comma-separated, in node-rank order; each node finds itself "
        "in the list among its own addresses (or by --host)", ("127.0.0.1",),
        group="collective", parse=_items, check=_unique_items, metavar="IPS")
    host: Optional[str] = _flag(
        "this node's address when it cannot be found automatically in --ips",
        group="collective", metavar="IP")
    nnodes: Optional[str] = _flag(
        "number of nodes, N, or MIN:MAX for an elastic job (torch elastic rendezvous); "
        "default: the number of --ips", group="collective", check=_node_range,
        metavar="N|MIN:MAX")
    master: Optional[str] = _flag(
        "host:port of the rendezvous store; default: the first of --ips with a free port "
        "(single node) or port 6070 (several nodes)", group="collective", check=_host_port,
        metavar="HOST:PORT")
    server_num: Optional[int] = _flag(
        "number of parameter servers; alone: that many on this machine, at free ports of "
        "127.0.0.1; with --servers: must equal its length (selects ps mode)",
        group="parameter server",
        parse=_int, check=_at_least(1), metavar="N")
    worker_num: Optional[int] = _flag(
        "number of trainers (workers); alone: that many on this machine, at free ports of "
        "127.0.0.1; with --workers: must equal its length (selects ps mode)",
        group="parameter server",
        parse=_int, check=_at_least(1), metavar="N")
    servers: Optional[tuple[str, ...]] = _flag(
        "every parameter server of the job as ip:port, comma-separated, in server-index order; "
        "each node starts the ones at its own addresses (selects ps mode)",
        group="parameter server", parse=_items, check=_endpoint_list, metavar="ENDPOINTS")
    workers: Optional[tuple[str, ...]] = _flag(
        "every trainer of the job as ip:port or ip (port 6170 + number of servers + index), "
        "comma-separated, in rank order; each node starts the ones at its own addresses "
        "(selects ps mode)",
        group="parameter server", parse=_items, check=_endpoint_list, metavar="ENDPOINTS")
    heter_worker_num: Optional[int] = _flag(
        "number of heter workers, which run the model's HeterSections for the trainers "
        "(docs/heter.md); alone: that many on this machine, at free ports of 127.0.0.1; with "
        "--heter_workers: must equal its length (selects ps mode)",
        group="parameter server", parse=_int, check=_at_least(1), metavar="N")
    heter_workers: Optional[tuple[str, ...]] = _flag(
        "every heter worker of the job as ip:port, comma-separated, in index order (trainer r "
        "talks to heter worker r mod N); each node starts the ones at its own addresses (selects "
        "ps mode)", group="parameter server", parse=_items, check=_endpoint_list,
        metavar="ENDPOINTS")
    checkpoint_dir: Optional[str] = _flag(
        "with --max_restarts: folder of the servers' snapshots (server-<i>-of-<n>/ each); "
        "default <log_dir>/ps_snapshots", group="parameter server", metavar="DIR")
    checkpoint_interval: Optional[float] = _flag(
        "with --max_restarts: time between a server's snapshots, in seconds or with a unit: "
        "30, 30s, 2.5m, 1h (default 30s)", group="parameter server", parse=_duration,
        check=_positive, metavar="DURATION")
    ps_secret_file: Optional[str] = _flag(
        "file holding the job's shared secret (any text; surrounding whitespace is ignored): "
        "every parameter-server connection must prove it holds it. Give every node's fleetrun "
        "the same file. Without it (and without FLEETX_PS_SECRET / FLEETX_PS_SECRET_FILE) a "
        "single-node job gets a fresh random secret", group="parameter server", metavar="FILE")
    k8s: bool = _flag(
        "print Kubernetes manifests for the job the other flags describe, instead of running it "
        "(a Kubeflow PyTorchJob for a collective job; indexed Jobs, a headless Service and a "
        "Secret for a parameter-server job; docs/kubernetes.md); pipe them to kubectl apply -f -",
        False, group="kubernetes", switch=True, parse=lambda s: s)
    image: Optional[str] = _flag(
        "with --k8s: the container image every pod runs (fleetx, torch and the script inside)",
        group="kubernetes", metavar="IMAGE")
    namespace: Optional[str] = _flag(
        "with --k8s: the namespace of the manifests and of the pods' DNS names (default: "
        "default)", group="kubernetes", check=_namespace, metavar="NS")
    name: Optional[str] = _flag(
        "with --k8s: the job's name, which prefixes every object and pod (default: the "
        "script's name)", group="kubernetes", check=_dns_label, metavar="NAME")
    k8s_format: str = _flag(
        "with --k8s: yaml (documents separated by ---; needs pyyaml, the yaml extra) or json "
        "(one v1 List)", "yaml", group="kubernetes", check=_one_of(K8S_FORMATS),
        metavar="{" + ",".join(K8S_FORMATS) + "}")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = tuple(value)
            if isinstance(value, str) and f.metadata["parse"] is not str:
                try:
                    value = f.metadata["parse"](value)
                except ValueError as exc:
                    raise ConfigError(_flag_name(f.name), str(exc)) from None
            object.__setattr__(self, f.name, value)
            check = f.metadata["check"]
            problem = check(value) if check else None
            if problem:
                raise ConfigError(_flag_name(f.name), problem)
        self._check_combination()
        self._check_k8s()

    def _check_k8s(self) -> None:
        """The Kubernetes flags need --k8s, and --k8s needs an image; which other flags make
        sense with --k8s is for ``fleetx.launch.k8s`` to say (it depends on the run mode)."""
        if not self.k8s:
            for name in K8S_FIELDS + ("k8s_format",):
                if getattr(self, name) not in (None, "yaml"):
                    raise ConfigError(f"--{name}", "only means something with --k8s (which "
                                                   "prints Kubernetes manifests)")
        elif not self.image:
            raise ConfigError("--k8s", "needs --image IMAGE: the container image every pod "
                                       "runs, holding fleetx, torch and the training script")

    def _check_combination(self) -> None:
        if not self.training_script:
            raise ConfigError("training_script", "the script to run is required")
        if self.tee and self.training_script in ("0", "1", "2", "3"):
            # torchrun's --tee takes a stream number; here the number became the script.
            raise ConfigError("--tee", f"takes no value in fleetrun (it shows every rank's "
                                       f"output; each rank's log holds stdout and stderr), but "
                                       f"{self.training_script} followed it: remove the "
                                       f"{self.training_script}")
        if self.tee and self.log_ranks is not None:
            raise ConfigError("--tee", "shows every rank and --log_ranks chooses some: give "
                                       "one of them")
        if self.gpus and self.nproc_per_node and self.nproc_per_node != len(self.gpus):
            raise ConfigError("--nproc_per_node", f"is {self.nproc_per_node} but --gpus lists "
                              f"{len(self.gpus)} GPU(s); fleetrun starts one process per GPU")
        low, high = self.node_range()
        # with --k8s the pods are the nodes: their names, not --ips, list them
        if low == high and self.nnodes is not None and low != len(self.ips) and not self.k8s:
            raise ConfigError("--nnodes", f"is {self.nnodes} but --ips lists {len(self.ips)} "
                              f"node(s) ({','.join(self.ips)}); give every node's address")
        if self.fault_tolerance == "heal" and (high > 1 or self.resolved_mode() is RunMode.PS):
            raise ConfigError("--fault_tolerance", "heal runs collective jobs on one node "
                              "(fleetrun hosts the store and restarts the dead rank itself); "
                              f"this job has {'several nodes' if high > 1 else 'parameter servers'}"
                              f": use --fault_tolerance restart")
        if self.host and low == high > 1 and self.host not in self.ips:
            raise ConfigError("--host", f"{self.host} is not one of --ips ({','.join(self.ips)})")

    # -- derived, pure ----------------------------------------------------------------------
    def resolved_mode(self) -> RunMode:
        """``--run_mode`` if given; else ps when any parameter-server flag is set; else
        collective."""
        if self.run_mode:
            return RunMode(self.run_mode)
        if any(getattr(self, name) for name in PS_FIELDS):
            return RunMode.PS
        return RunMode.COLLECTIVE

    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes; both equal ``len(ips)`` when ``--nnodes`` is not given."""
        if self.nnodes is None:
            return len(self.ips), len(self.ips)
        parts = [int(p) for p in self.nnodes.split(":")]
        return parts[0], parts[-1]

    def shown_ranks(self) -> Any:
        """The ranks whose output is copied live to fleetrun's stdout: ``"all"`` or a tuple of
        ints (``(0,)`` unless ``--log_ranks`` or ``--tee`` says otherwise)."""
        if self.tee:
            return "all"
        return (0,) if self.log_ranks is None else self.log_ranks

    @property
    def is_elastic(self) -> bool:
        """True for ``--nnodes MIN:MAX`` with MIN < MAX: nodes may join and leave."""
        low, high = self.node_range()
        return low < high

    def arguments(self) -> dict[str, str]:
        """Every field as the command line would show it (for the start-up banner)."""
        shown = {f.name: _show(getattr(self, f.name)) for f in fields(self)}
        shown["training_script_args"] = repr(list(self.training_script_args))
        return shown


def _flag_name(name: str) -> str:
    positional = {f.name for f in fields(LaunchConfig) if f.metadata["positional"]}
    return name if name in positional else f"--{name}"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)
