"""The same script on every role of a parameter-server job whose model has a HeterSection
(tests/distributed/test_ps_heter.py, tests/launch/test_fleetrun_heter.py).

``ps_fleet_model.Net`` with its MLP wrapped in ``fleetx.nn.HeterSection``: with heter workers
(``fleetrun --heter_worker_num 1``) the trainers run the embeddings and a heter worker the MLP;
without, the trainers run it all. Workers train ``--steps`` steps on their share of each step's
batch, turn to inference (the MLP's weights come back from the servers), and write
``<out>/worker<rank>.npz``: the losses and the final weights.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ps_fleet_model import (TAGS, VOCAB, batch, loss_of, make_model,  # noqa: E402
                            make_optimizer, snapshot)

from fleetx import fleet  # noqa: E402
from fleetx.nn import HeterSection  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--mode", default="sync", choices=("sync", "async", "geo"))
ap.add_argument("--optimizer", default="adagrad")
ap.add_argument("--lr", type=float, default=0.1)
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--sleep-after", type=int, default=-1, help="worker 1 sleeps after this step")
ap.add_argument("--device-guard", default="cpu")
args = ap.parse_args()

fleet.init()
net = make_model()
net.mlp = HeterSection(net.mlp)
model = fleet.distributed_model(net)
strategy = fleet.DistributedStrategy()
strategy.a_sync = args.mode != "sync"
strategy.a_sync_configs = {"heter_worker_device_guard": args.device_guard,
                           **({"k_steps": 2} if args.mode == "geo" else {})}
opt = fleet.distributed_optimizer(make_optimizer(args.optimizer, model.parameters(), args.lr),
                                  strategy)

if fleet.is_server():  # servers, and heter workers (as in Paddle)
    fleet.init_server()
    fleet.run_server()
    sys.exit(0)

rank, nranks = fleet.worker_index(), fleet.worker_num()
fleet.init_worker()
losses = []
for step in range(args.steps):
    loss = loss_of(model, *batch(step, rank, nranks))
    opt.minimize(loss)
    losses.append(loss.item())
    if rank == 1 and step == args.sleep_after:
        print("worker 1 sleeps", flush=True)
        time.sleep(3600)
fleet.utils.DistributedInfer(model).init_distributed_infer_env()  # the MLP comes back here
model.eval()
with torch.no_grad():
    emb = model.emb(torch.arange(VOCAB))
    tags = model.tags(torch.arange(TAGS).view(-1, 1))
    record = snapshot(emb, tags, net.mlp.module)
fleet.stop_worker()
np.savez(Path(args.out) / f"worker{rank}.npz", losses=np.array(losses), **record)
print(f"worker {rank} done", flush=True)
