"""A parameter-server worker process for the tests (numpy only): trains ps_cluster's model.

Usage: python ps_worker.py --cluster C --rank R --out OUT.npz [--steps N] [--k-steps K]
       [--max-merge M] [--constant-grads] [--die-after S] [--hang-after S] [--sleep-before T]
       [--stop-after S] [--pull-after-stop] [--stuck-after S]

``--hang-after`` freezes the whole process (SIGSTOP: no heartbeats either); ``--stuck-after``
makes only the main thread sleep forever while the heartbeat thread goes on.

Writes OUT.npz with the final dense weights, the rows of ps_cluster.VOCAB, and the losses.
On a parameter-server error it prints ``ERROR <class>: <message>`` to stderr and exits 3.
"""
import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from ps_cluster import DIM, NUMEL, VOCAB, batch, forward_backward, initial_dense  # noqa: E402

from fleetx.ps import CommunicatorConfig, PSConfig, PSError, Tables  # noqa
from fleetx.ps_torch import make_communicator  # noqa


def main():
    ap = argparse.ArgumentParser()
    for flag, kind, default in (("--cluster", str, None), ("--rank", int, 0),
                                ("--out", str, None), ("--steps", int, 4),
                                ("--k-steps", int, 1), ("--max-merge", int, 1),
                                ("--die-after", int, -1), ("--hang-after", int, -1),
                                ("--stop-after", int, -1), ("--sleep-before", float, 0.0),
                                ("--stuck-after", int, -1),
                                ("--geo-lr", float, 0.1)):
        ap.add_argument(flag, type=kind, default=default)
    ap.add_argument("--constant-grads", action="store_true")
    args = ap.parse_args()
    spec = json.loads(Path(args.cluster).read_text())
    config = PSConfig(**spec["config"])
    tables = Tables.from_json(json.dumps(spec["tables"]))
    comm = make_communicator(config, args.rank, tables,
                             CommunicatorConfig(k_steps=args.k_steps,
                                                max_merge_var_num=args.max_merge))
    try:
        run(comm, config, args)
    except PSError as e:
        print(f"ERROR {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)


def run(comm, config, args):
    n, r = config.num_workers, args.rank
    w = comm.start(dense={"dense": initial_dense()})["dense"].copy()
    if args.sleep_before:
        time.sleep(args.sleep_before)
    losses = []
    for step in range(args.steps):
        if step == args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.hang_after:
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == args.stuck_after:
            print("stuck", file=sys.stderr, flush=True)
            time.sleep(10 ** 6)
        if step == args.stop_after:
            break
        ids, x, y = batch(step)
        ids, x, y = ids[r::n], x[r::n], y[r::n]
        if args.constant_grads:  # gradients that do not depend on the weights
            dw = np.full(NUMEL, 0.01 * (r + 1) * (step + 1), np.float32)
            drows = np.ones((len(ids), ids.shape[1], DIM), np.float32) * (r + 1)
        else:
            rows = comm.pull_sparse({"emb": ids}).wait().sparse["emb"].expand()
            loss, drows, dw = forward_backward(rows, x, y, w)
            losses.append(loss)
        if config.mode.value == "geo":  # GEO: the user's optimizer steps dense weights locally
            w -= np.float32(args.geo_lr) * dw
        params = {"dense": w}
        comm.step(params, {"dense": dw}, {"emb": (ids.reshape(-1), drows.reshape(-1, DIM))})
        w = params["dense"]
    comm.flush()
    if args.stop_after >= 0:  # stop early, then check that reads still work alone
        comm.stop()
        return
    comm.barrier("end")  # flushes, then waits: every worker's updates are applied
    rows = comm.pull_sparse({"emb": VOCAB}, create=False).wait().sparse["emb"].expand()
    dense = comm.client.pull(dense=["dense"]).wait().dense["dense"]
    np.savez(args.out, dense=dense, rows=rows, losses=np.array(losses), local=w)
    comm.stop()


if __name__ == "__main__":
    main()
