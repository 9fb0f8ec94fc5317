"""Asynchronous saves and keep_last in one process: the call returns before the files are
written and the save holds the state at the call; a load and a second save wait for a pending
save; a write that fails for real (the file-size limit, EFBIG) is raised by wait() naming the
folder and leaves the previous checkpoint; keep_last's layout, its errors; auto_checkpoint with
both resumes to the parameters of an uninterrupted run."""
import resource

import pytest
import torch
from torch import nn

from fleetx import fleet
from fleetx.checkpoint import CheckpointError, has_checkpoint

pytestmark = pytest.mark.usefixtures("one_process")


def job(seed: int = 0, width: int = 1024):
    f = fleet.Fleet()
    f.init(is_collective=True)
    torch.manual_seed(seed)
    model = f.distributed_model(nn.Sequential(nn.Linear(64, width), nn.Tanh(),
                                              nn.Linear(width, 64)))
    opt = f.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    return f, model, opt


def step(model, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    opt.minimize(model(torch.randn(8, 64, generator=g)).square().mean())


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model, state) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_the_call_returns_before_the_write_and_a_load_waits_for_it(tmp_path):
    f, model, opt = job(width=8192)  # ~4 MB of parameters, 12 MB with Adam's moments
    step(model, opt, 0)
    at_call = params(model)
    handle = f.save_checkpoint(tmp_path / "c", extra={"n": 1}, async_save=True)
    assert not handle.done()  # the files are written after the call returned
    step(model, opt, 1)       # ...while training changes the live tensors in place
    assert not same(model, at_call)
    g, fresh, _ = job(seed=1, width=8192)
    assert f.load_checkpoint(tmp_path / "c") == {"n": 1}  # waits for the pending save
    assert handle.done() and same(model, at_call)
    again = f.save_checkpoint(tmp_path / "c", async_save=True)
    f.save_checkpoint(tmp_path / "c", extra={"n": 3})  # a second save waits for the first
    assert again.done() and again.wait().save_id != handle.wait().save_id
    assert g.load_checkpoint(tmp_path / "c") == {"n": 3} and same(fresh, at_call)


def test_a_failed_write_is_raised_by_wait_naming_the_folder_and_the_previous_stays(tmp_path):
    f, model, opt = job()
    step(model, opt, 0)
    f.save_checkpoint(tmp_path / "c", extra={"n": 1})
    first = params(model)
    step(model, opt, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # files above 64 KiB: EFBIG
    try:
        handle = f.save_checkpoint(tmp_path / "c", extra={"n": 2}, async_save=True)
        with pytest.raises(CheckpointError, match="the save to .*c failed") as e:
            handle.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(tmp_path / "c") in str(e.value) and "could not write the files (rank 0: " in str(e.value)
    assert handle.done()
    g, fresh, _ = job(seed=1)
    assert g.load_checkpoint(tmp_path / "c") == {"n": 1} and same(fresh, first)
    f.save_checkpoint(tmp_path / "c", extra={"n": 3})  # the failure was reported: saves go on
    assert g.load_checkpoint(tmp_path / "c") == {"n": 3}


def test_a_failure_nobody_waited_for_is_raised_by_the_next_save(tmp_path):
    f, model, opt = job()
    step(model, opt, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        handle = f.save_checkpoint(tmp_path / "c", async_save=True)
        while not handle.done():
            handle._finished.wait(0.05)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with pytest.raises(CheckpointError, match="the save to .*c failed"):
        f.save_checkpoint(tmp_path / "c")
    assert f.save_checkpoint(tmp_path / "c").done()  # raised once


def test_keep_last_keeps_the_newest_and_loads_the_newest(tmp_path):
    f, model, opt = job()
    for i in range(4):
        step(model, opt, i)
        f.save_checkpoint(tmp_path / "c", extra={"n": i + 1}, async_save=i % 2 == 0,
                          keep_last=2)
    last = params(model)
    f.load_checkpoint(tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["latest", "step-3", "step-4"]
    assert (tmp_path / "c" / "latest").read_text() == "step-4\n" and has_checkpoint(tmp_path / "c")
    g, fresh, _ = job(seed=1)
    assert g.load_checkpoint(tmp_path / "c") == {"n": 4} and same(fresh, last)
    with pytest.raises(CheckpointError, match="holds checkpoints kept by keep_last"):
        f.save_checkpoint(tmp_path / "c")
    f.save_checkpoint(tmp_path / "single")
    with pytest.raises(CheckpointError, match="holds a single checkpoint .*keep_last=2"):
        f.save_checkpoint(tmp_path / "single", keep_last=2)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"keep_last expects None .* got {bad!r}"):
            f.save_checkpoint(tmp_path / "c", keep_last=bad)
    with pytest.raises(TypeError, match="async_save=.... expects True or False, got 'yes'"):
        f.save_checkpoint(tmp_path / "c", async_save="yes")


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_auto_checkpoint_with_keep_last_resumes_to_the_same_parameters(tmp_path, async_save):
    def run(f, model, opt, stop):
        start = f.auto_checkpoint(tmp_path / "c", every_steps=2, async_save=async_save,
                                  keep_last=2)
        for i in range(start, stop):
            step(model, opt, i)
        return start

    f, model, opt = job()
    for i in range(8):
        step(model, opt, i)
    reference = params(model)
    f, model, opt = job()
    assert run(f, model, opt, 5) == 0
    f._wait_for_save()  # what the exit of the process does
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["latest", "step-2", "step-4"]
    f, model, opt = job(seed=1)
    assert run(f, model, opt, 8) == 4
    assert same(model, reference)


def test_the_docstring_examples_of_the_new_modules_run():
    import doctest

    from fleetx.checkpoint import background, rotation
    for module in (background, rotation):
        failures, tried = doctest.testmod(module)
        assert failures == 0 and tried >= 3, module.__name__
