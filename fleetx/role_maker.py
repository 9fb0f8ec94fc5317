"""Role makers: who this process is in the job (worker or server, its index, its peers).

``PaddleCloudRoleMaker`` reads the launcher environment (Paddle's ``PADDLE_*`` names and
torchrun's ``RANK``/``WORLD_SIZE``/...); ``UserDefinedRoleMaker`` is given everything explicitly.
Neither opens a connection: a role maker only resolves the role.
"""
from __future__ import annotations

import enum
from typing import Any, Mapping, Optional

from fleetx import clusters, env

__all__ = ["Role", "RoleMakerBase", "PaddleCloudRoleMaker", "UserDefinedRoleMaker"]

_FALLBACK_ENDPOINT = "127.0.0.1:6170"
#: Variables only a collective launcher writes (a parameter-server launch also lists servers).
_COLLECTIVE_LAUNCH = ("WORLD_SIZE", "RANK", "PADDLE_TRAINER_ENDPOINTS")


def _endpoints(n: int) -> str:
    return f"{n} endpoint" if n == 1 else f"{n} endpoints"


class Role(enum.IntEnum):
    """The role of a process. Values are Paddle's."""

    WORKER = 1
    SERVER = 2
    HETER_WORKER = 3
    ALL = 4


class RoleMakerBase:
    """The resolved role of this process. Subclasses fill the fields in ``_generate_role``."""

    def __init__(self, is_collective: bool = False) -> None:
        if not isinstance(is_collective, bool):
            raise ValueError(f"`is_collective` should be instance of `bool`, "
                             f"but got {type(is_collective).__name__}")
        self._is_collective = is_collective
        self._role: Optional[Role] = None
        self._current_id = -1
        self._worker_endpoints: list[str] = []
        self._server_endpoints: list[str] = []
        self._heter_endpoints: list[str] = []
        self._num_workers = 0
        self._local_rank = 0
        self._local_world_size = 1
        self._non_distributed = False
        self._master: Optional[tuple] = None
        self._generated = False

    # -- resolution ---------------------------------------------------------------------------
    def _ensure(self) -> None:
        if not self._generated:
            self._generate_role()
            self._generated = True

    def _generate_role(self) -> None:
        raise NotImplementedError("Please implement this method in child class")

    # -- queries (Paddle's private names, used by Fleet) ---------------------------------------
    def _is_worker(self) -> bool:
        self._ensure()
        return self._role == Role.WORKER

    def _is_server(self) -> bool:
        self._ensure()
        return self._role == Role.SERVER

    def _is_first_worker(self) -> bool:
        return self._is_worker() and self._current_id == 0

    def _worker_index(self) -> int:
        self._ensure()
        return self._current_id

    _server_index = _worker_index
    _role_id = _worker_index

    def _worker_num(self) -> int:
        self._ensure()
        return self._num_workers

    def _server_num(self) -> int:
        self._ensure()
        return len(self._server_endpoints)

    def _get_trainer_endpoints(self) -> list[str]:
        self._ensure()
        return list(self._worker_endpoints)

    def _get_pserver_endpoints(self) -> list[str]:
        self._ensure()
        return list(self._server_endpoints)

    def _node_num(self) -> int:
        self._ensure()
        hosts = {ep.rsplit(":", 1)[0] for ep in self._worker_endpoints}
        return max(1, len(hosts))

    def _get_local_rank(self) -> int:
        self._ensure()
        return self._local_rank

    def _get_local_world_size(self) -> int:
        self._ensure()
        return self._local_world_size

    def _get_local_device_ids(self) -> Optional[str]:
        return None

    def _get_master(self) -> Optional[tuple]:
        """``(host, port)`` of the rendezvous store when the role maker found it (a Slurm or MPI
        launch, ``fleetx.clusters``); None: ``MASTER_ADDR`` / ``MASTER_PORT`` or the first
        trainer endpoint say it."""
        self._ensure()
        return self._master

    def _get_world_device_ids(self) -> Optional[str]:
        return None

    def _is_non_distributed(self) -> bool:
        self._ensure()
        return self._non_distributed

    def _set_trainer_endpoints(self, endpoints: list[str]) -> None:
        self._worker_endpoints = list(endpoints)

    def _heter_worker_num(self) -> int:
        """Number of heter workers of a parameter-server job (``docs/heter.md``)."""
        self._ensure()
        return len(self._heter_endpoints)

    def _is_heter_worker(self) -> bool:
        """Whether this process is a heter worker (``TRAINING_ROLE=HETER_TRAINER``)."""
        self._ensure()
        return self._role == Role.HETER_WORKER

    def _get_heter_worker_endpoints(self) -> list[str]:
        """``ip:port`` of every heter worker, in index order."""
        self._ensure()
        return list(self._heter_endpoints)

    def _heter_worker_index(self) -> int:
        """This heter worker's index among the heter workers (its role id minus the number of
        trainers, as Paddle numbers them).

        Raises:
            ValueError: this process is not a heter worker.
        """
        if not self._is_heter_worker():
            raise ValueError("_heter_worker_index(): this process is not a heter worker")
        return self._current_id - self._num_workers

    @property
    def is_collective(self) -> bool:
        return self._is_collective

    def to_string(self) -> str:
        """Paddle's format: the role as its number (``role: 1`` worker, ``role: 2`` server)."""
        self._ensure()
        role = int(self._role) if self._role is not None else None
        return (f"role: {role}, current_id: {self._current_id}, "
                f"worker_endpoints: {self._worker_endpoints}, "
                f"server_endpoints: {self._server_endpoints}")

    __repr__ = to_string


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role from the launcher's environment (fleetrun, torchrun, Kubeflow, Paddle's launcher).

    Collective mode reads ``PADDLE_TRAINER_ID`` / ``PADDLE_TRAINER_ENDPOINTS`` /
    ``PADDLE_RANK_IN_NODE`` and torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; when both
    are present they must agree. With neither, the script is a 1-process job.

    Started by Slurm's ``srun`` or an MPI ``mpirun`` (``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``,
    ``PMI_RANK``...; :mod:`fleetx.clusters`), a collective process needs no other variable: its
    variables give the rank, world and local rank, and the rendezvous is at the first node of
    ``SLURM_NODELIST`` (or ``MASTER_ADDR``). fleetrun's and torchrun's variables come first: when
    they give the world, Slurm's / MPI's are only checked against them, if they describe the same
    world (equal size, no elastic agent between): the ranks must then agree. See
    ``docs/clusters.md``.

    A single endpoint with no rank variable is rank 0, as in Paddle. ``PADDLE_TRAINERS_NUM``
    gives the world size only when neither ``PADDLE_TRAINER_ENDPOINTS`` nor ``WORLD_SIZE`` is
    set (Paddle ignores it in collective mode).

    Parameter-server mode reads ``TRAINING_ROLE``, ``PADDLE_PSERVERS_IP_PORT_LIST``,
    ``PADDLE_TRAINERS_NUM``, ``PADDLE_TRAINER_ID`` (workers), ``POD_IP`` and ``PADDLE_PORT``
    (servers and heter workers) and the heter workers' list
    ``PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST`` (or Paddle 2.0's
    ``PADDLE_HETER_TRAINER_IP_PORT_LIST``; both set, they must agree). A heter worker
    (``TRAINING_ROLE=HETER_TRAINER``) has the role id ``PADDLE_TRAINERS_NUM + its index``, as in
    Paddle. Without ``PADDLE_PSERVERS_IP_PORT_LIST`` the script is a 1-process local job,
    unless a collective launcher started it (``WORLD_SIZE``, ``RANK`` or
    ``PADDLE_TRAINER_ENDPOINTS`` set): then it joins that collective job.

    Args:
        is_collective: collective (True) or parameter-server (False) job.
        environ: the mapping to read instead of the process environment (for tests).

    Raises:
        fleetx.env.EnvError: a variable is missing, malformed, or contradicts another; the
            message names it. Also ``is_collective=True`` in a parameter-server launch.

    Example:
        >>> rm = PaddleCloudRoleMaker(is_collective=True)
        >>> fleet.init(rm)
    """

    def __init__(self, is_collective: bool = False,
                 environ: Optional[Mapping[str, str]] = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"PaddleCloudRoleMaker got unknown arguments {sorted(kwargs)}; "
                            f"valid: is_collective, environ")
        super().__init__(is_collective)
        self._env = environ

    def _generate_role(self) -> None:
        if self._is_collective:
            self._collective_role()
        else:
            self._ps_role()

    # -- collective ---------------------------------------------------------------------------
    def _collective_role(self) -> None:
        e = self._env
        self._refuse_ps_launch()
        role = env.get("PADDLE_TRAINING_ROLE", env=e)
        if role != "TRAINER":
            raise env.EnvError(f"PADDLE_TRAINING_ROLE={role!r}: a collective job has only "
                               f"TRAINER processes")
        endpoints = env.get_list("PADDLE_TRAINER_ENDPOINTS", env=e)
        paddle_id = env.get_int("PADDLE_TRAINER_ID", env=e)
        rank = env.get_int("RANK", env=e)
        self._role = Role.WORKER
        world = self._agreed_world(endpoints)
        cluster = clusters.detect(e) if world is None else self._same_cluster(world)
        if world is None and cluster is not None:
            self._cluster_role(cluster, paddle_id, rank)
            return
        if world is None:
            if rank or paddle_id:  # a rank > 0 without a world is a broken launch, not a job
                name = "RANK" if rank else "PADDLE_TRAINER_ID"
                raise env.EnvError(f"{name}={rank or paddle_id} is set but the world size is "
                                   f"not: set WORLD_SIZE (or PADDLE_TRAINER_ENDPOINTS)")
            # No launcher: a 1-process job.
            self._non_distributed = True
            self._current_id, self._num_workers = 0, 1
            self._worker_endpoints = [_FALLBACK_ENDPOINT]
            return
        self._num_workers = world
        self._current_id = self._agreed_rank(paddle_id, rank, world)
        if cluster is not None:  # the same world told twice: it must be the same rank
            self._agree_with_cluster(cluster, paddle_id, rank)
        if not 0 <= self._current_id < self._num_workers:
            raise env.EnvError(f"rank {self._current_id} (RANK / PADDLE_TRAINER_ID) is outside "
                               f"[0, {self._num_workers}) given by the world size")
        self._worker_endpoints = endpoints  # may stay empty under torchrun; filled after init
        self._local_rank = self._agreed_local_rank()
        self._local_world_size = env.get_int("LOCAL_WORLD_SIZE", env=e) or 1
        if self._local_rank < 0 or (env.is_set("LOCAL_WORLD_SIZE", env=e)
                                    and self._local_rank >= self._local_world_size):
            raise env.EnvError(f"LOCAL_RANK={self._local_rank} is outside [0, "
                               f"{self._local_world_size}) given by LOCAL_WORLD_SIZE")

    def _same_cluster(self, world: int) -> Optional[clusters.ClusterLaunch]:
        """A Slurm / MPI launch that describes the world fleetrun's or torchrun's variables
        give, so that the two must agree; None when there is none, or when it describes
        another world: ``srun fleetrun ...`` / ``srun torchrun ...`` start one launcher per node,
        whose processes inherit Slurm's variables for the launchers, and an elastic agent
        between (``TORCHELASTIC_RESTART_COUNT`` set) numbers the ranks itself."""
        if env.is_set("TORCHELASTIC_RESTART_COUNT", env=self._env):
            return None
        cluster = clusters.detect(self._env, with_master=False)
        return cluster if cluster is not None and cluster.world_size == world else None

    def _cluster_role(self, cluster: clusters.ClusterLaunch, paddle_id: Optional[int],
                      rank: Optional[int]) -> None:
        """The role from a Slurm or MPI launch alone (no fleetrun / torchrun world given)."""
        self._agree_with_cluster(cluster, paddle_id, rank)
        self._num_workers, self._current_id = cluster.world_size, cluster.rank
        self._master = cluster.master
        self._local_rank = cluster.local_rank
        self._local_world_size = (cluster.local_world_size
                                  or env.get_int("LOCAL_WORLD_SIZE", env=self._env) or 1)
        # As under torchrun, an unknown local size is 1 and not checked (the launcher checked
        # its own; only LOCAL_WORLD_SIZE given by hand can contradict it).
        if cluster.local_world_size is None and env.is_set("LOCAL_WORLD_SIZE", env=self._env) \
                and self._local_rank >= self._local_world_size:
            raise env.EnvError(f"{cluster.describe('local_rank')} is outside [0, "
                               f"{self._local_world_size}) given by LOCAL_WORLD_SIZE")

    def _agree_with_cluster(self, cluster: clusters.ClusterLaunch, paddle_id: Optional[int],
                            rank: Optional[int]) -> None:
        """fleetrun's / torchrun's rank variables, where set, name the cluster's rank."""
        e = self._env
        for name, value, what in (
                ("PADDLE_TRAINER_ID", paddle_id, "rank"), ("RANK", rank, "rank"),
                ("LOCAL_RANK", env.get_int("LOCAL_RANK", env=e), "local_rank"),
                ("PADDLE_RANK_IN_NODE", env.get_int("PADDLE_RANK_IN_NODE", env=e),
                 "local_rank")):
            if value is not None and value != getattr(cluster, what):
                raise env.EnvError(f"{name}={value} disagrees with {cluster.describe(what)} "
                                   f"({cluster.launcher} started this process)")

    def _get_local_device_ids(self) -> Optional[str]:
        """``PADDLE_LOCAL_DEVICE_IDS`` as the launcher wrote it (None when unset)."""
        return env.get("PADDLE_LOCAL_DEVICE_IDS", env=self._env)

    def _get_world_device_ids(self) -> Optional[str]:
        """``PADDLE_WORLD_DEVICE_IDS`` as the launcher wrote it (None when unset)."""
        return env.get("PADDLE_WORLD_DEVICE_IDS", env=self._env)

    def _refuse_ps_launch(self) -> None:
        """A collective script started by a parameter-server launch: say so, rather than fail
        later on a variable (PADDLE_TRAINER_ID) that a server process is never given."""
        servers = env.get("PADDLE_PSERVERS_IP_PORT_LIST", env=self._env)
        if servers is None:
            return
        role = env.get("TRAINING_ROLE", env=self._env) or "?"
        raise env.EnvError(
            f"fleet.init(is_collective=True) in a process of a parameter-server launch "
            f"(TRAINING_ROLE={role}, PADDLE_PSERVERS_IP_PORT_LIST={servers}): the script asks "
            f"for a collective job but was launched with parameter servers. Launch it with "
            f"`fleetrun --nproc_per_node N script.py` (no --server_num / --servers), or call "
            f"fleet.init() without is_collective=True for a parameter-server job")

    def _agreed_world(self, endpoints: list[str]) -> Optional[int]:
        """The world size all the given variables agree on, or None when none is given.

        ``PADDLE_TRAINERS_NUM`` counts only when neither ``PADDLE_TRAINER_ENDPOINTS`` nor
        ``WORLD_SIZE`` is set: Paddle's collective role maker ignores it, so a stale value left
        by another launcher must not stop a job whose endpoints say otherwise.
        """
        e = self._env
        given = [(name, value) for name, value in (
            ("PADDLE_TRAINER_ENDPOINTS", len(endpoints) if endpoints else None),
            ("WORLD_SIZE", env.get_int("WORLD_SIZE", env=e)),
        ) if value is not None]
        if not given and env.is_set("PADDLE_TRAINERS_NUM", env=e):
            given = [("PADDLE_TRAINERS_NUM", env.get_int("PADDLE_TRAINERS_NUM", env=e))]
        if not given:
            return None
        first_name, first = given[0]
        for name, value in given[1:]:
            if value != first:
                source = (f"{first_name}, which lists {_endpoints(first)}" if first_name ==
                          "PADDLE_TRAINER_ENDPOINTS" else f"{first_name}={first}")
                raise env.EnvError(f"{name}={value} disagrees with {source}")
        if first < 1:
            raise env.EnvError(f"{first_name}={first} must be >= 1")
        return first

    def _agreed_rank(self, paddle_id: Optional[int], rank: Optional[int], world: int) -> int:
        if paddle_id is not None and rank is not None and paddle_id != rank:
            raise env.EnvError(f"PADDLE_TRAINER_ID={paddle_id} disagrees with RANK={rank}")
        if paddle_id is None and rank is None:
            if world == 1:
                return 0  # Paddle's default PADDLE_TRAINER_ID; the only rank there is
            # Paddle would make every process rank 0 here; two rank 0s would hang at the
            # rendezvous, so the missing variable is named instead.
            raise env.EnvError(f"the world size is {world} but neither PADDLE_TRAINER_ID nor "
                               f"RANK says which rank this process is")
        return paddle_id if paddle_id is not None else rank

    def _agreed_local_rank(self) -> int:
        e = self._env
        paddle_local = env.get_int("PADDLE_RANK_IN_NODE", env=e)
        local = env.get_int("LOCAL_RANK", env=e)
        if paddle_local is not None and local is not None and paddle_local != local:
            raise env.EnvError(f"PADDLE_RANK_IN_NODE={paddle_local} disagrees with "
                               f"LOCAL_RANK={local}")
        return next((v for v in (local, paddle_local) if v is not None), 0)

    # -- parameter server ---------------------------------------------------------------------
    def _ps_role(self) -> None:
        e = self._env
        servers = env.get_list("PADDLE_PSERVERS_IP_PORT_LIST", env=e)
        if not servers and (any(env.is_set(name, env=e) for name in _COLLECTIVE_LAUNCH)
                            or _cluster_job(e)):
            # A collective launcher (fleetrun --nproc_per_node, torchrun, srun, mpirun) started
            # this process
            # and there are no servers: the script meant the collective job. Paddle would run
            # each process as its own one-process job, all of them "rank 0", training apart and
            # saving over each other; fleetx joins the job instead.
            self._is_collective = True
            self._collective_role()
            return
        if not servers:
            self._non_distributed = True
            self._role, self._current_id, self._num_workers = Role.WORKER, 0, 1
            return
        self._server_endpoints = servers
        self._worker_endpoints = env.get_list("PADDLE_TRAINER_ENDPOINTS", env=e)
        num = env.get_int("PADDLE_TRAINERS_NUM", env=e)
        if num is None:
            raise env.EnvError("Can not find PADDLE_TRAINERS_NUM, please check your environment.")
        if num < 1:
            raise env.EnvError(f"PADDLE_TRAINERS_NUM={num} must be >= 1")
        self._num_workers = num
        self._heter_endpoints = self._heter_list()
        role = env.get("TRAINING_ROLE", env=e)
        if role is None:
            raise env.EnvError("Can not find TRAINING_ROLE, please check your environment.")
        if role == "TRAINER":
            self._role = Role.WORKER
            tid = env.get_int("PADDLE_TRAINER_ID", env=e)
            if tid is None:
                raise env.EnvError("Can not find PADDLE_TRAINER_ID, please check your "
                                   "environment.")
            if not 0 <= tid < num:
                raise env.EnvError(f"PADDLE_TRAINER_ID={tid} is outside [0, {num}) given by "
                                   f"PADDLE_TRAINERS_NUM")
            self._current_id = tid
        elif role == "PSERVER":
            self._role = Role.SERVER
            self._current_id = self._server_id(servers)
        elif role == "HETER_TRAINER":
            if not self._heter_endpoints:
                raise env.EnvError("Can not find PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST, please "
                                   "check your environment.")
            self._role = Role.HETER_WORKER
            self._current_id = num + self._server_id(self._heter_endpoints, "heter worker",
                                                     "PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST")
        else:
            raise env.EnvError(f"TRAINING_ROLE must be PSERVER or TRAINER or HETER_TRAINER, but "
                               f"got {role!r}, please check your environment.")

    def _heter_list(self) -> list[str]:
        """The heter workers' endpoints (2.2's name, or 2.0's; both set, they must agree)."""
        e = self._env
        new = env.get_list("PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST", env=e)
        old = env.get_list("PADDLE_HETER_TRAINER_IP_PORT_LIST", env=e)
        if new and old and new != old:
            raise env.EnvError(f"PADDLE_HETER_TRAINER_IP_PORT_LIST={','.join(old)} disagrees with "
                               f"PADDLE_ALL_HETER_TRAINER_IP_PORT_LIST={','.join(new)}")
        return new or old

    def _server_id(self, servers: list[str], what: str = "server",
                   variable: str = "PADDLE_PSERVERS_IP_PORT_LIST") -> int:
        e = self._env
        ip, port = env.get("POD_IP", env=e), env.get("PADDLE_PORT", env=e)
        if ip is None:
            raise env.EnvError("Can not find POD_IP, please check your environment.")
        if port is None:
            raise env.EnvError("Can not find PADDLE_PORT, please check your environment.")
        endpoint = f"{ip}:{port}"
        if endpoint not in servers:
            raise env.EnvError(f"this {what}'s endpoint {endpoint} (POD_IP:PADDLE_PORT) is not in "
                               f"{variable}={','.join(servers)}")
        return servers.index(endpoint)


class UserDefinedRoleMaker(RoleMakerBase):
    """A role given explicitly; reads no environment.

    Args:
        is_collective: collective or parameter-server job.
        current_id: this process's index among workers (or servers, for a server).
        role: :class:`Role` of this process (parameter-server jobs; collective is always WORKER).
        worker_num: number of workers (default: ``len(worker_endpoints)``).
        worker_endpoints: ``"ip:port"`` of every worker (required in collective mode).
        server_endpoints: ``"ip:port"`` of every server (parameter-server mode).

    Raises:
        ValueError: missing or inconsistent arguments, naming them.

    Example:
        >>> rm = UserDefinedRoleMaker(current_id=0, role=Role.WORKER, worker_num=2,
        ...                           server_endpoints=["127.0.0.1:36011"])
    """

    def __init__(self, is_collective: bool = False, init_gloo: bool = False,
                 current_id: int = 0, role: Role = Role.WORKER, worker_num: int = 0,
                 worker_endpoints: Optional[list[str]] = None,
                 server_endpoints: Optional[list[str]] = None, **kwargs: Any) -> None:
        super().__init__(is_collective)
        if kwargs:
            raise TypeError(f"UserDefinedRoleMaker got unknown arguments {sorted(kwargs)}; valid: "
                            f"is_collective, init_gloo, current_id, role, worker_num, "
                            f"worker_endpoints, server_endpoints")
        for name, value in (("current_id", current_id), ("worker_num", worker_num)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(role, Role):
            try:
                role = Role(role)
            except ValueError:
                role = None
        if role not in (Role.WORKER, Role.SERVER):
            raise ValueError(f"role must be Role.WORKER or Role.SERVER, got {role!r}")
        self._args = (current_id, role, worker_num, _endpoint_list("worker_endpoints",
                                                                   worker_endpoints),
                      _endpoint_list("server_endpoints", server_endpoints))

    def _generate_role(self) -> None:
        current_id, role, worker_num, workers, servers = self._args
        self._current_id, self._worker_endpoints = current_id, workers
        if self._is_collective:
            if not workers:
                raise ValueError("UserDefinedRoleMaker(is_collective=True) needs worker_endpoints")
            if worker_num and worker_num != len(workers):
                raise ValueError(f"worker_num={worker_num} disagrees with worker_endpoints, "
                                 f"which lists {_endpoints(len(workers))}")
            self._role, self._num_workers = Role.WORKER, len(workers)
            self._local_rank, self._local_world_size = _place_on_host(workers, current_id)
        else:
            if not servers:
                raise ValueError("UserDefinedRoleMaker needs server_endpoints in "
                                 "parameter-server mode")
            self._role, self._server_endpoints = role, servers
            self._num_workers = worker_num or len(workers)
            if self._num_workers <= 0:
                raise ValueError("UserDefinedRoleMaker needs worker_num > 0 or worker_endpoints")
        limit = len(servers) if role == Role.SERVER and not self._is_collective \
            else self._num_workers
        if current_id >= limit:
            raise ValueError(f"current_id={current_id} is outside [0, {limit}) for role "
                             f"{role.name}")


def _cluster_job(e: Optional[Mapping[str, str]]) -> bool:
    """Slurm or MPI started this process among several (``fleetx.clusters``)."""
    cluster = clusters.detect(e, with_master=False)
    return cluster is not None and cluster.world_size > 1


def _endpoint_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of 'ip:port' strings, got {value!r}")
    return list(value)


def _place_on_host(endpoints: list[str], index: int) -> tuple[int, int]:
    """(local rank, processes on the host) of endpoint ``index``: its rank among the endpoints
    that share its host, so processes on one machine pick different GPUs."""
    host = endpoints[index].rsplit(":", 1)[0]
    same = [i for i, ep in enumerate(endpoints) if ep.rsplit(":", 1)[0] == host]
    return same.index(index), len(same)
