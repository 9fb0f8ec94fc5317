"""Admission in sync mode keeps the data-parallel contract: 2 workers each pulling and pushing
half of a step's ids admit and create exactly the rows 1 worker admits on the whole (doubled)
batch, with the same weights, pending counts and statistics to the bit.

One worker's batch counts each distinct id once per step (its pull de-duplicates). So in sync
mode a sighting is counted at the round's merged update, which holds each id of the step once,
however many workers saw it; pulls do not count (in async mode, where there is no step, each
training pull request still counts)."""
import numpy as np
import pytest

from fleetx.ps.api import (AccessorConfig, CountFilterEntry, InitConfig, PSConfig,
                           ProbabilityEntry, RuleConfig, SparseTableSpec, Tables)
from fleetx.ps.requests import Push
from fleetx.ps.shard import Shard

DIM = 3


def shard(entry, workers, mode="sync"):
    spec = SparseTableSpec("t", DIM, RuleConfig("adagrad", lr=0.1), InitConfig("uniform", seed=2),
                           entry=entry, accessor=AccessorConfig(delete_after_unseen_days=2))
    return Shard(PSConfig(["127.0.0.1:1"], workers, mode=mode), 0, Tables((spec,)))


def pull(s, ids):
    return s.pull({"sparse": ["t"], "create": True}, [ids])[0]


def run(entry, workers, steps, mode="sync"):
    """Each step: every worker pulls its ids (unique), then one sync round of their pushes;
    one worker (``workers == 1``) pulls the step's ids together and pushes every worker's
    gradients, halved (the mean over the doubled batch), in one push. A shrink every 4 steps.
    """
    s = shard(entry, workers, mode)
    for k, (halves, grads) in enumerate(steps):
        if workers == 2:
            for ids in halves:
                pull(s, ids)
            pushes = [Push([("t", ids, g)], [], []) for ids, g in zip(halves, grads)]
        else:
            pull(s, np.unique(np.concatenate(halves)))
            pushes = [Push([("t", np.concatenate(halves),
                             np.concatenate(grads) * np.float32(0.5))], [], [])]
        if mode == "sync":
            s.apply_mean(pushes)
        else:
            for p in pushes:
                s.apply(p)
        if k % 4 == 3:
            s.shrink(None)
    return s


def stream(seed, n=24):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):  # the ids drift, so that old rows go unseen and are evicted
        halves = [np.unique(rng.integers(2 * k, 2 * k + 30, 8)).astype(np.int64)
                  for _ in range(2)]
        out.append((halves, [rng.standard_normal((len(h), DIM)).astype(np.float32)
                             for h in halves]))
    return out


def state(s):
    t = s.sparse["t"]
    keys = t.index.keys.copy()
    pend_ids, pend = t.admission.state()
    return {"rows": dict(zip(keys.tolist(), t.slab.tolist())),
            "stats": dict(zip(keys.tolist(), t.row_stats(keys).tolist())),
            "pending": dict(zip(pend_ids.tolist(), pend.tolist())),
            "created": t.counters["created"], "removed": t.counters["removed"],
            "dropped": t.counters["dropped_updates"], "passes": t.passes}


@pytest.mark.parametrize("entry", [CountFilterEntry(2), CountFilterEntry(3),
                                   ProbabilityEntry(0.3, seed=11)])
def test_two_sync_workers_admit_exactly_what_one_worker_on_the_doubled_batch_admits(entry):
    steps = stream(4)
    two, one = state(run(entry, 2, steps)), state(run(entry, 1, steps))
    assert two == one
    assert two["created"] > 0 and two["dropped"] > 0 and two["removed"] > 0 and two["pending"]


def test_an_id_seen_by_both_workers_of_a_step_counts_once():
    ids = np.array([7], np.int64)
    g = np.ones((1, DIM), np.float32)
    s = shard(CountFilterEntry(2), 2)
    for _ in range(2):  # without a row: both read zeros, the round counts one sighting
        assert (pull(s, ids) == 0).all() and (pull(s, ids) == 0).all()
        s.apply_mean([Push([("t", ids, g)], [], []), Push([("t", ids, g)], [], [])])
    t = s.sparse["t"]
    assert t.counters["created"] == 1 and t.counters["dropped_updates"] == 1
    assert t.admission.counters["sighted"] == 2


def test_async_mode_still_counts_each_training_pull_request():
    ids = np.array([7], np.int64)
    s = shard(CountFilterEntry(2), 2, mode="async")
    pull(s, ids)
    pull(s, ids)  # the second worker's request: the second sighting, admitted
    s.apply(Push([("t", ids, np.ones((1, DIM), np.float32))], [], []))
    assert s.sparse["t"].counters["created"] == 1
