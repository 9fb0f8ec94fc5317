"""Launched by tests/launch/test_srun_mpirun_env.py as srun / mpirun would start it (their
variables only): a few data-parallel steps on rank-dependent data through fleet's collective API,
then one line ``RESULT rank world local_rank local_world master param-sum`` per rank."""
import torch
from torch import nn

from fleetx import fleet

fleet.init(is_collective=True)
rank, world = fleet.worker_index(), fleet.worker_num()
torch.manual_seed(0)
model = fleet.distributed_model(nn.Linear(4, 2))
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data: only the all-reduce
for _ in range(3):                                 # of the gradients keeps them equal
    x = torch.randn(8, 4, generator=gen)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.clear_grad()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
print("RESULT", rank, world, fleet.local_rank(), " ".join(f"{v:.8f}" for v in params.tolist()),
      flush=True)
