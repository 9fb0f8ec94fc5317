"""The torch elastic agent as fleetrun runs it: the node's processes start, are watched and are
stopped by torch's ``LocalElasticAgent``; fleetrun gives it its own rendezvous handler
(``rendezvous.py``) and announces every restart of the worker group with its cause and the work
it loses (the optimizer steps since the last checkpoint, from the ranks' progress records).

``torchrun``'s ``elastic_launch`` builds the same agent, but from a rendezvous registry entry and
with nothing to say when it restarts the workers; building it here keeps both in fleetrun's
hands.
"""
from __future__ import annotations

import inspect
import signal
import sys
from typing import Callable, Optional, Sequence

from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, SignalException
from torch.distributed.elastic.rendezvous import RendezvousHandler

from fleetx.checkpoint.progress import lost_work
from fleetx.launch import logs

__all__ = ["restart_message", "run_agent"]

_MONITOR_SECONDS = 0.1  # how often the agent polls its processes (WorkerSpec's default varies)


def restart_message(failures: dict, restart: int, max_restarts: int,
                    log_of: Callable[[int], str]) -> str:
    """The line announcing a restart after ``failures`` ({global rank: ProcessFailure}).

    Example:
        restart 1 of 2: rank 1 (local rank 1, pid 4242) exited with code 3 (log: log/workerlog.1):
        RuntimeError: Connection closed by peer [10.0.0.2]:41231; restarting the worker group
    """
    # Ranks that died of the SIGTERM the agent sent to stop the group are not the cause.
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM}
    failed = sorted(set(failures) - stopped) or sorted(failures)
    causes = "; ".join(f"rank {rank} (local rank {failures[rank].local_rank}, pid "
                       f"{failures[rank].pid}) {logs.describe_exit(failures[rank].exitcode)} "
                       f"(log: {log_of(rank)})" + _said(log_of(rank)) for rank in failed)
    return (f"restart {restart} of {max_restarts}: {causes or 'the worker group is unhealthy'}; "
            f"restarting the worker group")


def _said(path: str) -> str:
    """``: <the error its log ends with>`` (a rank that failed because a peer vanished names
    the peer there), or nothing."""
    line = logs.error_line(path)
    return f": {line}" if line else ""


class _InheritedStreams(LogsSpecs):
    """Workers start on the launcher's streams; each bootstrap moves them to its log."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir=log_dir)
        self._dir = log_dir

    def reify(self, envs):
        ranks = range(len(envs))
        return LogsDest(stdouts=dict.fromkeys(ranks, ""), stderrs=dict.fromkeys(ranks, ""),
                        error_files=dict.fromkeys(ranks, "/dev/null"))

    @property
    def root_log_dir(self) -> str:
        return self._dir


class _Agent(LocalElasticAgent):
    """torch's agent, plus one line whenever it restarts the worker group, saying why."""

    def __init__(self, spec: WorkerSpec, logs_specs: LogsSpecs, say: Callable[[str], None],
                 log_of: Callable[[int], str], log_dir: str, watch=None, **options) -> None:
        super().__init__(spec, logs_specs, **options)
        self._watch = watch  # a summary.ProcessWatch, told of every poll
        self._say, self._log_of, self._log_dir = say, log_of, log_dir
        self._last: Optional[RunResult] = None
        self._restarts = 0

    def _monitor_workers(self, worker_group) -> RunResult:
        self._last = super()._monitor_workers(worker_group)
        if self._watch is not None:
            failed = self._last.failures
            done = self._last.state.name == "SUCCEEDED"
            for w in worker_group.workers:
                code = failed[w.global_rank].exitcode if w.global_rank in failed else \
                    (0 if done else None)
                self._watch.poll(("trainer", w.global_rank), w.id, code)
        return self._last

    def _restart_workers(self, worker_group) -> None:
        last, spec = self._last, worker_group.spec
        if last is not None and last.state.name in ("FAILED", "UNHEALTHY"):
            self._restarts += 1  # the agent restarts after a failure only while any are left
            self._say(restart_message(last.failures, self._restarts, spec.max_restarts,
                                      self._log_of))
            # From the ranks' progress records (fleetx.checkpoint.progress); none without a
            # fleet optimizer.
            failed = [r for r, f in sorted(last.failures.items())
                      if f.exitcode != -signal.SIGTERM]  # the cause first: it names the rank
            lost = lost_work(self._log_dir, failed + sorted(set(last.failures) - set(failed)))
            if lost:
                self._say(lost)
        else:
            self._say(f"{spec.rdzv_handler.num_nodes_waiting()} more node(s) want to join: "
                      f"restarting the worker group with them (not counted against "
                      f"--max_restarts)")
        nodes = worker_group.group_world_size
        super()._restart_workers(worker_group)
        if nodes is not None and worker_group.group_world_size not in (None, nodes):
            world = worker_group.workers[0].world_size if worker_group.workers else "?"
            self._say(f"the worker group runs on {worker_group.group_world_size} node(s) now "
                      f"(was {nodes}): {world} process(es) in all")


def _say(message: str) -> None:
    print(f"fleetrun: {message}", file=sys.stderr, flush=True)


def agent_options(grace_seconds: int, accepted: Optional[Sequence[str]] = None) -> dict:
    """The agent's keyword options; the grace period after a signal only where torch has it
    (2.12 on; before, it is 30 s)."""
    if accepted is None:
        accepted = inspect.signature(LocalElasticAgent.__init__).parameters
    options: dict = {"start_method": "spawn"}
    if "shutdown_timeout" in accepted:
        options["shutdown_timeout"] = grace_seconds
    return options


def run_agent(handler: RendezvousHandler, nproc: int, entrypoint: str, args: Sequence[str], *,
              max_restarts: int, local_addr: str, log_dir: str, log_of: Callable[[int], str],
              grace_seconds: int, say: Callable[[str], None] = _say,
              watch=None) -> RunResult:
    """Start ``nproc`` processes of ``entrypoint args`` after the rendezvous, watch them, restart
    the group up to ``max_restarts`` times after a failure; returns the final result.
    ``watch`` (a :class:`~fleetx.launch.summary.ProcessWatch`) is told of every poll.

    Raises:
        torch.distributed.elastic.multiprocessing.SignalException: fleetrun got SIGTERM/SIGINT
            (the processes are stopped by then).
        LaunchError: the rendezvous failed (from the handler).
    """
    spec = WorkerSpec(role="trainer", local_world_size=nproc, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler, max_restarts=max_restarts,
                      monitor_interval=_MONITOR_SECONDS, local_addr=local_addr)
    agent = _Agent(spec, _InheritedStreams(log_dir), say, log_of, log_dir, watch,
                   **agent_options(grace_seconds))
    shutdown = True
    try:
        return agent.run()
    except SignalException:
        # After a signal the rendezvous stays open (as torchrun leaves it): closing it would
        # end an elastic job for every node.
        shutdown = False
        raise
    finally:
        if shutdown:
            handler.shutdown()
