"""The model, data and process control of the fleet-level parameter-server tests.

``Net`` has an ``nn.Embedding(sparse=True)`` (two id slots), an ``nn.EmbeddingBag(sparse=True)``
(three tags, mean) and a small MLP over both plus dense features; the label depends on the first
id, so the embedding has something to learn. :func:`start_job` starts every role of a job as
its own process running ``ps_fleet_train.py`` with the environment fleetrun would give it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from helpers import Script, free_ports  # noqa: E402  (tests/helpers.py)

SCRIPT = HERE / "ps_fleet_train.py"
VOCAB, TAGS, DIM, NDENSE, BATCH = 40, 25, 4, 3, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.tags = nn.EmbeddingBag(TAGS, DIM, mode="mean", sparse=True)
        self.mlp = nn.Sequential(nn.Linear(3 * DIM + NDENSE, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids, tags, x):
        feats = torch.cat([self.emb(ids).flatten(1), self.tags(tags), x], 1)
        return self.mlp(feats).squeeze(1)


def make_model() -> Net:
    torch.manual_seed(0)  # every role builds the same model
    return Net()


def batch(step: int, rank: int = 0, nranks: int = 1):
    """Rank ``rank``'s share (every ``nranks``-th sample) of step ``step``'s union batch."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, 2), generator=g)
    tags = torch.randint(0, TAGS, (BATCH, 3), generator=g)
    x = torch.rand(BATCH, NDENSE, generator=g)
    y = (ids[:, 0] < VOCAB // 2).float()
    return ids[rank::nranks], tags[rank::nranks], x[rank::nranks], y[rank::nranks]


def loss_of(model, ids, tags, x, y) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(ids, tags, x), y)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    return {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[name](params, lr=lr)


def reference(steps: int, optimizer: str = "adagrad", lr: float = 0.1) -> dict:
    """One torch process on the union batches: the sync contract's expected result."""
    model = make_model()
    opt = make_optimizer(optimizer, model.parameters(), lr)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    return snapshot(model.emb.weight.detach(), model.tags.weight.detach(), model.mlp)


def snapshot(emb, tags, mlp) -> dict:
    out = {f"mlp.{k}": v.detach().numpy().copy() for k, v in mlp.state_dict().items()}
    out.update(emb=emb.numpy().copy(), tags=tags.numpy().copy())
    return out


# -- processes ----------------------------------------------------------------------------------
def start_job(out: Path, servers: int, workers: int, *args: str, extra_env=None,
              script: Path = SCRIPT) -> list:
    """Start every role of a job (servers first) running ``script``; returns
    ``[(name, Script)]`` (a Popen-like process, see tests/helpers.py)."""
    ports = free_ports(servers + workers)
    server_eps = [f"127.0.0.1:{p}" for p in ports[:servers]]
    worker_eps = [f"127.0.0.1:{p}" for p in ports[servers:]]
    base = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                PADDLE_PSERVERS_IP_PORT_LIST=",".join(server_eps),
                PADDLE_TRAINER_ENDPOINTS=",".join(worker_eps), PADDLE_TRAINERS_NUM=str(workers),
                POD_IP="127.0.0.1", FLEETX_TIMEOUT="60", FLEETX_PS_HEARTBEAT_INTERVAL="0.5",
                FLEETX_PS_DEAD_AFTER="10", **(extra_env or {}))
    procs = []
    for i, ep in enumerate(server_eps):
        env = dict(base, TRAINING_ROLE="PSERVER", PADDLE_PORT=ep.rsplit(":", 1)[1])
        procs.append((f"server {i}", _spawn(env, out, args, script)))
    for r, ep in enumerate(worker_eps):
        env = dict(base, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID=str(r),
                   PADDLE_PORT=ep.rsplit(":", 1)[1])
        procs.append((f"worker {r}", _spawn(env, out, args, script)))
    return procs


def _spawn(env: dict, out: Path, args, script: Path = SCRIPT) -> Script:
    # ``python script --out ...``, forked from the server that imported torch and fleetx once
    return Script([str(script), "--out", str(out), *args], ROOT, env, merged=True)


def finish(procs, timeout: float = 120.0) -> dict:
    """Wait for every process; returns ``{name: (returncode, output)}`` (stragglers killed)."""
    deadline, results = time.monotonic() + timeout, {}
    for name, p in procs:
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text = "TIMEOUT\n" + p.communicate()[0]
        results[name] = (p.returncode, text)
    return results


def run_job(out: Path, servers: int, workers: int, *args: str, extra_env=None,
            timeout: float = 120.0, script: Path = SCRIPT) -> dict:
    """Run a job to the end; every process must exit 0."""
    out.mkdir(parents=True, exist_ok=True)
    results = finish(start_job(out, servers, workers, *args, extra_env=extra_env,
                               script=script), timeout)
    for name, (rc, text) in results.items():
        assert rc == 0, f"{name} exited {rc}:\n{text[-3000:]}"
    return results
