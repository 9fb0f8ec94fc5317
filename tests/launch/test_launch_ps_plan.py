"""The parameter-server plan (``fleetx.launch.ps_plan``), pure: no process starts, no port is
probed. The end-to-end runs of the same decisions are in test_fleetrun_ps*.py."""
from __future__ import annotations

import os

import pytest

from fleetx.launch import ps, ps_plan
from fleetx.launch.api import ConfigError
from fleetx.launch.config import LaunchConfig


def config(**kw) -> LaunchConfig:
    return LaunchConfig(training_script="train.py", **kw)


def port_source():
    """A stand-in for free_ports: distinct ports from 7100 on, the same for every plan."""
    taken = []

    def free_ports(n):
        taken.extend(range(7100 + len(taken), 7100 + len(taken) + n))
        return taken[-n:]
    return free_ports


def plan(c: LaunchConfig, **kw) -> ps_plan.PSPlan:
    kw.setdefault("free_ports", port_source())
    return ps_plan.plan(c, make_secret=lambda: "s" * 64, make_job_id=lambda: "job1", **kw)


def test_the_controller_re_exports_the_plan():
    assert ps.plan is ps_plan.plan and ps.PSPlan is ps_plan.PSPlan
    assert ps.PSProcess is ps_plan.PSProcess and ps.WORKER_BASE_PORT == 6170


def test_the_same_inputs_give_the_same_plan():
    c = config(server_num=1, worker_num=2, log_dir="/tmp/logs")
    assert plan(c) == plan(c)
    assert [q.env for q in plan(c).local] == [q.env for q in plan(c).local]


def test_processes_name_their_roles_logs_and_the_generated_secret_stays_out_of_them():
    p = plan(config(server_num=1, worker_num=1, heter_worker_num=1, log_dir="/tmp/logs"))
    assert p.processes().splitlines() == [
        "  server 0 (127.0.0.1:7100): /tmp/logs/serverlog.0",
        "  worker 0 (127.0.0.1:7101): /tmp/logs/workerlog.0",
        "  heter worker 0 (127.0.0.1:7102): /tmp/logs/heterlog.0"]
    assert [q.role_name for q in p.local] == ["server", "worker", "heter worker"]
    assert p.secret == "s" * 64 and "s" * 64 not in repr(p)
    assert all("FLEETX_PS_SECRET" not in q.env for q in p.local)
    assert all(q.env["FLEETX_LOG_DIR"] == "/tmp/logs" for q in p.local)


def test_failover_gives_every_process_the_snapshots_folder_interval_and_job_id():
    p = plan(config(server_num=1, worker_num=1, max_restarts=2, log_dir="/tmp/logs"))
    for q in p.local:
        assert q.env["FLEETX_PS_CHECKPOINT_DIR"] == "/tmp/logs/ps_snapshots"
        assert q.env["FLEETX_PS_CHECKPOINT_INTERVAL"] == "30"
        assert q.env["FLEETX_PS_JOB_ID"] == "job1"
    assert p.max_restarts == 2
    assert any(n.startswith("failover: each server snapshots its shard every 30 s into "
                            "/tmp/logs/ps_snapshots") for n in p.notes)
    given = plan(config(server_num=1, worker_num=1, max_restarts=1, checkpoint_dir="snaps",
                        checkpoint_interval=2.5))
    assert given.local[0].env["FLEETX_PS_CHECKPOINT_DIR"] == os.path.abspath("snaps")
    assert given.local[0].env["FLEETX_PS_CHECKPOINT_INTERVAL"] == "2.5"


def test_without_failover_no_snapshot_variable_is_set():
    p = plan(config(server_num=1, worker_num=1))
    assert not any(k.startswith("FLEETX_PS_CHECKPOINT") or k == "FLEETX_PS_JOB_ID"
                   for q in p.local for k in q.env)


@pytest.mark.parametrize("kw, flag, message", [
    (dict(checkpoint_dir="d"), "--checkpoint_dir", "give --max_restarts N as well"),
    (dict(checkpoint_interval=5.0), "--checkpoint_interval", "give --max_restarts N as well"),
    (dict(servers=("127.0.0.1:7000",), workers=("127.0.0.1:7000",), server_num=None,
          worker_num=None), "--servers", "127.0.0.1:7000 listed more than once"),
])
def test_refusals_name_the_flag(kw, flag, message):
    with pytest.raises(ConfigError) as err:
        plan(config(**{"server_num": 1, "worker_num": 1, **kw}))
    assert err.value.flag == flag and message in str(err.value)
