"""The agent as fleetrun builds it: what a restart announces, and the options torch is given."""
import inspect
import signal

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from fleetx.launch.agent import agent_options, restart_message
from fleetx.launch.logs import describe_exit


def failure(local_rank, pid, exitcode):
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode,
                          error_file="/dev/null")


def test_exit_codes_and_signals_are_said_in_words():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL) == "was killed by signal SIGKILL"


def test_a_restart_names_the_failed_rank_not_the_ones_the_agent_stopped():
    failures = {0: failure(0, 100, -signal.SIGTERM), 1: failure(1, 101, 7)}
    line = restart_message(failures, 1, 3, lambda rank: f"log/workerlog.{rank}")
    assert line == ("restart 1 of 3: rank 1 (local rank 1, pid 101) exited with code 7 "
                    "(log: log/workerlog.1); restarting the worker group")


def test_a_restart_quotes_the_error_the_failed_ranks_log_ends_with(tmp_path):
    """A rank that failed because a peer vanished says so in its log: the announcement quotes
    it (the survivor's exit alone would blame the survivor)."""
    log = tmp_path / "workerlog.0"
    log.write_text("step 12\nTraceback (most recent call last):\n  File \"train.py\"\n"
                   "RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:41231\n"
                   "[W1128] ProcessGroupGloo destroyed\n")
    line = restart_message({0: failure(0, 9, 1)}, 1, 1, lambda rank: str(log))
    assert line == (f"restart 1 of 1: rank 0 (local rank 0, pid 9) exited with code 1 (log: "
                    f"{log}): RuntimeError: [gloo] Connection closed by peer [10.0.0.2]:41231; "
                    "restarting the worker group")
    log.write_text("fleetx: rank 1 did not arrive at all_reduce #12 on group 0\n")
    assert restart_message({0: failure(0, 9, 1)}, 1, 1, lambda rank: str(log)).endswith(
        "): fleetx: rank 1 did not arrive at all_reduce #12 on group 0; restarting the worker "
        "group")


def test_a_restart_after_only_sigterms_names_them():
    line = restart_message({2: failure(0, 5, -signal.SIGTERM)}, 2, 2, str)
    assert line.startswith("restart 2 of 2: rank 2 (local rank 0, pid 5) was killed by signal "
                           "SIGTERM (log: 2)")


def test_the_grace_period_is_passed_only_where_torch_has_it():
    has_it = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
    assert ("shutdown_timeout" in agent_options(10)) == has_it
    assert agent_options(10, accepted=["spec", "shutdown_timeout"])["shutdown_timeout"] == 10
    assert "shutdown_timeout" not in agent_options(10, accepted=["spec", "logs_specs"])
