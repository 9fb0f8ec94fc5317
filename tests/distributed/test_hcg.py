"""The hybrid communicate group on real processes: fleet.init builds it from hybrid_configs, its
queries follow Paddle's numbering, every torch group it returns connects exactly the ranks it
names, the model-parallel random streams differ across model-parallel ranks while the global one
agrees, and impossible degrees fail in fleet.init at once."""
import time

import pytest
import torch

from spawn import run_and_load


def _queries(rank, world, out, configs):
    import torch.distributed as dist

    from fleetx import fleet
    s = fleet.DistributedStrategy()
    s.hybrid_configs = configs
    fleet.init(is_collective=True, strategy=s)
    hcg = fleet.get_hybrid_communicate_group()
    from fleetx.parallel import get_hcg
    assert get_hcg() is hcg
    found = {
        "global": hcg.get_global_rank(),
        "dp": (hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size()),
        "mp": (hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()),
        "pp": (hcg.get_stage_id(), hcg.get_pipe_parallel_world_size()),
        "sharding_rank": (hcg.get_sharding_parallel_rank(),
                          hcg.get_sharding_parallel_world_size()),
        "stages": (bool(hcg.is_first_stage), hcg.is_last_stage()),
        "p2p": (hcg.get_p2p_prev_rank(), hcg.get_p2p_next_rank()),
        "mode": int(hcg.get_parallel_mode()),
    }
    groups = {"data": hcg.get_data_parallel_group(), "model": hcg.get_model_parallel_group(),
              "pipe": hcg.get_pipe_parallel_group(), "sharding": hcg.get_sharding_parallel_group(),
              "check": hcg.get_check_parallel_group()}
    for axis, group in groups.items():
        # each group sums exactly the ranks it says it holds
        x = torch.tensor([float(2 ** rank)])
        dist.all_reduce(x, group=group)
        found[axis] = (hcg.group_ranks(axis), int(x.item()))
    torch.save(found, f"{out}/rank{rank}.pt")


def _rng(rank, world, out, seed):
    from fleetx import fleet
    from fleetx.fleet import meta_parallel
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2}
    s.tensor_parallel_configs = {"tensor_init_seed": seed}
    fleet.init(is_collective=True, strategy=s)
    tracker = meta_parallel.get_rng_state_tracker()
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    outside = drop(x).ne(0).tolist()
    with tracker.rng_state("model_parallel_rng"):
        inside = drop(x).ne(0).tolist()
    after = drop(x).ne(0).tolist()
    torch.save({"outside": outside, "inside": inside, "after": after,
                "mp": fleet.get_hybrid_communicate_group().get_model_parallel_rank()},
               f"{out}/rank{rank}.pt")


def _bad_degrees(rank, world, out):
    from fleetx import fleet
    from fleetx.strategy.api import StrategyError
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 3}
    start = time.monotonic()
    try:
        fleet.init(is_collective=True, strategy=s)
        message = None
    except StrategyError as err:
        message = str(err)
    torch.save({"message": message, "seconds": time.monotonic() - start},
               f"{out}/rank{rank}.pt")


def _expected(rank, dp, pp, mp):
    d, rest = divmod(rank, pp * mp)
    p, m = divmod(rest, mp)
    at = lambda d_, p_, m_: (d_ * pp + p_) * mp + m_  # noqa: E731  Paddle's row-major order
    return {"dp": (d, dp), "mp": (m, mp), "pp": (p, pp),
            "data": [at(i, p, m) for i in range(dp)], "model": [at(d, p, i) for i in range(mp)],
            "pipe": [at(d, i, m) for i in range(pp)],
            "check": [at(d, i, j) for i in range(pp) for j in range(mp)]}


@pytest.mark.slow
@pytest.mark.parametrize("configs, shape, mode", [
    ({"dp_degree": 2, "mp_degree": 2}, (2, 1, 2), 1),
    ({"pp_degree": 2, "mp_degree": 2}, (1, 2, 2), 2),
])
def test_four_processes_groups_and_queries_follow_paddle(tmp_path, configs, shape, mode):
    results = run_and_load(_QUERIES[tuple(sorted(configs))], 4, tmp_path, deadline=240)
    dp, pp, mp = shape
    for rank, got in enumerate(results):
        want = _expected(rank, dp, pp, mp)
        assert got["global"] == rank and got["mode"] == mode
        assert got["dp"] == want["dp"] and got["mp"] == want["mp"] and got["pp"] == want["pp"]
        assert got["sharding_rank"] == (0, 1) and got["sharding"] == ([rank], 2 ** rank)
        assert got["stages"] == (want["pp"][0] == 0, want["pp"][0] == pp - 1)
        pipe = want["pipe"]
        stage = want["pp"][0]
        assert got["p2p"] == (pipe[(stage - 1) % pp], pipe[(stage + 1) % pp])
        for axis in ("data", "model", "pipe", "check"):
            assert got[axis] == (want[axis], sum(2 ** r for r in want[axis])), axis


def _queries_dp_mp(rank, world, out):
    _queries(rank, world, out, {"dp_degree": 2, "mp_degree": 2})


def _queries_pp_mp(rank, world, out):
    _queries(rank, world, out, {"pp_degree": 2, "mp_degree": 2})


def _rng_seeded(rank, world, out):
    _rng(rank, world, out, 7)


def _rng_drawn(rank, world, out):
    _rng(rank, world, out, -1)


_QUERIES = {("dp_degree", "mp_degree"): _queries_dp_mp, ("mp_degree", "pp_degree"): _queries_pp_mp}


@pytest.mark.parametrize("fn", [_rng_seeded, _rng_drawn])
def test_dropout_differs_across_model_parallel_ranks_only_inside_the_stream(tmp_path, fn):
    a, b = run_and_load(fn, 2, tmp_path, deadline=120)
    assert (a["mp"], b["mp"]) == (0, 1)
    assert a["outside"] == b["outside"] and a["after"] == b["after"]
    assert a["inside"] != b["inside"]
    if fn is _rng_seeded:
        # the global stream is seeded with tensor_init_seed itself, on every rank
        torch.manual_seed(7)
        assert a["outside"] == torch.nn.Dropout(0.5)(torch.ones(64)).ne(0).tolist()


def test_impossible_degrees_fail_in_fleet_init_within_seconds(tmp_path):
    for got in run_and_load(_bad_degrees, 2, tmp_path, deadline=120):
        assert got["message"] is not None and "mp_degree=3" in got["message"]
        assert "world size 2" in got["message"]
        assert got["seconds"] < 20
