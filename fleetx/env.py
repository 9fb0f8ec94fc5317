"""The launcher <-> process environment contract.

Every environment variable that ``fleetrun`` writes and a training process reads is declared
here, once: its name, what it means, who writes it and who reads it, and its counterpart under
torchrun, Kubeflow and Slurm. No other module touches ``os.environ``; they call the typed
readers below (which name the variable in every error) or :func:`snapshot`.

``docs/environment.md`` is the human-readable form of :data:`VARIABLES`; a unit test keeps the two
in step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

__all__ = [
    "EnvVar", "EnvError", "VARIABLES", "get", "get_int", "get_float", "get_list", "is_set",
    "snapshot", "apply", "environ",
]


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
    """

    name: str
    meaning: str
    writer: str
    reader: str
    counterparts: str = ""
    secret: bool = False


def _v(name: str, meaning: str, writer: str, reader: str, counterparts: str = "",
       secret: bool = False) -> EnvVar:
    return EnvVar(name, meaning, writer, reader, counterparts, secret)


_ROLE = "role_maker"
_ROLE_BOOT = "role_maker, launch bootstrap"
_CLUSTER = "role_maker (fleetx.clusters)"
_VARS = [
    # --- collective, Paddle names -------------------------------------------------------------
    _v("PADDLE_TRAINER_ID", "global rank of this trainer (PS: index among workers)",
       "fleetrun", _ROLE, "torchrun RANK; Kubeflow RANK; Slurm SLURM_PROCID"),
    _v("PADDLE_TRAINERS_NUM", "number of trainers (workers)", "fleetrun", _ROLE,
       "torchrun WORLD_SIZE; Kubeflow WORLD_SIZE; Slurm SLURM_NTASKS"),
    _v("PADDLE_TRAINER_ENDPOINTS", "comma list ip:port of every trainer, in rank order",
       "fleetrun", _ROLE, "none (torchrun exposes only the master)"),
    _v("PADDLE_CURRENT_ENDPOINT", "ip:port of this trainer", "fleetrun", "user scripts", "none"),
    _v("PADDLE_RANK_IN_NODE", "rank of this process on its node", "fleetrun", _ROLE,
       "torchrun LOCAL_RANK; Slurm SLURM_LOCALID"),
    _v("PADDLE_LOCAL_DEVICE_IDS", "devices of this process, comma list", "fleetrun", _ROLE,
       "CUDA_VISIBLE_DEVICES (per process)"),
    _v("PADDLE_WORLD_DEVICE_IDS", "devices of every process: ':' within one, ',' between",
       "fleetrun", _ROLE, "none"),
    _v("PADDLE_TRAINING_ROLE", "collective role, always TRAINER", "fleetrun", _ROLE, "none"),
    _v("PADDLE_DISTRI_BACKEND", "communication backend: gloo or nccl", "fleetrun",
       "fleet (process group)", "torchrun: chosen by the script"),
    _v("FLAGS_selected_gpus", "GPU ids of this process (Paddle name, informative)", "fleetrun",
       "user scripts", "CUDA_VISIBLE_DEVICES"),
    # --- torchrun / elastic names (also written by fleetrun, which runs the elastic agent) ------
    _v("RANK", "global rank", "fleetrun, torchrun, Kubeflow", _ROLE_BOOT,
       "Slurm SLURM_PROCID; Paddle PADDLE_TRAINER_ID"),
    _v("WORLD_SIZE", "number of processes", "fleetrun, torchrun, Kubeflow", _ROLE_BOOT,
       "Slurm SLURM_NTASKS; Paddle PADDLE_TRAINERS_NUM"),
    _v("LOCAL_RANK", "rank on this node", "fleetrun, torchrun", _ROLE_BOOT,
       "Slurm SLURM_LOCALID; Paddle PADDLE_RANK_IN_NODE"),
    _v("LOCAL_WORLD_SIZE", "processes on this node", "fleetrun, torchrun", _ROLE_BOOT,
       "Slurm SLURM_NTASKS_PER_NODE"),
    _v("GROUP_RANK", "index of this node", "fleetrun, torchrun", "launch bootstrap, user scripts",
       "Slurm SLURM_NODEID"),
    _v("MASTER_ADDR", "address of the rendezvous store (rank 0's node)",
       "fleetrun, torchrun, Kubeflow", "fleet (process group), launch bootstrap",
       "Slurm: first host of the job"),
    _v("MASTER_PORT", "port of the rendezvous store", "fleetrun, torchrun, Kubeflow",
       "fleet (process group), launch bootstrap", "none"),
    _v("TORCHELASTIC_RESTART_COUNT", "how many times the worker group was restarted",
       "torch elastic agent", "fleet (process group), launch bootstrap, user scripts", "none"),
    _v("TORCHELASTIC_USE_AGENT_STORE", "True: the elastic agent already serves the store at "
       "MASTER_ADDR:MASTER_PORT and every rank connects to it as a client", "torch elastic agent",
       "fleet (process group), launch bootstrap", "none"),
    # --- cluster launchers (read, never written: fleetx.clusters, docs/clusters.md) ----------
    _v("SLURM_PROCID", "global rank of this task", "srun", _CLUSTER, "torchrun RANK"),
    _v("SLURM_NTASKS", "number of tasks of the job step", "srun", _CLUSTER, "torchrun WORLD_SIZE"),
    _v("SLURM_LOCALID", "rank of this task on its node", "srun", _CLUSTER, "torchrun LOCAL_RANK"),
    _v("SLURM_NODEID", "index of this task's node in the step", "srun", _CLUSTER,
       "torchrun GROUP_RANK"),
    _v("SLURM_STEP_NODELIST", "nodes of the job step, in Slurm's compressed host-list syntax; "
       "the first runs task 0 and serves the rendezvous unless MASTER_ADDR is set", "srun",
       _CLUSTER, "torchrun MASTER_ADDR"),
    _v("SLURM_JOB_NODELIST", "nodes of the job (used when SLURM_STEP_NODELIST is unset)",
       "sbatch, salloc, srun", _CLUSTER, "torchrun MASTER_ADDR"),
    _v("SLURM_NODELIST", "older name of SLURM_JOB_NODELIST", "sbatch, salloc, srun", _CLUSTER,
       "torchrun MASTER_ADDR"),
    _v("SLURM_NTASKS_PER_NODE", "tasks per node, when --ntasks-per-node was given", "srun",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE"),
    _v("SLURM_STEP_TASKS_PER_NODE", "tasks on each node of the step, e.g. 2(x3),1", "srun",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE"),
    _v("SLURM_TASKS_PER_NODE", "tasks on each node, e.g. 2(x3),1 (used when "
       "SLURM_STEP_TASKS_PER_NODE is unset)", "sbatch, salloc, srun", _CLUSTER,
       "torchrun LOCAL_WORLD_SIZE"),
    _v("SLURM_HET_SIZE", "components of a heterogeneous job (refused: they number their tasks "
       "apart)", "sbatch, salloc, srun", _CLUSTER, "-"),
    _v("SLURM_JOB_ID", "the job's id: the rendezvous port is 20000 + (id mod 10000) when "
       "MASTER_PORT is unset", "sbatch, salloc, srun", _CLUSTER, "torchrun MASTER_PORT"),
    _v("OMPI_COMM_WORLD_RANK", "global rank", "Open MPI mpirun", _CLUSTER, "torchrun RANK"),
    _v("OMPI_COMM_WORLD_SIZE", "number of processes", "Open MPI mpirun", _CLUSTER,
       "torchrun WORLD_SIZE"),
    _v("OMPI_COMM_WORLD_LOCAL_RANK", "rank on this node", "Open MPI mpirun", _CLUSTER,
       "torchrun LOCAL_RANK"),
    _v("OMPI_COMM_WORLD_LOCAL_SIZE", "processes on this node", "Open MPI mpirun", _CLUSTER,
       "torchrun LOCAL_WORLD_SIZE"),
    _v("PMI_RANK", "global rank", "MPICH / Intel MPI mpirun (Hydra); srun --mpi=pmi2 too",
       _CLUSTER, "torchrun RANK"),
    _v("PMI_SIZE", "number of processes", "MPICH / Intel MPI mpirun (Hydra); srun --mpi=pmi2 too",
       _CLUSTER, "torchrun WORLD_SIZE"),
    _v("MPI_LOCALRANKID", "rank on this node", "MPICH / Intel MPI mpirun (Hydra)", _CLUSTER,
       "torchrun LOCAL_RANK"),
    _v("MPI_LOCALNRANKS", "processes on this node", "MPICH / Intel MPI mpirun (Hydra)",
       _CLUSTER, "torchrun LOCAL_WORLD_SIZE"),
    # --- parameter server -----------------------------------------------------------------------
    _v("TRAINING_ROLE", "PS role of this process: TRAINER, PSERVER or HETER_TRAINER (a heter "
       "worker, docs/heter.md)", "fleetrun (PS)", _ROLE, "none (TF: TF_CONFIG task type)"),
    _v("PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST", "comma list ip:port of every heter worker, in "
       "index order (every process of a job with heter workers; a heter worker listens on its "
       "entry, trainer r talks to entry r mod N)", "fleetrun (PS, --heter_worker_num / "
       "--heter_workers)", _ROLE, "none"),
    _v("PADDLE_HETER_TRAINER_IP_PORT_LIST", "Paddle 2.0's name of the heter workers' list; "
       "fleetrun writes both, and when both are set they must agree", "fleetrun (PS, heter "
       "workers)", _ROLE, "none"),
    _v("PADDLE_PSERVERS_IP_PORT_LIST", "comma list ip:port of every server", "fleetrun (PS)",
       _ROLE, "none (TF: TF_CONFIG cluster.ps)"),
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
       "Slurm SLURM_PROCID (per role)"),
    _v("PADDLE_PORT", "port of this process (servers and heter workers listen on it)",
       "fleetrun (PS)", _ROLE, "none"),
    # --- fleetx's own ----------------------------------------------------------------------------
    _v("FLEETX_LOG_DIR", "folder of the per-process logs (a rank whose collective fails leaves "
       "fault.<rank>.json there, naming the rank at fault, for fleetrun's report; each rank "
       "records its optimizer steps and last checkpoint in progress.<rank>, from which fleetrun "
       "says what a restart loses)", "fleetrun", "user scripts, comm, fleet", "none"),
    _v("FLEETX_TIMEOUT", "seconds a collective or PS request may wait for a peer, a dataset's "
       "pipe commands may stay silent, and fleetrun for the other nodes at the rendezvous "
       "(default 300)", "user", "fleet, ps, data, fleetrun, launch bootstrap", "TORCH_NCCL_ASYNC_ERROR_HANDLING + init timeout"),
    _v("FLEETX_DEBUG_COLLECTIVES", "1: before each collective fleetx makes (DDP's gradient "
       "all-reduce, fleet.util, barrier_worker), every rank of the group checks through the "
       "rendezvous store that all make the same call (operation, shapes, dtypes): a divergence "
       "is an error on every rank naming the rank and both calls, a rank that does not come is "
       "named after FLEETX_TIMEOUT; one store write and read per collective. Default 0",
       "user", "comm", "TORCH_DISTRIBUTED_DEBUG=DETAIL (not for DDP over gloo in torch 2.13)"),
    _v("FLEETX_LOG_INTERVAL", "seconds between the progress lines of parameter-server workers "
       "(samples/s, loss) and servers (rows, memory, requests/s), and of dataset loads (lines/s); "
       "0 turns them off (default 10)", "user", "ps runtime, data", "none"),
    _v("FLEETX_PS_HEARTBEAT_INTERVAL", "seconds between heartbeats on an idle parameter-server "
       "connection (default 3)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_DEAD_AFTER", "seconds of silence after which a parameter server or worker is "
       "declared lost, naming it (default 15; must exceed the heartbeat interval)", "user",
       "ps runtime", "none"),
    _v("FLEETX_PS_SAVE_ROOT", "folder parameter servers save checkpoints under and load them "
       "from; a SAVE or init_server(dirname) outside it is refused (default: the server's working "
       "directory)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_MAX_LR", "largest learning rate a parameter server accepts from set_lr or an LR "
       "scheduler (default 10)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_MAX_ROWS", "sparse rows one parameter server may hold per table; requests that "
       "would create more are refused (default 0: no limit)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_NONFINITE", "what a parameter server does with a push holding NaN or inf: "
       "refuse (default: an error naming the table) or skip (drop that worker's push for the "
       "step and count it)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_SECRET", "shared secret every parameter-server connection must prove it "
       "holds (mutual HMAC challenge-response; it never travels and is never printed); fleetrun "
       "generates one per job when neither this nor FLEETX_PS_SECRET_FILE is set. Without "
       "either, servers listen only on loopback addresses", "fleetrun (PS), user", "ps runtime",
       "none", secret=True),
    _v("FLEETX_PS_SECRET_FILE", "file holding the shared secret (surrounding whitespace is "
       "ignored), read when a connection is made; fleetrun --ps_secret_file sets it. Give "
       "every node the same file", "fleetrun --ps_secret_file, user", "ps runtime", "none"),
    _v("FLEETX_PS_MAX_FRAME_MB", "largest parameter-server message payload in MiB a process "
       "sends or accepts; a peer announcing more is disconnected before anything is allocated "
       "(default 1024)", "user", "ps runtime", "none"),
    _v("FLEETX_PS_TRANSPORT", "parameter-server transport: tcp (default: fleetx's own "
       "authenticated links) or zmq (pyzmq, the bench extra; no authentication, so "
       "servers and workers refuse any non-loopback endpoint: it exists to measure the two "
       "against each other); any other value is an error naming the choices", "user",
       "ps runtime", "none"),
    _v("FLEETX_PS_LOCAL_SOCKETS", "1 (default): a parameter server also listens on a "
       "Unix-domain socket in a folder only its user can enter, and workers and heter workers on "
       "the same machine connect through it (same handshake and frames, no TCP/IP processing); "
       "0: TCP only", "user", "ps runtime", "none"),
    _v("FLEETX_PS_CHECKPOINT_DIR", "parameter-server failover is on: each server snapshots its "
       "shard into <this>/server-<i>-of-<n>/, a restarted server loads its latest snapshot, and "
       "workers reconnect to a lost server (fleetrun --max_restarts in a PS job: "
       "--checkpoint_dir, default <log_dir>/ps_snapshots)", "fleetrun (PS --max_restarts)",
       "ps runtime", "none"),
    _v("FLEETX_PS_CHECKPOINT_INTERVAL", "seconds between a parameter server's snapshots under "
       "failover (fleetrun --checkpoint_interval; default 30)", "fleetrun (PS --max_restarts)",
       "ps runtime", "none"),
    _v("FLEETX_PS_JOB_ID", "the parameter-server job's id under failover: a restarted server "
       "loads only this job's snapshots", "fleetrun (PS --max_restarts)", "ps runtime", "none"),
    _v("FLEETX_AUTO_MEMORY_MB", "memory budget per rank in MiB for strategy.auto: it keeps the "
       "fastest measured plan whose parameter, gradient, optimizer and saved-for-backward bytes "
       "per rank fit (default: the device's free memory plus what the model already holds)",
       "user", "strategy.auto (through the world object)", "none"),
    _v("FLEETX_DRY_RUN", "1: print the plan at distributed_optimizer and exit 0 before any "
       "communication", "fleetrun --dry-run", "fleet", "none"),
    _v("FLEETX_TTY", "1 when fleetrun's own stdout is a terminal, else 0: rank 0's (worker 0's) "
       "output is shown there live, so its progress bar may redraw with carriage returns",
       "fleetrun", "user scripts, fleet.observe (draws its bar)", "none"),
    _v("CUDA_VISIBLE_DEVICES", "GPUs this process may use", "fleetrun --gpus, user",
       "torch", "same everywhere"),
    _v("OMP_NUM_THREADS", "intra-op threads per process (fleetrun sets 1 when it starts several "
       "processes on one node and the user has not set it)", "fleetrun, user", "torch",
       "same everywhere"),
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


def _check(name: str) -> None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not part of the fleetx environment contract "
                       f"(known: {', '.join(sorted(VARIABLES))})")


def is_set(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """True if ``name`` is present and non-empty."""
    _check(name)
    return bool((env if env is not None else environ).get(name, "").strip())


def get(name: str, default: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The raw value of ``name`` (stripped), or ``default`` when unset or empty."""
    _check(name)
    value = (env if env is not None else environ).get(name, "").strip()
    return value if value else default


def get_int(name: str, default: Optional[int] = None,
            env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The value of ``name`` as an int.

    Raises:
        EnvError: the value is not an integer (the message names the variable and the value).
    """
    raw = get(name, None, env)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r} is not an integer") from None


def get_float(name: str, default: Optional[float] = None,
              env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The value of ``name`` as a float.

    Raises:
        EnvError: the value is not a number (the message names the variable and the value).
    """
    raw = get(name, None, env)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"environment variable {name}={raw!r} is not a number") from None


def get_limit(name: str, default: float,
              env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The value of ``name`` as a time limit: seconds (> 0), or None for 0 (no limit).

    Raises:
        EnvError: not a number, negative, or not finite (the message names the variable and
            the valid values).

    Example:
        >>> get_limit("FLEETX_TIMEOUT", 300.0, {"FLEETX_TIMEOUT": "0"}) is None
        True
    """
    value = get_float(name, default, env)
    if not 0 <= value < math.inf:
        raise EnvError(f"environment variable {name}={get(name, str(default), env)!r}: "
                       "expected 0 (no limit) or a number of seconds > 0")
    return value if value > 0 else None


def get_list(name: str, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The comma-separated value of ``name`` as a list (empty when unset)."""
    raw = get(name, None, env)
    return [item.strip() for item in raw.split(",") if item.strip()] if raw else []


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
        _check(name)
        target[name] = str(value)


def markdown_table() -> str:
    """The contract as a Markdown table (the body of ``docs/environment.md``)."""
    rows = ["| variable | meaning | written by | read by | torchrun / Kubeflow / Slurm |",
            "|---|---|---|---|---|"]
    for v in _VARS:
        rows.append(f"| `{v.name}` | {v.meaning} | {v.writer} | {v.reader} | "
                    f"{v.counterparts or '—'} |")
    return "\n".join(rows)
