"""Collective jobs: decide a :class:`CollectivePlan` (pure), then run it on the torch elastic
agent, which starts, watches and stops the processes.

Decisions, in :func:`plan` (``collective_plan.py``, re-exported here): devices, nodes, the
store, endpoints, ``OMP_NUM_THREADS`` and the socket interfaces, each with a note when
fleetrun chose for the user.

Running, in :func:`run`: the nodes meet in fleetrun's own rendezvous (``rendezvous.py``: the
store listens on the rendezvous address only, the wait is reported every few seconds and ends
at ``FLEETX_TIMEOUT`` naming the missing nodes); the agent (``agent.py``) starts the workers in
``bootstrap.py`` and announces each restart; rank 0's log is copied to fleetrun's stdout while
the job runs; when a process fails the agent stops the others and fleetrun reports the rank,
its exit code and the end of its log.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from fleetx import env
from fleetx.launch import bootstrap, hosts, logs, script, summary
from fleetx.launch.api import EXIT_FAILED, EXIT_OK, ConfigError, LaunchError
# The decisions live in collective_plan.py; plan and CollectivePlan are re-exported from here.
from fleetx.launch.collective_plan import DEFAULT_MASTER_PORT, CollectivePlan, plan
from fleetx.launch.config import LaunchConfig

__all__ = ["CollectivePlan", "plan", "run", "launch", "DEFAULT_MASTER_PORT"]

_RUN_ID = "fleetx"
_TAIL_LINES = 20
# When fleetrun is stopped by a signal: seconds the workers get between that signal and SIGKILL.
# (After a worker failure the agent stops the others with its own 30 s grace.)
_GRACE_SECONDS = 10
#: What a dry run leaves unset: there is no store, and no peer would come to it.
DRY_RUN_UNSET = ("MASTER_ADDR", "MASTER_PORT")


# -- running ------------------------------------------------------------------------------------
def _rendezvous(p: CollectivePlan):
    """The node-level rendezvous handler; node 0 of a static job (or the node at --master of an
    elastic one) binds the store's socket here, before anything starts."""
    from fleetx.launch import rendezvous

    if p.elastic:
        return rendezvous.elastic_handler(p.master_addr, p.master_port, p.min_nodes,
                                          p.max_nodes, p.setup.own_addr, p.timeout, _RUN_ID)
    return rendezvous.StaticRendezvous(p.node_rank, p.setup.node_addrs, p.master_addr,
                                       p.master_port, p.timeout, _RUN_ID)


def _tail(p: CollectivePlan, rank: int, header: str) -> list[str]:
    path = logs.worker_log(p.setup.log_dir, rank)
    if rank in p.shown_here():  # copied to stdout as it grew: not twice
        return logs.shown_above(header, path)
    lines = [f"{header}; last {_TAIL_LINES} lines of {path}:"]
    return lines + ([f"    {line}" for line in logs.last_lines(path, _TAIL_LINES)]
                    or ["    (empty)"])


def _blames(p: CollectivePlan, failures: dict, failed: list) -> tuple[list, list[str]]:
    """(ranks at fault, what the failed ranks said about them), from the reports a rank whose
    collective failed leaves in the log folder (see fleetx.comm.api)."""
    from fleetx.comm.api import read_fault  # a small module: no torch

    culprits, reporters = [], {}
    for rank in failed:
        blame = read_fault(p.setup.log_dir, rank, failures[rank].pid)
        if blame is not None:
            culprits += [r for r in blame.ranks if r not in culprits]
            reporters.setdefault(blame.message, []).append(rank)
    said = [f"{message} (reported by rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))})" for message, ranks in reporters.items()]
    return sorted(culprits), said


def _report_failure(p: CollectivePlan, failures: dict) -> None:
    """Name the failed ranks with exit code and log tail. Ranks that only died of the SIGTERM
    the agent sent to stop the job are listed as stopped, not as failures; but when a failed
    rank reported that its collective failed because of another rank (one that never arrived),
    that rank is named first, as the one at fault."""
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    failed = sorted(set(failures) - stopped) or sorted(failures)
    culprits, said = _blames(p, failures, failed)
    total = "" if p.elastic else f" {p.nproc * p.max_nodes}"
    if culprits:
        lines = [f"ABORT!!! Out of all{total} trainers, the trainer process with rank="
                 f"{culprits} was at fault: {'; '.join(said)}. Please check its log."]
    else:
        lines = [f"ABORT!!! Out of all{total} trainers, the trainer process with rank={failed} "
                 f"was aborted. Please check its log."]
    for rank in failed:
        failure = failures[rank]
        code = failure.exitcode
        how = logs.describe_exit(code)
        lines += _tail(p, rank, f"rank {rank} (local rank {failure.local_rank}, pid "
                                f"{failure.pid}) {how}")
    for rank in (r for r in culprits if r not in failed):
        where = (f" (local rank {failures[rank].local_rank}, pid {failures[rank].pid})"
                 if rank in failures else "")
        lines += _tail(p, rank, f"rank {rank}{where} was at fault and was stopped")
    others = sorted(stopped - set(failed) - set(culprits))
    if others:
        lines.append(f"stopped the other process(es): rank={others}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def run(p: CollectivePlan) -> int:
    """Run the plan on the torch elastic agent; the exit code fleetrun should return.

    Raises:
        LaunchError: the log folder cannot be written, the store cannot be served, or the other
            nodes did not come within ``p.timeout`` (the message names them).
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    from fleetx.launch import agent

    if p.fault_tolerance == "heal":
        from fleetx.launch import heal

        return heal.run(p)
    logs.prepare_dir(p.setup.log_dir)
    if p.max_nodes == 1 or p.node_rank == 0:
        # Before the rendezvous: no process of the job, on any node, has started yet.
        for note in logs.archive_earlier(p.setup.log_dir):
            print(f"fleetrun: {note}", flush=True)
    handler = _rendezvous(p)
    followers = []
    args = ("-u", "-m", "fleetx.launch.bootstrap", p.setup.to_json(), p.script, *p.script_args)
    result, stopped_by = None, None
    watch = summary.ProcessWatch()
    try:
        shown = p.shown_here()
        for rank in shown:
            followers.append(logs.LogFollower(
                logs.worker_log(p.setup.log_dir, rank), sys.stdout.buffer,
                prefix=f"[rank {rank}] " if len(shown) > 1 else None).start())
        result = agent.run_agent(
            handler, p.nproc, sys.executable, args, max_restarts=p.max_restarts,
            local_addr=p.setup.own_addr, log_dir=p.setup.log_dir,
            log_of=lambda rank: logs.worker_log(p.setup.log_dir, rank),
            grace_seconds=_GRACE_SECONDS, watch=watch)
    except SignalException as exc:
        stopped_by = signal.Signals(exc.sigval)
    finally:
        for follower in followers:
            follower.stop()
        print(summary.format_table(watch.rows(p.setup.log_dir)), file=sys.stderr, flush=True)
    if result is not None and result.is_failed():
        _report_failure(p, result.failures)
        return EXIT_FAILED
    if stopped_by:
        print(f"fleetrun: received {stopped_by.name}, stopped all processes", file=sys.stderr,
              flush=True)
        return 128 + stopped_by
    print("Local processes completed.", flush=True)
    return EXIT_OK


def dry_run_env(p: CollectivePlan) -> dict[str, str]:
    """The variables of rank 0 of the planned world, plus the dry-run switch.

    No store is served in a dry run, so ``MASTER_ADDR`` and ``MASTER_PORT`` are not among them
    (:data:`DRY_RUN_UNSET`): a script that calls ``torch.distributed.init_process_group`` itself
    fails there at once, instead of waiting as rank 0 for peers that never start.
    """
    world = p.nproc * p.min_nodes
    endpoints = bootstrap.static_endpoints(p.setup) if p.setup.node_addrs else None
    values = bootstrap.process_env(p.setup, 0, 0, world, endpoints)
    values.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE=str(p.nproc), GROUP_RANK="0", FLEETX_DRY_RUN="1")
    return values


def _plan_here(config: LaunchConfig, **probes) -> CollectivePlan:
    """:func:`plan` with what the environment says (the user's variables); ``probes`` go on."""
    problem = script.entrypoint_problem(config.training_script, config.module)
    if problem:
        raise ConfigError("training_script", problem)
    visible = env.get_list("CUDA_VISIBLE_DEVICES") if env.is_set("CUDA_VISIBLE_DEVICES") else None
    return plan(config, visible=visible, user_omp=env.get("OMP_NUM_THREADS"),
                user_ifnames=[name for name in hosts.SOCKET_IFNAME_VARS if env.is_set(name)],
                timeout=_timeout(), **probes)


def _timeout() -> float:
    """``FLEETX_TIMEOUT`` (its default, declared in :mod:`fleetx.env`, when unset).

    Raises:
        LaunchError: it is not a whole number of seconds above 0.
    """
    from fleetx.comm.groups import default_timeout

    try:
        return default_timeout()
    except env.EnvError as exc:
        raise LaunchError(str(exc)) from None


def dry_run(config: LaunchConfig) -> NoReturn:
    """Run the script once as rank 0 of the requested world with no peers (``--dry-run``).

    The fleet prints the plan at ``distributed_optimizer`` and exits 0 before communicating. The
    script replaces fleetrun in its process (``execve``), so its exit code is fleetrun's and
    nothing is left behind when fleetrun is killed.

    Raises:
        ConfigError: the script does not exist, or the flags cannot be served on this node.
    """
    # Plan as the first node, wherever the dry run happens (a laptop is not in --ips).
    p = _plan_here(config, is_local=lambda addr: addr == config.ips[0])
    child = dict(env.environ)
    for name in DRY_RUN_UNSET:  # the user's own would lead torch to a store nobody serves
        child.pop(name, None)
    env.apply(dry_run_env(p), child)
    print(f"fleetrun --dry-run: running {config.training_script} as rank 0 of "
          f"{p.nproc * p.min_nodes} process(es), without peers; {' and '.join(DRY_RUN_UNSET)} "
          f"are unset, so a script that calls torch.distributed.init_process_group itself stops "
          f"there with an error", flush=True)
    sys.stderr.flush()  # anything still buffered would vanish with this process image
    module = ["-m"] if config.module else []
    os.execve(sys.executable, [sys.executable, "-u", *module, p.script, *p.script_args], child)


def launch(config: LaunchConfig) -> int:
    """Plan and run a collective job for ``config``; returns fleetrun's exit code.

    Raises:
        ConfigError: the script does not exist, or the flags cannot be served on this node.
    """
    p = _plan_here(config, launcher_pid=os.getpid())
    print(p.describe(), flush=True)
    return run(p)
