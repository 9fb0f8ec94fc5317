"""``fleetrun --fault_tolerance heal``, for real: 3 data-parallel ranks on gloo, one of them
SIGKILLed (or frozen with SIGSTOP) in the middle of training. The survivors are not restarted
(their pids do not change), go on at world size 2 without losing a step, the dead rank is
restarted alone and rejoins with the live state, and every rank ends with the same parameters.
The trajectory is checked against SGD computed here on the batches of the ranks that were live
at each step (``tests/scripts/heal_train.py`` logs what each rank did).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fleetrun import run  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "heal_train.py"
TARGET = torch.tensor([[1.0], [-2.0], [3.0], [0.5]])


def heal_job(folder: Path, *args, steps=40, max_restarts=1):
    folder.mkdir()
    res = run(["--nproc_per_node", "3", "--fault_tolerance", "heal", "--max_restarts",
               max_restarts,
               SCRIPT, "--out", "out", "--steps", steps, *args], folder, timeout=300)
    assert (folder / "out.0").exists(), res.stdout + res.stderr
    records = {s: [json.loads(line) for line in (folder / f"out.{s}").read_text().splitlines()]
               for s in range(3)}
    return res, records


def batch(step: int, who: int):
    g = torch.Generator().manual_seed(1000 * step + who)
    x = torch.randn(8, 4, generator=g)
    return x, x @ TARGET


def reference(records: dict, steps: int) -> list[torch.Tensor]:
    """SGD (lr 0.1) where each step's gradient is the mean over the ranks that logged it."""
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 1, bias=False).weight.detach().clone()
    live = {s: {r["step"] for r in rs if "step" in r} for s, rs in records.items()}
    path = []
    for step in range(steps):
        grads = []
        for slot in sorted(s for s in live if step in live[s]):
            x, y = batch(step, slot)
            grads.append((2 / len(x)) * ((x @ w.T - y) * x).sum(0, keepdim=True) / 1)
        w = w - 0.1 * torch.stack(grads).mean(0)
        path.append(w.flatten().clone())
    return path


def test_a_killed_rank_is_healed_without_restarting_the_others(tmp_path):
    res, records = heal_job(tmp_path / "job", "--kill", "1:8", "--sleep", "0.3")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    # The survivors were never restarted; the dead rank came back once, at a later step.
    for slot in (0, 2):
        assert len({r["pid"] for r in records[slot]}) == 1, records[slot][:3]
    starts = [r for r in records[1] if r.get("event") == "start"]
    assert len(starts) == 2 and starts[1]["start"] > 9, starts
    assert re.search(r"heal: rank 1 \(pid \d+\) was killed by signal SIGKILL", out), out
    assert re.search(r"heal: rank 1 \(restart 1, pid \d+\) rejoined", out), out
    logs = "".join((tmp_path / "job" / "log" / f"workerlog.{s}").read_text() for s in range(3))
    assert "generation 1: 2 rank(s) [0, 2] without rank(s) [1] (rank(s) [1] died)" in logs
    assert "rank(s) [1] joined; state" in logs
    # No step lost on the survivors: every step once, at world size 2 right after the kill.
    steps0 = [r for r in records[0] if "step" in r]
    assert [r["step"] for r in steps0] == list(range(40))
    assert steps0[9]["world"] == 2 and steps0[-1]["world"] == 3
    # The math: the gradient of each step averaged over the ranks live at it.
    for r, expected in zip(steps0, reference(records, 40)):
        assert torch.allclose(torch.tensor(r["w"]), expected, atol=1e-5), (r["step"], r["w"])
    ends = [next(r["w"] for r in records[s] if r.get("event") == "end") for s in range(3)]
    assert ends[0] == ends[1] == ends[2]


def test_sharding_under_heal_falls_back_to_restart_with_one_line(tmp_path):
    res, records = heal_job(tmp_path / "job", "--strategy", "sharding", steps=3)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert re.search(r"fleetrun: --fault_tolerance heal falls back to restart \(a failure "
                     r"restarts every rank\): sharding: each rank holds the only copy", out), out
    assert out.count("fleetrun: --fault_tolerance heal falls back to restart") == 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy,fault", [("amp", "kill"), ("gradient_merge", "kill"),
                                            ("localsgd", "kill"), ("", "freeze")])
def test_strategies_and_a_frozen_rank_heal(tmp_path, monkeypatch, strategy, fault):
    monkeypatch.setenv("FLEETX_HEAL_TIMEOUT", "4")
    extra = ["--strategy", strategy] if strategy else []
    if fault == "freeze":
        extra.append("--freeze")
    res, records = heal_job(tmp_path / "job", "--kill", "1:8", "--sleep", "0.3", *extra)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for slot in (0, 2):
        assert len({r["pid"] for r in records[slot]}) == 1
    if fault == "freeze":
        assert re.search(r"heal: rank 1 \(pid \d+\) sent no heartbeat for \d+ s", out), out
    assert re.search(r"heal: rank 1 \(restart 1, pid \d+\) rejoined", out), out
    k = 2 if strategy == "gradient_merge" else 1
    assert [r["step"] for r in records[0] if "step" in r] == list(range(40 * k))
    ends = [next(r["w"] for r in records[s] if r.get("event") == "end") for s in range(3)]
    assert ends[0] == ends[1] == ends[2]


@pytest.mark.slow  # two real jobs of 3 ranks, ~40 s
def test_a_fallback_restarts_every_rank_and_a_rank_without_restarts_stays_away(tmp_path):
    # sharding cannot heal: the kill restarts the whole group (new pids everywhere), and the
    # restarted job runs its steps to the end
    res, records = heal_job(tmp_path / "sharded", "--strategy", "sharding", "--kill", "1:4",
                            steps=10)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    for slot in range(3):
        assert len({r["pid"] for r in records[slot]}) == 2, (slot, records[slot][:2])
        assert [r["step"] for r in records[slot] if "step" in r][-1] == 9
    ends = [next(r["w"] for r in records[s] if r.get("event") == "end") for s in range(3)]
    assert ends[0] == ends[1] == ends[2]
    # no restart left: the job goes on and ends at 2 ranks, naming the one that stayed away
    res, records = heal_job(tmp_path / "smaller", "--kill", "1:4", "--sleep", "0.1", steps=20,
                            max_restarts=0)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "the job finished with 2 of 3 rank(s); rank(s) [1] did not come back" in out, out
    steps0 = [r for r in records[0] if "step" in r]
    assert [r["step"] for r in steps0] == list(range(20)) and steps0[-1]["world"] == 2
    assert not [r for r in records[1] if r.get("event") == "end"]
    for r, expected in zip(steps0, reference(records, 20)):
        assert torch.allclose(torch.tensor(r["w"]), expected, atol=1e-5), (r["step"], r["w"])


def test_heal_is_refused_where_fleetrun_cannot_host_it_naming_why():
    from fleetx.launch.api import ConfigError
    from fleetx.launch.config import LaunchConfig

    with pytest.raises(ConfigError, match=r"--fault_tolerance: heal runs collective jobs on one "
                                          r"node .* this job has several nodes: use "
                                          r"--fault_tolerance restart"):
        LaunchConfig(training_script="t.py", fault_tolerance="heal", ips=("10.0.0.1", "10.0.0.2"))
    with pytest.raises(ConfigError, match=r"this job has parameter servers"):
        LaunchConfig(training_script="t.py", fault_tolerance="heal", server_num=1, worker_num=2)
    with pytest.raises(ConfigError, match=r"invalid choice 'heals' \(choose from restart, heal\)"):
        LaunchConfig(training_script="t.py", fault_tolerance="heals")
