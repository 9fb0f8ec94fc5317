"""Plain PyTorch DDP, no fleetx: 20 steps, then rank 0 saves while rank 1 ends and both call
``destroy_process_group()``. Under bare torchrun this aborts at exit now and then (SIGABRT in
torch's gloo threads during interpreter teardown); tests/launch/test_clean_exit.py starts it with
``torchrun -m fleetx.run`` instead."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
generator = torch.Generator().manual_seed(dist.get_rank())
for _ in range(20):
    x = torch.randn(16, 32, generator=generator)
    y = torch.randint(0, 4, (16,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
if dist.get_rank() == 0:
    torch.save(model.module.state_dict(), "model.pt")
dist.destroy_process_group()
