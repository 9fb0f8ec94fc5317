"""Asynchronous checkpoints on 2 processes (gloo): training goes on while the save writes, a
second save waits for the first, keep_last keeps the newest 2, the exit of the process waits
for a pending save (each rank returns right after the call), and a rank killed (SIGKILL) while
its background write is under way leaves the previous checkpoint loadable, with the error
naming the folder on the rank that survived. Slow stage: ZeRO, FSDP2 and Local SGD saved
asynchronously load back to the state at the call."""
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spawn  # noqa: E402


def _job(rank: int):
    import warnings
    from fleetx import fleet
    fleet.init(is_collective=True)
    torch.manual_seed(0)
    model = fleet.distributed_model(nn.Sequential(nn.Linear(256, 512), nn.Tanh(),
                                                  nn.Linear(512, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(rank)

    def step():
        opt.minimize(model(torch.randn(16, 256, generator=g)).square().mean())
    return fleet, model, step


def _saves(rank, world, out):
    fleet, model, step = _job(rank)
    ckpt = os.path.join(out, "ckpt")
    for n in range(1, 4):
        step()
        at_call = {k: v.clone() for k, v in model.state_dict().items()}
        handle = fleet.save_checkpoint(ckpt, extra={"n": n}, async_save=True, keep_last=2)
        returned = handle.done()
        step()  # trains while the save writes: the save holds copies, without this step
        torch.save({"at_call": at_call, "after": model.state_dict(), "returned": returned},
                   os.path.join(out, f"rank{rank}-{n}.pt"))
    # returns with the last save pending: the exit of the process must wait for it


def _fresh_model():
    from fleetx import fleet
    f = fleet.Fleet()
    f.init(is_collective=True)
    torch.manual_seed(1)  # other weights: everything must come from the checkpoint
    model = f.distributed_model(nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 4)))
    f.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    return f, model


def test_saves_run_beside_training_keep_the_newest_and_the_exit_waits(tmp_path):
    spawn.run(_saves, 2, str(tmp_path), deadline=240)
    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["latest", "step-3", "step-5"], names  # saved at steps 1, 3, 5: newest 2
    assert (ckpt / "latest").read_text().strip() == "step-5"
    f, model = _fresh_model()
    assert f.load_checkpoint(str(ckpt)) == {"n": 3}  # the save pending at exit was committed
    last = torch.load(tmp_path / "rank0-3.pt")
    assert all(torch.equal(v, last["at_call"][k]) for k, v in model.state_dict().items())
    assert any(not torch.equal(v, last["after"][k]) for k, v in model.state_dict().items())
    assert not torch.load(tmp_path / "rank0-1.pt")["returned"]  # the call did not wait


def _killed(rank, world, out):
    fleet, model, step = _job(rank)
    ckpt = os.path.join(out, "ckpt")
    step()
    fleet.save_checkpoint(ckpt, extra={"n": 1})
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "first.pt"))
    step()
    handle = fleet.save_checkpoint(ckpt, extra={"n": 2}, async_save=True)
    if rank == 1:
        # die while this rank's background write is under way: once its DCP file is there,
        # before it has hashed and reported it, so the commit can never have happened
        deadline = time.monotonic() + 60
        while not any(p.name.startswith("__1_") for p in Path(ckpt).glob("save-*/*")):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        handle.wait()
        result = "committed"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result = f"{type(e).__name__}: {e}"
    Path(out, "rank0.txt").write_text(f"{time.monotonic() - t0:.1f}\n{result}")
    os._exit(0)  # the world is broken: leave without the groups' teardown


def test_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    procs = spawn.start(_killed, 2, str(tmp_path))
    # not procs.join(): on rank 1's death it would terminate rank 0, whose error is the point
    for process in procs.processes:
        process.join(timeout=180)
    assert not any(p.is_alive() for p in procs.processes), "not ended within 180 s"
    assert procs.processes[1].exitcode == -signal.SIGKILL
    elapsed, result = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    ckpt = tmp_path / "ckpt"
    assert result.startswith("CheckpointError: the save to " + str(ckpt)), result
    assert float(elapsed) < 60
    f, model = _fresh_model()
    assert f.load_checkpoint(str(ckpt)) == {"n": 1}
    first = torch.load(tmp_path / "first.pt")
    assert all(torch.equal(v, first[k]) for k, v in model.state_dict().items())
    assert len(list(ckpt.glob("save-*"))) == 2  # the committed save and the killed one


def _sharded(rank, world, out):
    from test_sharded_checkpoint import batches, build, train
    data = batches(4)
    results = {}
    for case, kwargs in (("stage1", {"stage": 1}), ("stage3", {"stage": 3}),
                         ("localsgd", {"stage": 0, "localsgd": True})):
        f, model, opt = build(**kwargs)
        train(model, opt, data[:3], rank, world)  # Local SGD: the ranks' copies differ now
        at_call = {k: v.clone() for k, v in model.state_dict().items()}
        handle = f.save_checkpoint(os.path.join(out, case, "a"), async_save=True)
        train(model, opt, data[3:], rank, world)  # trains while it writes
        handle.wait()
        g, fresh, _ = build(seed=5, **kwargs)
        g.load_checkpoint(os.path.join(out, case, "a"))
        results[case] = {"at_call": at_call, "loaded": fresh.state_dict()}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_sharded_and_diverging_replicas_save_asynchronously_to_the_state_at_the_call(tmp_path):
    """ZeRO (stage 1), FSDP2 (stage 3) and Local SGD (each rank's own copy, found by hashes
    exchanged on the checkpoint group): the asynchronous save loads back to the state at the
    call on every rank."""
    results = spawn.run_and_load(_sharded, 2, tmp_path, deadline=240)
    for rank, result in enumerate(results):
        for case, got in result.items():
            assert spawn.max_diff(got["at_call"], got["loaded"]) == 0, (rank, case)
    assert spawn.max_diff(results[0]["localsgd"]["at_call"], results[1]["localsgd"]["at_call"]) > 0
