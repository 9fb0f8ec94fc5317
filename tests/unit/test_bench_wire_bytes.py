"""benchmarks/wire_bytes.py counts bytes at the sockets; check that count against the ring formulas.

At 3 ranks an all-gather sends (n-1) = 2 times its input and a ring all-reduce 2(n-1)/n = 4/3
times its buffer (at 2 ranks both factors are 1 and could not be told apart). The count includes
gloo's message headers, so it may exceed the formula by a little, never fall below it.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import wire_bytes as wb  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import free_ports  # noqa: E402  (tests/helpers.py)

WORLD = 3
ELEMENTS = 65_536  # 256 KiB of float32


def _within(counted: float, formula: float, slack: float) -> bool:
    """Headers only add: ``formula <= counted <= formula * 1.01 + slack``."""
    return formula <= counted <= formula * 1.01 + slack


def _raw_rank(rank: int, world: int, ports: tuple, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", ports[0], world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    barrier = wb.StoreBarrier(rank, world, ports[1])
    tensor = torch.ones(ELEMENTS)
    # the first call of each collective moves extra bytes (gloo's lazy set-up): not counted
    dist.all_reduce(tensor)
    dist.all_gather([torch.empty_like(tensor) for _ in range(world)], tensor)
    readings = {}
    for op in ("all_reduce", "all_gather"):
        barrier.wait()
        sent0, received0, _ = wb.tcp_bytes(set(ports))
        if op == "all_reduce":
            dist.all_reduce(tensor)
        else:
            dist.all_gather([torch.empty_like(tensor) for _ in range(world)], tensor)
        barrier.wait()
        sent1, received1, _ = wb.tcp_bytes(set(ports))
        readings[op] = [sent1 - sent0, received1 - received0]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(readings, f)
    dist.barrier()  # the barrier store's server (rank 0) must outlive every rank's last wait
    dist.destroy_process_group()


def test_socket_count_matches_ring_formulas_for_raw_collectives():
    with tempfile.TemporaryDirectory() as out:
        wb.start_processes(_raw_rank, args=(WORLD, tuple(free_ports(2)), out),
                           nprocs=WORLD, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(WORLD)]
    nbytes = 4 * ELEMENTS
    formula = {"all_reduce": wb.ring_all_reduce(WORLD, nbytes),          # 349,525 B
               "all_gather": wb.ring_all_gather(WORLD, nbytes)}          # 524,288 B
    for rank, reading in enumerate(ranks):
        for op, (sent, received) in reading.items():
            assert _within(sent, formula[op], 1024), (rank, op, sent, formula[op])
            assert _within(received, formula[op], 1024), (rank, op, received, formula[op])


def test_dense_and_dgc_steps_match_the_formula():
    args = argparse.Namespace(model="mlp", steps=2, warmup=2, batch=8)
    counted = wb.count(WORLD, args)
    model = wb.MLP()
    dense, dgc = counted["data_parallel"], counted["dgc"]
    assert dense["formula_sent"] == wb.ring_all_reduce(WORLD, 4 * 37_892)
    # MLP: fc1.weight (32,768 elements) is compressed to k = 32 pairs; 5,124 elements stay dense
    assert dgc["formula_sent"] == wb.ring_all_gather(WORLD, 8 * 32) + wb.ring_all_reduce(
        WORLD, 4 * 5_124)
    assert wb.expected_bytes(model, WORLD, dgc=True) == dgc["formula_sent"]
    for case in (dense, dgc):
        for sent, received in zip(case["sent"], case["received"]):
            # per step: one bucket's collectives (DGC: an all-gather and an all-reduce)
            assert _within(sent, case["formula_sent"], 2048), (case, sent)
            assert _within(received, case["formula_sent"], 2048), (case, received)
