"""fleet.save_checkpoint / load_checkpoint in one process: resuming equals uninterrupted training
(Adam, amp's loss scale, gradient merge saved between two micro-steps of a merge), a damaged
file of any kind is a "checksum mismatch" naming it with nothing loaded, a save killed (SIGKILL
of a real process) at two points leaves the previous checkpoint loadable, and saving again
replaces the checkpoint."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fleetx import fleet
from fleetx.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_process")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def batches(n: int = 7):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def job(seed: int = 0):
    """A fresh fleet training a fresh model under amp + gradient merge, with Adam."""
    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"init_loss_scaling": 1024.0, "incr_every_n_steps": 2}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2}
    f = fleet.Fleet()
    f.init(is_collective=True, strategy=s)
    model = f.distributed_model(make_model(seed))
    opt = f.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    return f, model, opt


def train(model, opt, data) -> None:
    for x, y in data:
        opt.minimize(nn.functional.mse_loss(model(x), y))


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resuming_equals_uninterrupted_training(tmp_path):
    data = batches()
    f, model, opt = job()
    train(model, opt, data[:5])  # 5 micro-steps: saved in the middle of a merge
    scale = opt.get_loss_scaling()
    assert scale != 1024.0 and model.module[0].weight.grad is not None
    f.save_checkpoint(str(tmp_path), extra={"step": 5})
    saved = params(model)
    train(model, opt, data[5:])
    g, resumed, ropt = job(seed=1)  # other initial weights: everything must come from the file
    assert g.load_checkpoint(str(tmp_path)) == {"step": 5}
    assert all(torch.equal(v, saved[k]) for k, v in resumed.state_dict().items())
    assert ropt.get_loss_scaling() == scale
    assert ropt.state_dict()["fleetx"]["gradient_merge"] == {"micro_step": 5}
    train(resumed, ropt, data[5:])
    end, again = params(model), params(resumed)
    assert max((end[k] - again[k]).abs().max().item() for k in end) <= 1e-6
    assert max((end[k] - saved[k]).abs().max().item() for k in end) > 1e-4  # it trained on
    assert ropt.get_loss_scaling() == opt.get_loss_scaling()
    assert ropt.inner.state_dict()["state"][0]["step"] == opt.inner.state_dict()["state"][0]["step"]


def test_saving_again_replaces_the_checkpoint(tmp_path):
    f, model, opt = job()
    train(model, opt, batches(2))
    f.save_checkpoint(str(tmp_path), extra={"step": 1})
    train(model, opt, batches(2))
    f.save_checkpoint(str(tmp_path), extra={"step": 2})
    assert len(list(tmp_path.glob("save-*"))) == 1
    g, resumed, _ = job(seed=1)
    assert g.load_checkpoint(str(tmp_path)) == {"step": 2}
    assert all(torch.equal(v, params(model)[k]) for k, v in resumed.state_dict().items())


def _files(tmp_path: Path) -> list:
    (folder,) = tmp_path.glob("save-*")
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "fleetx.json",
                                  "strategy-rank0.json"])
def test_a_flipped_byte_is_a_checksum_mismatch_naming_the_file(tmp_path, name):
    f, model, opt = job()
    train(model, opt, batches(2))
    f.save_checkpoint(str(tmp_path))
    assert name in _files(tmp_path)
    (path,) = tmp_path.glob(f"save-*/{name}")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    g, fresh, fopt = job(seed=1)
    before = params(fresh)
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        g.load_checkpoint(str(tmp_path))
    assert str(path) in str(e.value) and e.value.path == str(path)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not fopt.inner.state  # nothing loaded into the optimizer either


def test_wrong_uses_are_errors_naming_the_cause(tmp_path):
    f, model, opt = job()
    with pytest.raises(TypeError, match="JSON-able"):
        f.save_checkpoint(str(tmp_path), extra={"t": torch.ones(1)})
    assert not list(tmp_path.glob("*"))  # nothing written
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        f.load_checkpoint(str(tmp_path))
    f.save_checkpoint(str(tmp_path))
    other = fleet.Fleet()
    other.init(is_collective=True)
    with pytest.raises(fleet.FleetError, match="distributed_model"):
        other.load_checkpoint(str(tmp_path))
    bigger = other.distributed_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(),
                                                   nn.Linear(16, 2), nn.Linear(2, 2)))
    with pytest.raises(CheckpointError, match="no parameter '3.weight'"):
        other.load_checkpoint(str(tmp_path))
    assert bigger is not None


_CRASHING_SAVER = textwrap.dedent("""
    import sys, time
    import torch
    sys.path.insert(0, sys.argv[3])
    from test_training_checkpoint import job, train, batches
    from fleetx.checkpoint import training
    path, where = sys.argv[1], sys.argv[2]
    f, model, opt = job()
    train(model, opt, batches(2))
    f.save_checkpoint(path, extra={"step": 1})
    torch.save(model.state_dict(), path + ".first.pt")
    train(model, opt, batches(2))
    target = {"files": training.SaveWriter, "commit": training.SaveWriter}[where]
    name = {"files": "write_json", "commit": "commit"}[where]
    original = getattr(target, name)
    def stall(*args, **kwargs):
        print("writing", flush=True)  # DCP's files of the new save are on disk by now
        time.sleep(120)
    setattr(target, name, stall)
    f.save_checkpoint(path, extra={"step": 2})
""")


@pytest.mark.parametrize("where", ["files", "commit"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen([sys.executable, "-c", _CRASHING_SAVER, str(ckpt), where,
                          str(Path(__file__).parent)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert p.stdout.readline().strip() == "writing", p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert len(list(ckpt.glob("save-*"))) == 2  # the committed save and the killed one
    first = torch.load(str(ckpt) + ".first.pt")
    g, resumed, _ = job(seed=1)
    assert g.load_checkpoint(str(ckpt)) == {"step": 1}
    assert all(torch.equal(v, first[k]) for k, v in resumed.state_dict().items())
    g.save_checkpoint(str(ckpt), extra={"step": 3})  # the next save removes the killed one
    (left,) = ckpt.glob("save-*")
    assert left.name == json.loads((ckpt / "manifest.json").read_text())["folder"]


def test_the_documented_example_runs(tmp_path):
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    section = text.split("### Training checkpoints of collective jobs", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {"torch": torch, "CKPT": str(tmp_path / "ckpt")}
    exec(compile(example, "docs/reliability.md", "exec"), scope)
    assert scope["step"] == 1
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
