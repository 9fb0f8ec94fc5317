"""fleet.auto_checkpoint and the count of optimizer steps, in one process: a job restarted
from the automatic checkpoint (fresh model and optimizer, as a restarted process has) resumes
at the step it returns and ends with exactly the parameters of an uninterrupted run, with SGD
with momentum and under gradient merge (the count is of updates, not micro-steps); the count
travels in save_checkpoint / load_checkpoint; the ranks' progress records that fleetrun reads to
say what a restart loses."""
import pytest
import torch
from torch import nn

from fleetx import fleet
from fleetx.checkpoint import has_checkpoint
from fleetx.checkpoint.progress import ProgressRecord, lost_work, read_progress
from fleetx.fleet.api import FleetError

pytestmark = pytest.mark.usefixtures("one_process")
STEPS, EVERY = 10, 4


def job(seed: int, merge: int = 1):
    """A fresh fleet, model and optimizer (``seed`` makes the model differ between jobs)."""
    s = fleet.DistributedStrategy()
    if merge > 1:
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": merge}
    f = fleet.Fleet()
    f.init(is_collective=True, strategy=s)
    torch.manual_seed(seed)
    model = f.distributed_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return f, model, opt


def batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def run(f, model, opt, path, stop: int, merge: int = 1) -> int:
    """Train to update ``stop`` from where auto_checkpoint resumes; returns that start."""
    start = f.auto_checkpoint(path, every_steps=EVERY)
    for micro in range(start * merge, stop * merge):
        x, y = batch(micro)
        opt.minimize(nn.functional.mse_loss(model(x), y))
    return start


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("merge", [1, 2])
def test_a_restarted_job_resumes_at_the_returned_step_to_the_same_parameters(tmp_path, merge):
    f, model, opt = job(0, merge)
    assert run(f, model, opt, tmp_path / "ref", STEPS, merge) == 0
    reference = params(model)
    # A job that dies after 7 updates; its last automatic checkpoint is at update 4.
    f, model, opt = job(0, merge)
    assert run(f, model, opt, tmp_path / "ckpt", 7, merge) == 0
    assert (f._steps_taken, f._saved_at) == (7, 4)
    f, model, opt = job(1, merge)  # the restarted process builds another model
    assert run(f, model, opt, tmp_path / "ckpt", STEPS, merge) == 4
    assert f.start_step() == 4 and f._steps_taken == STEPS and f._saved_at == 8
    for name, value in params(model).items():
        assert torch.equal(value, reference[name]), name


def test_resuming_without_the_optimizer_state_would_differ(tmp_path):
    """The equality above is not a given: restoring the parameters alone (momentum lost)
    ends elsewhere."""
    f, model, opt = job(0)
    run(f, model, opt, tmp_path / "ref", STEPS)
    reference = params(model)
    f, model, opt = job(0)
    run(f, model, opt, tmp_path / "ckpt", 7)
    f, model, opt = job(1)
    f.load_checkpoint(tmp_path / "ckpt")
    opt.inner.state.clear()
    for i in range(4, STEPS):
        opt.minimize(nn.functional.mse_loss(model(batch(i)[0]), batch(i)[1]))
    assert not all(torch.equal(v, reference[k]) for k, v in params(model).items())


def test_the_step_count_travels_in_save_and_load_checkpoint(tmp_path):
    f, model, opt = job(0)
    for i in range(3):
        opt.minimize(model(batch(i)[0]).square().mean())
    f.save_checkpoint(tmp_path / "c", extra={"step": 3})
    f, model, opt = job(0)
    assert f.load_checkpoint(tmp_path / "c") == {"step": 3}
    assert (f._steps_taken, f._saved_at, f.start_step()) == (3, 3, 0)


def test_no_checkpoint_is_written_before_every_steps_updates(tmp_path):
    f, model, opt = job(0)
    run(f, model, opt, tmp_path / "c", EVERY - 1)
    assert not has_checkpoint(tmp_path / "c")


def test_wrong_uses_are_errors_naming_the_cause(tmp_path):
    f = fleet.Fleet()
    f.init(is_collective=True)
    f.distributed_model(nn.Linear(2, 2))
    with pytest.raises(FleetError, match="call that first"):
        f.auto_checkpoint(tmp_path, every_steps=2)
    f, model, opt = job(0)
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ValueError, match="at least 1, got"):
            f.auto_checkpoint(tmp_path, every_steps=bad)
    f.auto_checkpoint(tmp_path / "c", every_steps=2)
    with pytest.raises(FleetError, match="already called"):
        f.auto_checkpoint(tmp_path / "c", every_steps=2)


def test_under_fleetrun_each_rank_records_its_steps_and_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETX_LOG_DIR", str(tmp_path))
    f, model, opt = job(0)
    assert read_progress(str(tmp_path), 0) == (0, -1)
    run(f, model, opt, tmp_path / "c", 6)
    assert read_progress(str(tmp_path), 0) == (6, 4)
    assert lost_work(str(tmp_path), [0]) == ("work lost: 2 step(s) since the last checkpoint "
                                             "(rank 0 at step 6, checkpoint at step 4)")


def test_lost_work_names_the_rank_that_lost_most_and_says_when_nothing_was_saved(tmp_path):
    d = str(tmp_path)
    assert lost_work(d, [0, 1]) is None  # no fleet optimizer: nothing to say
    ProgressRecord(d, 0).update(9, 8)
    ProgressRecord(d, 1).update(11, 8)
    assert lost_work(d, [0, 1]) == ("work lost: 3 step(s) since the last checkpoint (rank 1 at "
                                    "step 11, checkpoint at step 8)")
    ProgressRecord(d, 2).update(5, -1)
    assert lost_work(d, [2]) == ("work lost: all 5 step(s), no checkpoint was saved (rank 2 at "
                                 "step 5): the processes start over")
    (tmp_path / "progress.3").write_bytes(b"short")
    assert read_progress(d, 3) is None


def test_the_documented_loops_run(tmp_path):
    """docs/reliability.md, "Elastic collective training": the loop by hand saves every k
    steps; the automatic one then finds that checkpoint and resumes at its step."""
    from pathlib import Path

    import fleetx.checkpoint

    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    section = text.split("## Elastic collective training", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    f, model, opt = job(0)
    taken = []
    scope = {"fleet": f, "fleetx": fleetx, "opt": opt, "CKPT": str(tmp_path / "c"), "total": 6,
             "k": 4, "batch": lambda step: taken.append(step) or batch(step),
             "loss_of": lambda b: nn.functional.mse_loss(model(b[0]), b[1])}
    exec(compile(example, "docs/reliability.md", "exec"), scope)
    # By hand: steps 0-5, saved at 4. Automatic: restores step 4, then steps 4 and 5 again.
    assert taken == [0, 1, 2, 3, 4, 5, 4, 5]
    assert f.start_step() == 4


def test_an_amp_step_skipped_for_inf_gradients_does_not_count(tmp_path):
    """The count is of updates: a step the loss scaler skips (inf gradients) took none."""
    s = fleet.DistributedStrategy()
    s.amp = True
    f = fleet.Fleet()
    f.init(is_collective=True, strategy=s)
    torch.manual_seed(0)
    model = f.distributed_model(nn.Linear(6, 2))
    opt = f.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    f.auto_checkpoint(tmp_path / "c", every_steps=2)
    x, y = batch(0)
    opt.minimize(nn.functional.mse_loss(model(x), y))
    before = params(model)
    opt.minimize(nn.functional.mse_loss(model(x), y) * float("inf"))  # skipped
    assert all(torch.equal(v, before[k]) for k, v in params(model).items())
    assert f._steps_taken == 1 and not has_checkpoint(tmp_path / "c")
    opt.minimize(nn.functional.mse_loss(model(x), y))
    assert f._steps_taken == 2 and has_checkpoint(tmp_path / "c")
