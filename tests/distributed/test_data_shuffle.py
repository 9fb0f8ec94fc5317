"""InMemoryDataset.global_shuffle on real processes (gloo over loopback): after it, each worker's
share is a uniform random sample of all files (a chi-square test of the file of origin per
worker), nothing is lost or duplicated, sizes are summed over the workers, no pickle carries the
samples, and a worker that does not come is named instead of waited for."""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spawn import run  # noqa: E402

SIZES = [400, 100, 300, 200, 500, 100]  # six files, of uneven sizes
TOTAL = sum(SIZES)


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for a chi-square variable with ``k`` degrees of freedom (closed forms of the
    regularized upper incomplete gamma function Q(k/2, x/2) for integer k)."""
    h = x / 2
    if k % 2 == 0:
        return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(k // 2))
    tail = sum(math.exp((i - 0.5) * math.log(h) - h - math.lgamma(i + 0.5))
               for i in range(1, (k + 1) // 2)) if h > 0 else 0.0
    return math.erfc(math.sqrt(h)) + tail


def file_test(counts: np.ndarray) -> float:
    """The p-value of "these per-file counts are a uniform sample of all files"."""
    expected = counts.sum() * np.array(SIZES) / TOTAL
    return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), len(SIZES) - 1)


def test_chi2_sf_matches_tables():
    # 95th and 99th percentiles of chi-square tables
    for x, k, p in [(3.841459, 1, 0.05), (5.991465, 2, 0.05), (11.070498, 5, 0.05),
                    (15.086272, 5, 0.01), (6.634897, 1, 0.01), (20.090235, 8, 0.01)]:
        assert chi2_sf(x, k) == pytest.approx(p, rel=1e-5)


def write_files(folder: Path) -> list:
    """Sample ``g`` (global id) of file ``f``: file [f], id [g], ids [g] * (g % 3 + 1),
    x [g / 2, -g]."""
    paths, g = [], 0
    for f, size in enumerate(SIZES):
        lines = []
        for _ in range(size):
            n = g % 3 + 1
            lines.append(f"1 {f} 1 {g} {n} {' '.join([str(g)] * n)} 2 {g / 2} {-g}.0")
            g += 1
        paths.append(folder / f"part-{f}")
        paths[-1].write_text("\n".join(lines) + "\n")
    return [str(p) for p in paths]


def slots():
    from fleetx.data import Slot
    return [Slot("file", "int64", 1), Slot("id", "int64", 1), Slot("ids"),
            Slot("x", "float32", 2)]


def join(rank: int, world: int):
    from fleetx import fleet
    from fleetx.role_maker import UserDefinedRoleMaker
    endpoints = [f"127.0.0.1:{os.environ['MASTER_PORT']}"] + ["127.0.0.1:1"] * (world - 1)
    fleet.init(UserDefinedRoleMaker(is_collective=True, current_id=rank,
                                    worker_endpoints=endpoints))
    return fleet


def columns(dataset) -> dict:
    out = {"file": [], "id": [], "ids_ok": True, "x_ok": True}
    for batch in dataset:
        ids = batch["id"].flatten()
        out["file"] += batch["file"].flatten().tolist()
        out["id"] += ids.tolist()
        expected = torch.repeat_interleave(ids, ids % 3 + 1)
        out["ids_ok"] &= torch.equal(batch["ids"].values, expected)
        out["x_ok"] &= torch.equal(batch["x"], torch.stack([ids / 2, -ids.float()], 1))
    return out


class NoPickle:
    """Within the block, any use of pickle raises."""

    def __enter__(self):
        import pickle
        self.saved = {n: getattr(pickle, n) for n in ("dumps", "loads", "Pickler", "Unpickler",
                                                       "dump", "load")}

        def refuse(*args, **kwargs):
            raise AssertionError("pickle used during the global shuffle")
        for name in self.saved:
            setattr(pickle, name, refuse)
        return self

    def __exit__(self, *exc):
        import pickle
        for name, value in self.saved.items():
            setattr(pickle, name, value)


def _shuffle(rank: int, world: int, out: str, folder: str) -> None:
    from fleetx.data import InMemoryDataset
    fleet = join(rank, world)
    files = write_files(Path(folder)) if rank == 0 else None
    fleet.barrier_worker()
    files = [str(Path(folder) / f"part-{f}") for f in range(len(SIZES))]
    dataset = InMemoryDataset()
    dataset.init(batch_size=64, thread_num=2, use_var=slots())
    dataset.set_filelist(fleet.util.get_file_shard(files))
    dataset.load_into_memory()
    result = {"shard": dataset.filelist, "before": columns(dataset),
              "memory_before": dataset.get_memory_data_size(fleet)}
    with NoPickle():
        dataset.global_shuffle(fleet, seed=11)
    result.update(after=columns(dataset), local=len(dataset),
                  memory=dataset.get_memory_data_size(fleet),
                  shuffled=dataset.get_shuffle_data_size(fleet),
                  everyone=[a.tolist() for a in fleet.util.all_gather(
                      np.array(columns(dataset)["id"], np.int64))])
    torch.save(result, f"{out}/rank{rank}.pt")


def test_global_shuffle_gives_every_worker_a_uniform_sample(tmp_path):
    run(_shuffle, 3, str(tmp_path), str(tmp_path), deadline=240)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    assert [[Path(p).name for p in r["shard"]] for r in results] == \
        [["part-0", "part-1"], ["part-2", "part-3"], ["part-4", "part-5"]]  # get_file_shard
    for r in results:
        before = np.bincount(r["before"]["file"], minlength=len(SIZES))
        after = np.bincount(r["after"]["file"], minlength=len(SIZES))
        assert file_test(before) < 1e-30          # the test sees a worker's own files...
        assert file_test(after) > 0.01, after     # ...and after the exchange, all files alike
        assert after.min() > 0 and r["local"] == len(r["after"]["id"])
        assert r["memory_before"] == r["memory"] == r["shuffled"] == TOTAL
        assert r["after"]["ids_ok"] and r["after"]["x_ok"]  # ragged and dense slots intact
        assert r["everyone"] == results[0]["everyone"]
    every_id = sorted(i for share in results[0]["everyone"] for i in share)
    assert every_id == list(range(TOTAL))  # nothing lost, nothing twice
    assert len({r["local"] for r in results}) > 1  # shares are random, not cut evenly
    ordered = results[0]["after"]["id"]
    assert ordered != sorted(ordered)  # and shuffled within a worker


def _absent(rank: int, world: int, out: str, mode: str) -> None:
    from fleetx.comm.api import CommError
    from fleetx.data import InMemoryDataset, Slot, ShuffleError
    os.environ["FLEETX_TIMEOUT"] = "3"
    fleet = join(rank, world)
    (Path(out) / f"f{rank}").write_text("1 5\n1 6\n")
    dataset = InMemoryDataset()
    declared = [Slot("a")] if rank == 0 or mode == "absent" else [Slot("a", "float32")]
    dataset.init(use_var=declared)
    dataset.set_filelist([str(Path(out) / f"f{rank}")])
    dataset.load_into_memory()
    fleet.barrier_worker()
    if mode == "absent" and rank == 1:
        time.sleep(6)  # alive, but never joins the shuffle
        return
    start = time.monotonic()
    try:
        dataset.global_shuffle(fleet)
        message = "no error"
    except (CommError, ShuffleError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    torch.save({"message": message, "seconds": time.monotonic() - start},
               f"{out}/rank{rank}.pt")


def test_a_worker_that_does_not_come_is_named(tmp_path):
    run(_absent, 2, str(tmp_path), "absent", deadline=120)
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r["message"].startswith("CommError: barrier failed"), r["message"]
    assert "rank 1" in r["message"] or "Ranks 1" in r["message"] or "Rank 1" in r["message"]
    assert r["seconds"] < 30


def test_workers_with_other_slots_are_refused(tmp_path):
    run(_absent, 2, str(tmp_path), "slots", deadline=120)
    for rank, other in [(0, 1), (1, 0)]:
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert r["message"].startswith(f"ShuffleError: global_shuffle on worker {rank}: the "
                                       f"block from worker {other} was made with other slots")
