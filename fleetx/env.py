"""The launcher <-> process environment contract.

Every environment variable that ``fleetrun`` writes and a training process reads is declared
here, once: its name, its type and default, what it means, who writes it and who reads it, and
its counterpart under torchrun, Kubeflow and Slurm. No other module touches ``os.environ``; they
call the typed readers below (which name the variable in every error) or :func:`snapshot`. A
reader takes no default of its own: an unset variable reads as the default declared here, so
each default is written once.

``docs/environment.md`` is the human-readable form of :data:`VARIABLES`; a unit test keeps the two
in step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, Optional

__all__ = [
    "EnvVar", "EnvError", "VARIABLES", "get", "get_int", "get_float", "get_limit", "get_list",
    "is_set", "default", "timeout", "snapshot", "apply", "environ",
]

#: the types a variable may be declared with, and how the docs name them
KINDS: Mapping[type, str] = {str: "text", int: "int", float: "number", list: "comma list"}


class EnvError(ValueError):
    """A launcher variable is missing, malformed or inconsistent with another one."""


@dataclass(frozen=True)
class EnvVar:
    """One variable of the contract.

    Attributes:
        name: the variable's name.
        meaning: what the value says.
        writer: who sets it (``fleetrun``, ``torchrun``, ``user``...).
        reader: which part of fleetx reads it.
        counterparts: the matching variable under torchrun / Kubeflow / Slurm, if any.
        secret: its value must never be shown (:func:`snapshot` leaves it out).
        kind: its type, one of :data:`KINDS`: the typed reader that reads it (``get_int`` an
            ``int``; ``get_float`` and ``get_limit`` an ``int`` or a ``float``; ``get_list`` a
            ``list``; ``get`` and ``is_set`` any, as text).
        default: what an unset (or empty) variable reads as; None: nothing (a ``list`` reads
            as empty).

    Raises:
        TypeError: an unknown kind, or a default that is not of the kind.
    """

    name: str
    meaning: str
    writer: str
    reader: str
    counterparts: str = ""
    secret: bool = False
    kind: type = str
    default: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TypeError(f"{self.name}: kind {self.kind!r} is not one of "
                            f"{', '.join(k.__name__ for k in KINDS)}")
        if self.default is not None and (self.kind is list or type(self.default) is not self.kind):
            raise TypeError(f"{self.name}: default {self.default!r} is not a "
                            f"{self.kind.__name__}")


def _v(name: str, meaning: str, writer: str, reader: str, counterparts: str = "",
       secret: bool = False, kind: type = str, default: Any = None) -> EnvVar:
    return EnvVar(name, meaning, writer, reader, counterparts, secret, kind, default)


_ROLE = "role_maker"
_ROLE_BOOT = "role_maker, launch bootstrap"
_CLUSTER = "role_maker (fleetx.clusters)"
_VARS = [
    # --- collective, Paddle names -------------------------------------------------------------
    _v("PADDLE_TRAINER_ID", "global rank of this trainer (PS: index among workers)",
       "fleetrun", _ROLE, "torchrun RANK; Kubeflow RANK; Slurm SLURM_PROCID", kind=int),
    _v("PADDLE_TRAINERS_NUM", "number of trainers (workers)", "fleetrun", _ROLE,
       "torchrun WORLD_SIZE; Kubeflow WORLD_SIZE; Slurm SLURM_NTASKS", kind=int),
    _v("PADDLE_TRAINER_ENDPOINTS", "comma list ip:port of every trainer, in rank order",
       "fleetrun", _ROLE, "none (torchrun exposes only the master)", kind=list),
    _v("PADDLE_CURRENT_ENDPOINT", "ip:port of this trainer", "fleetrun", "user scripts", "none"),
    _v("PADDLE_RANK_IN_NODE", "rank of this process on its node", "fleetrun", _ROLE,
       "torchrun LOCAL_RANK; Slurm SLURM_LOCALID", kind=int),
    _v("PADDLE_LOCAL_DEVICE_IDS", "devices of this process, comma list", "fleetrun", _ROLE,
       "CUDA_VISIBLE_DEVICES (per process)"),
    _v("PADDLE_WORLD_DEVICE_IDS", "devices of every process: ':' within one, ',' between",
       "fleetrun", _ROLE, "none"),
    _v("PADDLE_TRAINING_ROLE", "collective role, always TRAINER", "fleetrun", _ROLE, "none",
       default="TRAINER"),
    _v("PADDLE_DISTRI_BACKEND", "communication backend: gloo or nccl", "fleetrun",
       "fleet (process group)", "torchrun: chosen by the script", default="auto"),
    _v("FLAGS_selected_gpus", "GPU ids of this process (Paddle name, informative)", "fleetrun",
       "user scripts", "CUDA_VISIBLE_DEVICES"),
    # --- torchrun / elastic names (also written by fleetrun, which runs the elastic agent) ------
    _v("RANK", "global rank", "fleetrun, torchrun, Kubeflow", _ROLE_BOOT,
       "Slurm SLURM_PROCID; Paddle PADDLE_TRAINER_ID", kind=int),
    _v("WORLD_SIZE", "number of processes", "fleetrun, torchrun, Kubeflow", _ROLE_BOOT,
       "Slurm SLURM_NTASKS; Paddle PADDLE_TRAINERS_NUM", kind=int),
    _v("LOCAL_RANK", "rank on this node", "fleetrun, torchrun", _ROLE_BOOT,
       "Slurm SLURM_LOCALID; Paddle PADDLE_RANK_IN_NODE", kind=int),
    _v("LOCAL_WORLD_SIZE", "processes on this node", "fleetrun, torchrun", _ROLE_BOOT,
       "Slurm SLURM_NTASKS_PER_NODE", kind=int),
    _v("GROUP_RANK", "index of this node", "fleetrun, torchrun", "launch bootstrap, user scripts",
       "Slurm SLURM_NODEID", kind=int),
    _v("MASTER_ADDR", "address of the rendezvous store (rank 0's node)",
       "fleetrun, torchrun, Kubeflow", "fleet (process group), launch bootstrap",
       "Slurm: first host of the job"),
    _v("MASTER_PORT", "port of the rendezvous store", "fleetrun, torchrun, Kubeflow",
       "fleet (process group), launch bootstrap", "none", kind=int),
    _v("TORCHELASTIC_RESTART_COUNT", "how many times the worker group was restarted",
       "torch elastic agent", "fleet (process group), launch bootstrap, user scripts", "none",
       kind=int, default=0),
    _v("TORCHELASTIC_USE_AGENT_STORE", "True: the elastic agent already serves the store at "
       "MASTER_ADDR:MASTER_PORT and every rank connects to it as a client", "torch elastic agent",
       "fleet (process group), launch bootstrap", "none"),
    # --- cluster launchers (read, never written: fleetx.clusters, docs/clusters.md) ----------
    _v("SLURM_PROCID", "global rank of this task", "srun", _CLUSTER, "torchrun RANK", kind=int),
    _v("SLURM_NTASKS", "number of tasks of the job step", "srun", _CLUSTER, "torchrun WORLD_SIZE",
       kind=int),
    _v("SLURM_LOCALID", "rank of this task on its node", "srun", _CLUSTER, "torchrun LOCAL_RANK",
       kind=int, default=0),
    _v("SLURM_NODEID", "index of this task's node in the step", "srun", _CLUSTER,
       "torchrun GROUP_RANK", kind=int, default=0),
    _v("SLURM_STEP_NODELIST", "nodes of the job step, in Slurm's compressed host-list syntax; "
       "the first runs task 0 and serves the rendezvous unless MASTER_ADDR is set", "srun",
       _CLUSTER, "torchrun MASTER_ADDR"),
    _v("SLURM_JOB_NODELIST", "nodes of the job (used when SLURM_STEP_NODELIST is unset)",
       "sbatch, salloc, srun", _CLUSTER, "torchrun MASTER_ADDR"),
    _v("SLURM_NODELIST", "older name of SLURM_JOB_NODELIST", "sbatch, salloc, srun", _CLUSTER,
       "torchrun MASTER_ADDR"),
    _v("SLURM_NTASKS_PER_NODE", "tasks per node, when --ntasks-per-node was given", "srun",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE", kind=int),
    _v("SLURM_STEP_TASKS_PER_NODE", "tasks on each node of the step, e.g. 2(x3),1", "srun",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE"),
    _v("SLURM_TASKS_PER_NODE", "tasks on each node, e.g. 2(x3),1 (used when "
       "SLURM_STEP_TASKS_PER_NODE is unset)", "sbatch, salloc, srun", _CLUSTER,
       "torchrun LOCAL_WORLD_SIZE"),
    _v("SLURM_HET_SIZE", "components of a heterogeneous job (refused: they number their tasks "
       "apart)", "sbatch, salloc, srun", _CLUSTER, "-", kind=int),
    _v("SLURM_JOB_ID", "the job's id: the rendezvous port is 20000 + (id mod 10000) when "
       "MASTER_PORT is unset", "sbatch, salloc, srun", _CLUSTER, "torchrun MASTER_PORT",
       kind=int),
    _v("OMPI_COMM_WORLD_RANK", "global rank", "Open MPI mpirun", _CLUSTER, "torchrun RANK",
       kind=int),
    _v("OMPI_COMM_WORLD_SIZE", "number of processes", "Open MPI mpirun", _CLUSTER,
       "torchrun WORLD_SIZE", kind=int),
    _v("OMPI_COMM_WORLD_LOCAL_RANK", "rank on this node", "Open MPI mpirun", _CLUSTER,
       "torchrun LOCAL_RANK", kind=int, default=0),
    _v("OMPI_COMM_WORLD_LOCAL_SIZE", "processes on this node", "Open MPI mpirun", _CLUSTER,
       "torchrun LOCAL_WORLD_SIZE", kind=int),
    _v("PMI_RANK", "global rank", "MPICH / Intel MPI mpirun (Hydra); srun --mpi=pmi2 too",
       _CLUSTER, "torchrun RANK", kind=int),
    _v("PMI_SIZE", "number of processes", "MPICH / Intel MPI mpirun (Hydra); srun --mpi=pmi2 too",
       _CLUSTER, "torchrun WORLD_SIZE", kind=int),
    _v("MPI_LOCALRANKID", "rank on this node", "MPICH / Intel MPI mpirun (Hydra)", _CLUSTER,
       "torchrun LOCAL_RANK", kind=int, default=0),
    _v("MPI_LOCALNRANKS", "processes on this node", "MPICH / Intel MPI mpirun (Hydra)",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE", kind=int),
    # --- parameter server -----------------------------------------------------------------------
    _v("TRAINING_ROLE", "PS role of this process: TRAINER, PSERVER or HETER_TRAINER (a heter "
       "worker, docs/heter.md)", "fleetrun (PS)", _ROLE, "none (TF: TF_CONFIG task type)"),
    _v("PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST", "comma list ip:port of every heter worker, in "
       "index order (every process of a job with heter workers; a heter worker listens on its "
       "entry, trainer r talks to entry r mod N)", "fleetrun (PS, --heter_worker_num / "
       "--heter_workers)", _ROLE, "none", kind=list),
    _v("PADDLE_HETER_TRAINER_IP_PORT_LIST", "Paddle 2.0's name of the heter workers' list; "
       "fleetrun writes both, and when both are set they must agree", "fleetrun (PS, heter "
       "workers)", _ROLE, "none", kind=list),
    _v("PADDLE_PSERVERS_IP_PORT_LIST", "comma list ip:port of every server", "fleetrun (PS)",
       _ROLE, "none (TF: TF_CONFIG cluster.ps)", kind=list),
    _v("POD_IP", "IP of this process's host (in the manifests of fleetrun --k8s: the pod's DNS "
       "name, <job>-<index>.<service>.<namespace>.svc)", "fleetrun (PS), fleetrun --k8s", _ROLE,
       "Kubernetes downward API"),
    _v("POD_NAME", "this pod's name, from the downward API (metadata.name): in the PyTorchJob of "
       "fleetrun --k8s each pod passes it to fleetrun as --host, the name by which the other pods "
       "reach it", "Kubernetes (fleetrun --k8s manifests)", "Kubernetes $(...) expansion of the "
       "pod's command", "Kubeflow: pod <job>-<type>-<index>"),
    _v("JOB_COMPLETION_INDEX", "this pod's index in its indexed Job (the downward API reads the "
       "batch.kubernetes.io/job-completion-index annotation): the parameter-server manifests of "
       "fleetrun --k8s build POD_IP and PADDLE_TRAINER_ID from it", "Kubernetes (indexed Job; "
       "fleetrun --k8s manifests)", "Kubernetes $(...) expansion of the pod's variables",
       "Slurm SLURM_PROCID (per role)", kind=int),
    _v("PADDLE_PORT", "port of this process (servers and heter workers listen on it)",
       "fleetrun (PS)", _ROLE, "none", kind=int),
    # --- fleetx's own ----------------------------------------------------------------------------
    _v("FLEETX_LOG_DIR", "folder of the per-process logs (a rank whose collective fails leaves "
       "fault.<rank>.json there, naming the rank at fault, for fleetrun's report; each rank "
       "records its optimizer steps and last checkpoint in progress.<rank>, from which fleetrun "
       "says what a restart loses)", "fleetrun", "user scripts, comm, fleet", "none"),
    _v("FLEETX_TIMEOUT", "seconds a collective or PS request may wait for a peer, a dataset's "
       "pipe commands may stay silent, and fleetrun for the other nodes at the rendezvous",
       "user", "fleet, ps, data, fleetrun, launch bootstrap",
       "TORCH_NCCL_ASYNC_ERROR_HANDLING + init timeout", kind=int, default=300),
    _v("FLEETX_DEBUG_COLLECTIVES", "1: before each collective fleetx makes (DDP's gradient "
       "all-reduce, fleet.util, barrier_worker), every rank of the group checks through the "
       "rendezvous store that all make the same call (operation, shapes, dtypes): a divergence "
       "is an error on every rank naming the rank and both calls, a rank that does not come is "
       "named after FLEETX_TIMEOUT; one store write and read per collective", "user", "comm",
       "TORCH_DISTRIBUTED_DEBUG=DETAIL (not for DDP over gloo in torch 2.13)", default="0"),
    _v("FLEETX_STRAGGLER_WINDOW", "optimizer steps between the ranks' exchanges of their median "
       "busy step time (one all-gather of a number on a gloo group); rank 0 names a rank at 1.5x "
       "the median of the others in the log; 0 turns the exchange off", "user", "fleet", "none",
       kind=int, default=20),
    _v("FLEETX_FAULT_TOLERANCE", "heal: the process runs under fleetrun --fault_tolerance heal "
       "(a dead data-parallel rank is restarted alone and the others go on); restart or unset: "
       "a failure restarts the whole worker group", "fleetrun", "fleet (comm.heal)", "none",
       default="restart"),
    _v("FLEETX_HEAL_RESTARTS", "under --fault_tolerance heal: how many times fleetrun restarted "
       "this rank alone before this process (0: one of the first processes; more: it joins the "
       "live ranks)", "fleetrun", "fleet (comm.heal)", "none", kind=int, default=0),
    _v("FLEETX_HEAL_TIMEOUT", "under --fault_tolerance heal: seconds a rank may send no "
       "heartbeat before fleetrun declares it frozen and kills it (it is then healed as a dead "
       "one)", "user", "fleetrun, fleet (comm.heal)", "none", kind=float, default=10.0),
    _v("FLEETX_LOG_INTERVAL", "seconds between the progress lines of parameter-server workers "
       "(samples/s, loss) and servers (rows, memory, requests/s), and of dataset loads (lines/s); "
       "0 turns them off", "user", "ps runtime, data", "none", kind=float, default=10.0),
    _v("FLEETX_PS_HEARTBEAT_INTERVAL", "seconds between heartbeats on an idle parameter-server "
       "connection", "user", "ps runtime", "none", kind=float, default=3.0),
    _v("FLEETX_PS_DEAD_AFTER", "seconds of silence after which a parameter server or worker is "
       "declared lost, naming it (it must exceed the heartbeat interval)", "user",
       "ps runtime", "none", kind=float, default=15.0),
    _v("FLEETX_PS_SAVE_ROOT", "folder parameter servers save checkpoints under and load them "
       "from; a SAVE or init_server(dirname) outside it is refused (unset: the server's working "
       "directory)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_MAX_LR", "largest learning rate a parameter server accepts from set_lr or an LR "
       "scheduler", "user", "ps runtime", "none", kind=float, default=10.0),
    _v("FLEETX_PS_MAX_ROWS", "sparse rows one parameter server may hold per table; requests that "
       "would create more are refused (0: no limit)", "user", "ps runtime", "none", kind=int,
       default=0),
    _v("FLEETX_PS_NONFINITE", "what a parameter server does with a push holding NaN or inf: "
       "refuse (an error naming the table) or skip (drop that worker's push for the "
       "step and count it)", "user", "ps runtime", "none", default="refuse"),
    _v("FLEETX_PS_SECRET", "shared secret every parameter-server connection must prove it "
       "holds (mutual HMAC challenge-response; it never travels and is never printed); fleetrun "
       "generates one per job when neither this nor FLEETX_PS_SECRET_FILE is set. Without "
       "either, servers listen only on loopback addresses", "fleetrun (PS), user", "ps runtime",
       "none", secret=True),
    _v("FLEETX_PS_SECRET_FILE", "file holding the shared secret (surrounding whitespace is "
       "ignored), read when a connection is made; fleetrun --ps_secret_file sets it. Give "
       "every node the same file", "fleetrun --ps_secret_file, user", "ps runtime", "none"),
    _v("FLEETX_PS_MAX_FRAME_MB", "largest parameter-server message payload in MiB a process "
       "sends or accepts; a peer announcing more is disconnected before anything is allocated",
       "user", "ps runtime", "none", kind=float, default=1024.0),
    _v("FLEETX_PS_TRANSPORT", "parameter-server transport: tcp (fleetx's own "
       "authenticated links) or zmq (pyzmq, the bench extra; no authentication, so "
       "servers and workers refuse any non-loopback endpoint: it exists to measure the two "
       "against each other); any other value is an error naming the choices", "user",
       "ps runtime", "none", default="tcp"),
    _v("FLEETX_PS_LOCAL_SOCKETS", "1: a parameter server also listens on a "
       "Unix-domain socket in a folder only its user can enter, and workers and heter workers on "
       "the same machine connect through it (same handshake and frames, no TCP/IP processing); "
       "0: TCP only", "user", "ps runtime", "none", default="1"),
    _v("FLEETX_PS_CHECKPOINT_DIR", "parameter-server failover is on: each server snapshots its "
       "shard into <this>/server-<i>-of-<n>/, a restarted server loads its latest snapshot, and "
       "workers reconnect to a lost server (fleetrun --max_restarts in a PS job: "
       "--checkpoint_dir, default <log_dir>/ps_snapshots)", "fleetrun (PS --max_restarts)",
       "ps runtime", "none"),
    _v("FLEETX_PS_CHECKPOINT_INTERVAL", "seconds between a parameter server's snapshots under "
       "failover (fleetrun --checkpoint_interval)", "fleetrun (PS --max_restarts)",
       "ps runtime", "none", kind=float, default=30.0),
    _v("FLEETX_PS_JOB_ID", "the parameter-server job's id under failover: a restarted server "
       "loads only this job's snapshots", "fleetrun (PS --max_restarts)", "ps runtime", "none",
       default=""),
    _v("FLEETX_AUTO_MEMORY_MB", "memory budget per rank in MiB for strategy.auto: it keeps the "
       "fastest measured plan whose parameter, gradient, optimizer and saved-for-backward bytes "
       "per rank fit (unset: the device's free memory plus what the model already holds)",
       "user", "strategy.auto (through the world object)", "none", kind=float),
    _v("FLEETX_DRY_RUN", "1: print the plan at distributed_optimizer and exit 0 before any "
       "communication", "fleetrun --dry-run", "fleet", "none"),
    _v("FLEETX_TTY", "1 when fleetrun's own stdout is a terminal, else 0: rank 0's (worker 0's) "
       "output is shown there live, so its progress bar may redraw with carriage returns",
       "fleetrun", "user scripts, fleet.observe (draws its bar)", "none"),
    _v("CUDA_VISIBLE_DEVICES", "GPUs this process may use", "fleetrun --gpus, user",
       "torch", "same everywhere", kind=list),
    _v("OMP_NUM_THREADS", "intra-op threads per process (fleetrun sets 1 when it starts several "
       "processes on one node and the user has not set it)", "fleetrun, user", "torch",
       "same everywhere", kind=int),
    _v("GLOO_SOCKET_IFNAME", "network interface gloo binds to (fleetrun sets the interface of "
       "the node's address in a multi-node collective job, and the interface of each process's "
       "address in a parameter-server job on several nodes, when the user has not set it)",
       "fleetrun, user", "gloo (torch.distributed)", "same everywhere"),
    _v("NCCL_SOCKET_IFNAME", "network interface NCCL bootstraps on (set like GLOO_SOCKET_IFNAME)",
       "fleetrun, user", "NCCL (torch.distributed)", "same everywhere"),
]

#: Every variable of the contract, by name.
VARIABLES: Mapping[str, EnvVar] = {v.name: v for v in _VARS}

#: The mapping the readers use; tests may pass their own instead.
environ: MutableMapping[str, str] = os.environ


def _declared(name: str, *kinds: type) -> EnvVar:
    """The declaration of ``name``; with ``kinds``, one of them must be its kind.

    Raises:
        KeyError: ``name`` is not declared (the message names it and lists the known ones).
        TypeError: it is declared with another kind (the message names the reader to use).
    """
    var = VARIABLES.get(name)
    if var is None:
        raise KeyError(f"{name} is not part of the fleetx environment contract "
                       f"(known: {', '.join(sorted(VARIABLES))})")
    if kinds and var.kind not in kinds:
        raise TypeError(f"{name} is declared as {var.kind.__name__} in fleetx/env.py; read it "
                        f"with {_READERS[var.kind]}")
    return var


_READERS = {str: "env.get", int: "env.get_int", float: "env.get_float", list: "env.get_list"}


def _raw(name: str, env: Optional[Mapping[str, str]]) -> Optional[str]:
    """The stripped value of a declared variable, or None when unset or empty."""
    value = (env if env is not None else environ).get(name, "").strip()
    return value or None


def default(name: str) -> Any:
    """The default declared for ``name`` (None when it has none).

    Raises:
        KeyError: ``name`` is not declared.

    Example:
        >>> default("FLEETX_TIMEOUT")
        300
    """
    return _declared(name).default


def is_set(name: str, *, env: Optional[Mapping[str, str]] = None) -> bool:
    """True if ``name`` is present and non-empty.

    Raises:
        KeyError: ``name`` is not declared.
    """
    _declared(name)
    return _raw(name, env) is not None


def get(name: str, *, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The value of ``name`` as text (stripped); unset or empty: its declared default as text,
    or None.

    Raises:
        KeyError: ``name`` is not declared.
    """
    var = _declared(name)
    value = _raw(name, env)
    if value is not None or var.default is None:
        return value
    return var.default if isinstance(var.default, str) else f"{var.default:g}"


def get_int(name: str, *, env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The value of ``name`` (declared ``int``) as an int; unset: its declared default.

    Raises:
        EnvError: the value is not an integer (the message names the variable and the value).
        KeyError / TypeError: ``name`` is not declared, or not as an ``int``.
    """
    var = _declared(name, int)
    raw = _raw(name, env)
    if raw is None:
        return var.default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r} is not an integer") from None


def get_float(name: str, *, env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The value of ``name`` (declared ``float`` or ``int``) as a float; unset: its declared
    default.

    Raises:
        EnvError: the value is not a number (the message names the variable and the value).
        KeyError / TypeError: ``name`` is not declared, or not as a number.
    """
    var = _declared(name, float, int)
    raw = _raw(name, env)
    if raw is None:
        return None if var.default is None else float(var.default)
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r} is not a number") from None


def get_limit(name: str, *, env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The value of ``name`` as a time limit: seconds (> 0), or None for 0 (no limit); unset:
    its declared default (None, no limit, when it has none).

    Raises:
        EnvError: not a number, negative, or not finite (the message names the variable and
            the valid values).
        KeyError / TypeError: ``name`` is not declared, or not as a number.

    Example:
        >>> get_limit("FLEETX_TIMEOUT", env={"FLEETX_TIMEOUT": "0"}) is None
        True
    """
    value = get_float(name, env=env)
    if value is None:
        return None
    if not 0 <= value < math.inf:
        raise EnvError(f"environment variable {name}={get(name, env=env)!r}: "
                       "expected 0 (no limit) or a number of seconds > 0")
    return value if value > 0 else None


def get_list(name: str, *, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The comma-separated value of ``name`` (declared ``list``) as a list (empty when unset).

    Raises:
        KeyError / TypeError: ``name`` is not declared, or not as a ``list``.
    """
    _declared(name, list)
    raw = _raw(name, env)
    return [item.strip() for item in raw.split(",") if item.strip()] if raw else []


def timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """``FLEETX_TIMEOUT``: the seconds a rendezvous, a collective or a parameter-server request
    may wait for a peer, a whole number above 0.

    Raises:
        EnvError: it is not an integer, or not above 0.
    """
    value = get_int("FLEETX_TIMEOUT", env=env)
    if value <= 0:
        raise EnvError(f"FLEETX_TIMEOUT={value} must be > 0 seconds")
    return float(value)


def snapshot(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The contract's variables that are set, as a plain dict (for logs and tables); secrets
    are left out."""
    src = env if env is not None else environ
    return {name: src[name] for name, var in VARIABLES.items()
            if src.get(name) and not var.secret}


def apply(values: Mapping[str, str], env: Optional[MutableMapping[str, str]] = None) -> None:
    """Write contract variables into ``env`` (the process environment by default)."""
    target = env if env is not None else environ
    for name, value in values.items():
        _declared(name)
        target[name] = str(value)


def _shown_default(var: EnvVar) -> str:
    if var.default is None:
        return "—"
    if var.default == "":
        return "empty"
    return f"`{var.default if isinstance(var.default, str) else format(var.default, 'g')}`"


def markdown_table() -> str:
    """The contract as a Markdown table (the body of ``docs/environment.md``)."""
    rows = ["| variable | type | default | meaning | written by | read by | "
            "torchrun / Kubeflow / Slurm |",
            "|---|---|---|---|---|---|---|"]
    for v in _VARS:
        rows.append(f"| `{v.name}` | {KINDS[v.kind]} | {_shown_default(v)} | {v.meaning} | "
                    f"{v.writer} | {v.reader} | {v.counterparts or '—'} |")
    return "\n".join(rows)
