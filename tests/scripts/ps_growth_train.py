"""A scripted id stream through a table with admission and eviction, on every role of a job
(``fleetrun --server_num 2 --worker_num 2``) or alone (plain python).

Each pass is a list of steps; each step gives every worker its ids (alone, the process takes
every worker's ids of a step in one batch). After each pass every worker calls
``fleet.shrink()``; worker 0 writes ``<out>/growth.json``: the shrink results and the memory
report after each pass, and what evaluation lookups of ids never trained read.
"""
import argparse
import json
from pathlib import Path

import torch
from torch import nn

from fleetx import fleet
from fleetx.nn import SparseEmbedding
from fleetx.ps.api import AccessorConfig, CountFilterEntry, InitConfig

# STREAM[pass][step][worker] = ids
STREAM = [
    [[[1, 2, 3], [3, 4]], [[1, 5], [2, 6]]],
    [[[4], [7]], [[1], [7]]],
    [[[1], [4]], [[5], [9]]],
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = SparseEmbedding(4, name="emb", init=InitConfig("uniform", seed=3),
                                   entry=CountFilterEntry(2),
                                   accessor=AccessorConfig(delete_after_unseen_days=1))
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    fleet.init()
    torch.manual_seed(0)
    model = fleet.distributed_model(Net())
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = False
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return

    fleet.init_worker()
    rank, alone = fleet.worker_index(), fleet.server_num() == 0
    record = {"passes": [], "eval": None}
    for p, steps in enumerate(STREAM):
        for step in steps:
            ids = [i for w in step for i in w] if alone else step[rank]
            opt.minimize(model(torch.tensor(ids)).pow(2).mean())
        shrunk = fleet.shrink()
        if rank == 0:
            record["passes"].append({"shrink": shrunk, "report": fleet.table_stats()})
        if not alone:  # the next pass's lookups wait until worker 0 read this pass's report
            fleet.barrier_worker()
    model.eval()
    with torch.no_grad():  # never-trained ids read zeros and are never counted
        for _ in range(3):
            out = model.emb(torch.tensor([100, 101]))
    record["eval"] = out.abs().sum().item()
    if rank == 0:
        record["final"] = fleet.print_table_stat()
        Path(args.out, "growth.json").write_text(json.dumps(record))
    fleet.stop_worker()


if __name__ == "__main__":
    main()
