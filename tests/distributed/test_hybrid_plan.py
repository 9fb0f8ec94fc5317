"""A tensor-parallel plan composes with the pipeline, on 4 CPU processes (default stage).

The model of ``test_hybrid.py`` (a tied embedding, two residual MLP blocks) as a
``PipelineLayer`` of 2 stages whose blocks are plain ``nn.Linear``; ``fleet.meta_parallel.
parallelize`` splits each stage's blocks over the model-parallel group by the plan
``{"*.fc1": "colwise", "*.fc2": "rowwise"}`` (the layers are named by their index), under
mp 2 x pp 2. Trained 3 steps plainly and with clipping, it equals the unsplit model on one
process: losses, norms and the weights put together from the shards and stages (1e-5). One spawn.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_hybrid as hybrid  # noqa: E402
from spawn import run_and_load  # noqa: E402

RUNS = ("plain", "clip")


def _work(rank: int, world: int, out: str) -> None:
    results = {run: hybrid._train_layout(rank, "mp2_pp2_plan", hybrid.RUNS[run]) for run in RUNS}
    torch.save(results, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_and_load(_work, hybrid.WORLD, tmp_path_factory.mktemp("hybrid_plan"), deadline=300)


@pytest.mark.parametrize("run", RUNS)
def test_stages_split_by_a_plan_train_like_the_plain_model(ranks, run):
    hybrid.check_layout([r[run] for r in ranks], run)
