"""Launched by tests/launch/test_clean_exit.py: data parallel (or gradient merge with
``--gradient-merge``) for 20 steps, then rank 0 saves the model while rank 1 simply ends, with no
final barrier. Such ranks leave at different moments, which once made the first one to leave
die of SIGABRT during interpreter teardown."""
import argparse
import os

import torch
import torch.nn.functional as F

from fleetx import fleet

parser = argparse.ArgumentParser()
parser.add_argument("--gradient-merge", action="store_true")
parser.add_argument("--save", default="model.pt")
args = parser.parse_args()

strategy = fleet.DistributedStrategy()
if args.gradient_merge:
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
fleet.init(is_collective=True, strategy=strategy)
torch.manual_seed(0)
model = fleet.distributed_model(torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                        momentum=0.9))
generator = torch.Generator().manual_seed(fleet.worker_index())
for step in range(20):
    x = torch.randn(16, 32, generator=generator)
    y = torch.randint(0, 4, (16,), generator=generator)
    optimizer.minimize(F.cross_entropy(model(x), y))
if fleet.is_first_worker():
    # A save long enough for the other rank to be well into its exit meanwhile.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, args.save)
    with open(args.save + ".done", "w") as f:
        f.write(str(os.getpid()))
