"""Run by ``fleetrun --gpus 0`` in test_gpu_data_parallel.py: train the small MLP through fleet
on the launcher's GPU and save what the parent compares (``argv[1]``: the output file)."""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_jobs import batches, mlp  # noqa: E402

from fleetx import fleet  # noqa: E402


def main(out: str) -> None:
    fleet.init(is_collective=True)
    device = fleet.local_device()
    model = fleet.distributed_model(mlp().to(device))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for x, y in batches(6, 16):
        opt.minimize(nn.functional.mse_loss(model(x.to(device)), y.to(device)))
    torch.save({"state": {k: v.cpu() for k, v in model.state_dict().items()},
                "device": str(device), "worker_num": fleet.worker_num(),
                "plan": fleet.applied_strategies(),
                "visible": torch.cuda.device_count()}, out)


if __name__ == "__main__":
    main(sys.argv[1])
