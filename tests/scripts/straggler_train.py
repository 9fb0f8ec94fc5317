"""A 3-rank data-parallel job with a straggler in each half: for the first HALF steps
STRAGGLER_SLOW_RANK sleeps SLOW_S more than the others every step; then STRAGGLER_FROZEN_RANK
writes its pid to $FLEETX_LOG_DIR/frozen.pid, for the test to freeze and thaw it (SIGSTOP /
SIGCONT) until the job ends."""
import os
import time

import torch

from fleetx import fleet

STEPS, HALF, BASE_S, SLOW_S = 80, 40, 0.03, 0.06

fleet.init(is_collective=True)
rank = fleet.worker_index()
slow = int(os.environ["STRAGGLER_SLOW_RANK"])
frozen = int(os.environ["STRAGGLER_FROZEN_RANK"])
torch.manual_seed(0)
model = fleet.distributed_model(torch.nn.Linear(16, 4))
opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
x = torch.randn(8, 16)
for step in range(STEPS):
    if rank == frozen and step == HALF:
        path = os.path.join(os.environ["FLEETX_LOG_DIR"], "frozen.pid")
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
    time.sleep(BASE_S + (SLOW_S if rank == slow and step < HALF else 0.0))  # the "data loading"
    opt.minimize(model(x).pow(2).mean())
print(f"rank {rank} done", flush=True)
