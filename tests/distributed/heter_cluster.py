"""An in-process heter job for tests: one server, one heter worker and the trainers on threads
of this process, each role with its own copy of a small model (built with the same seed, as
every process of a real job builds it), over real loopback sockets.

``HNet``: an embedding (sparse), a linear layer on the dense features (trainer-side dense
parameters, table ``dense.0``) and an MLP wrapped in ``HeterSection`` (table ``heter.0``).
"""
from __future__ import annotations

import threading
import traceback
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from fleetx.nn import HeterSection
from fleetx.ps import PSConfig
from fleetx.ps_torch.runtime import PSRuntime

VOCAB, DIM, NDENSE, BATCH = 20, 4, 3, 16


class HNet(nn.Module):
    def __init__(self, heter: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.pre = nn.Linear(NDENSE, DIM)
        mlp = nn.Sequential(nn.Linear(3 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))
        self.mlp = HeterSection(mlp) if heter else mlp

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.emb(ids).flatten(1), self.pre(x)], 1)
        return self.mlp(h).squeeze(1)


_SEEDED = threading.Lock()  # the roles' threads share torch's global generator


def make(heter: bool = True) -> HNet:
    with _SEEDED:
        torch.manual_seed(0)
        return HNet(heter)


def batch(step: int, rank: int = 0, nranks: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, 2), generator=g)
    x = torch.rand(BATCH, NDENSE, generator=g)
    y = (ids[:, 0] < VOCAB // 2).float()
    return ids[rank::nranks], x[rank::nranks], y[rank::nranks]


def loss_of(model, ids, x, y) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(ids, x), y)


def weights(model: HNet) -> dict:
    """Every weight (the embedding read through its lookups)."""
    mlp = model.mlp.module if isinstance(model.mlp, HeterSection) else model.mlp
    out = {f"mlp.{k}": v.detach().cpu().numpy().copy() for k, v in mlp.state_dict().items()}
    out.update({f"pre.{k}": v.detach().numpy().copy() for k, v in model.pre.state_dict().items()})
    with torch.no_grad():
        model.eval()
        out["emb"] = model.emb(torch.arange(VOCAB)).numpy().copy()
        model.train()
    return out


def reference(steps: int, lr: float) -> dict:
    """One plain torch process on the union batches (the sync contract)."""
    model = make(heter=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(step)).backward()
        opt.step()
    return weights(model)


class Roles:
    """Threads running roles; ``errors`` collects what any of them raised."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: dict[str, str] = {}
        self.results: dict[str, object] = {}

    def start(self, name: str, fn: Callable[[], object]) -> None:
        def run():
            try:
                self.results[name] = fn()
            except BaseException:  # noqa: BLE001 - reported by join
                self.errors[name] = traceback.format_exc()
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 60.0) -> None:
        for t in self.threads:
            t.join(timeout)
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"still running: {alive}; failed: " + "\n".join(
            f"{k}:\n{v}" for k, v in self.errors.items())


def runtime(config: PSConfig, role: str, index: int, lr: float,
            device_guard: Optional[str] = None) -> tuple[PSRuntime, HNet]:
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rt = PSRuntime(model, opt, config, is_server=role == "server", index=index,
                   heter_device=device_guard if role == "heter" else None, log_interval=0)
    return rt, model


def train(config: PSConfig, rank: int, steps: int, lr: float, save: Optional[str] = None,
          after: Optional[Callable[[PSRuntime], object]] = None) -> dict:
    """A trainer: ``steps`` steps on its share, then inference (the MLP comes back), then
    (trainer 0, with ``save``) ``save_persistables(save)``; ``after(runtime)``'s result is
    returned under ``"after"``."""
    rt, model = runtime(config, "worker", rank, lr)
    rt.init_worker()
    losses = []
    for step in range(steps):
        loss = loss_of(model, *batch(step, rank, config.num_workers))
        loss.backward()
        rt.step()
        rt.zero_grad()
        losses.append(loss.item())
    rt.init_inference()
    if save:
        rt.save_persistables(save)
    done = after(rt) if after is not None else None
    out = weights(model)
    rt.stop_worker()
    return {"losses": np.array(losses), "after": done, **out}


def score(config: PSConfig, rank: int, lr: float) -> dict:
    """A worker of an inference-only job: the weights it reads (the MLP runs here)."""
    rt, model = runtime(config, "worker", rank, lr)
    rt.init_inference()
    out = weights(model)
    rt.stop_worker()
    return out


def serve_save(config: PSConfig, dirname: str, lr: float) -> None:
    """A server of an inference-only job, serving ``dirname`` read-only."""
    rt, _ = runtime(config, "server", 0, lr)
    rt.init_inference(dirname)


def serve(config: PSConfig, role: str, lr: float, device_guard: str = "cpu") -> None:
    rt, _ = runtime(config, role, 0, lr, device_guard)
    rt.run_server()
