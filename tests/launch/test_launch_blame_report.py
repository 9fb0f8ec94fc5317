"""fleetrun's failure report reads what a failed rank found about its collective: the rank at
fault is named in the ABORT line and shown with its log, not listed as merely stopped; a report
left by another process (an earlier job) is ignored."""
import os
import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from fleetx.comm.api import Blame, fault_path, write_fault
from fleetx.launch import LaunchConfig
from fleetx.launch.collective import _report_failure, plan


def two_ranks(log_dir):
    return plan(LaunchConfig(training_script="train.py", nproc_per_node=2, log_dir=str(log_dir)),
                cuda_count=0, free_ports=lambda n: list(range(41000, 41000 + n)),
                is_local=lambda ip: False, interface_of=lambda addr: None)


def failure(local_rank, pid, exitcode):
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode,
                          error_file=os.devnull)


def test_the_rank_that_did_not_arrive_is_named_not_the_one_that_waited(tmp_path, capsys):
    (tmp_path / "workerlog.1").write_text("step 2\nrank 1: sleeping\n")
    write_fault(str(tmp_path), Blame(0, 100, (1,), "rank 1 did not arrive at all_reduce #12"))
    _report_failure(two_ranks(tmp_path), {0: failure(0, 100, 1),
                                          1: failure(1, 101, -signal.SIGTERM)})
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("ABORT!!! Out of all 2 trainers, the trainer process with rank=[1] was at "
                      "fault: rank 1 did not arrive at all_reduce #12 (reported by rank 0). "
                      "Please check its log.")
    at_fault = err.index(f"rank 1 (local rank 1, pid 101) was at fault and was stopped; last 20 "
                         f"lines of {tmp_path}/workerlog.1:")
    assert err[at_fault + 1:at_fault + 3] == ["    step 2", "    rank 1: sleeping"]
    assert not any(line.startswith("stopped the other") for line in err)


def test_ranks_reporting_the_same_finding_are_listed_once(tmp_path, capsys):
    for rank, pid in ((0, 100), (1, 101)):
        write_fault(str(tmp_path), Blame(rank, pid, (1,), "ranks diverged at call #5"))
    _report_failure(two_ranks(tmp_path), {0: failure(0, 100, 1), 1: failure(1, 101, 1)})
    assert capsys.readouterr().err.splitlines()[0] == (
        "ABORT!!! Out of all 2 trainers, the trainer process with rank=[1] was at fault: ranks "
        "diverged at call #5 (reported by ranks 0, 1). Please check its log.")


def test_a_report_left_by_another_process_is_ignored(tmp_path, capsys):
    write_fault(str(tmp_path), Blame(0, 99, (1,), "rank 1 did not arrive"))  # an earlier job
    _report_failure(two_ranks(tmp_path), {0: failure(0, 100, 1),
                                          1: failure(1, 101, -signal.SIGTERM)})
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("ABORT!!! Out of all 2 trainers, the trainer process with rank=[0] was "
                      "aborted. Please check its log.")
    assert err[-1] == "stopped the other process(es): rank=[1]"
    (tmp_path / "fault.0.json").write_text("{not json")
    _report_failure(two_ranks(tmp_path), {0: failure(0, 100, 1)})
    assert "was aborted" in capsys.readouterr().err
    assert fault_path(str(tmp_path), 3) == f"{tmp_path}/fault.3.json"
