"""Write the Adult census rows as raw text files, the input of the dataset example.

    python examples/wide_and_deep/adult_files.py --out /tmp/fleetx_adult --files 8

A production CTR job reads logs, not a data frame: this writes the rows of ``data.py``'s
training split (in its order) into ``train/part-00000 ...`` and the held-out split into
``test/part-...``, one raw row per line, the 15 columns comma-separated as in the UCI
``adult.data`` file (``25,Private,226802,11th,...,<=50K``). Beside them, ``features.json``
holds what the data generator needs to turn a row into features exactly as ``data.py`` does:
each categorical column's values (for the deep ids) and the numeric columns' mean and
deviation on the training split. ``reader.py`` (the generator) reads it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (the example's own module)

COLUMNS = ("age", "workclass", "fnlwgt", "education", "educational-num", "marital-status",
           "occupation", "relationship", "race", "gender", "capital-gain", "capital-loss",
           "hours-per-week", "native-country", "income")


def features(frame, train_rows: np.ndarray) -> dict:
    """The vocabularies and numeric statistics ``data.load`` uses, as plain JSON values."""
    vocabulary = {c: np.unique(frame[c].astype(str).to_numpy()).tolist()
                  for c in data.CATEGORICAL}
    numeric = np.stack([np.log1p(frame[c].to_numpy(np.float64)) if c in data.LOG_SCALED
                        else frame[c].to_numpy(np.float64) for c in data.NUMERIC], axis=1)
    train = numeric[train_rows]
    return {"vocabulary": vocabulary, "mean": train.mean(axis=0).tolist(),
            "std": (train.std(axis=0) + 1e-6).tolist()}


def _write_parts(lines: list, folder: Path, files: int) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(lines)), files)):
        path = folder / f"part-{i:05d}"
        path.write_text("".join(lines[j] for j in part))
        paths.append(str(path))
    return paths


def write(out: str, files: int = 8, seed: int = 0, limit: int = 0) -> dict:
    """Write the files into ``out``; ``limit``: only the first rows of the training split (the
    held-out split is always whole). Returns where they are and how many rows each split has.
    """
    import pandas as pd
    frame = pd.read_parquet(data.adult_path())
    order = np.random.default_rng(seed).permutation(len(frame))  # data.load's split
    cut = int(len(frame) * data.HELD_OUT)
    test, train = order[:cut], order[cut:]
    text = frame[list(COLUMNS)].astype(str).agg(",".join, axis=1).to_numpy()
    rows = train[:limit] if limit else train
    root = Path(out)
    summary = {"train": _write_parts([text[i] + "\n" for i in rows], root / "train", files),
               "test": _write_parts([text[i] + "\n" for i in test], root / "test", files),
               "train_rows": len(rows), "test_rows": len(test)}
    written = {"files": files, "seed": seed, "limit": limit}
    (root / "features.json").write_text(json.dumps({**features(frame, train),
                                                    "written": written}))
    return summary


def ensure(out: str, files: int = 8, seed: int = 0, limit: int = 0) -> dict:
    """``features.json`` of ``out``, after writing the files unless they are there already.

    Safe when several processes of a job call it at once: each writes into a folder of its own
    and renames it to ``out``; the first rename wins, the others drop their copy.

    Raises:
        SystemExit: ``out`` holds files written with other settings.
    """
    root = Path(out)
    if not (root / "features.json").exists():
        mine = Path(f"{out}.tmp-{os.getpid()}")
        write(str(mine), files, seed, limit)
        try:
            os.rename(mine, root)
        except OSError:  # another process was first (or the folder exists): use theirs
            shutil.rmtree(mine, ignore_errors=True)
    if not (root / "features.json").exists():
        raise SystemExit(f"{out} exists but holds no features.json: delete it or choose "
                         f"another folder")
    features = json.loads((root / "features.json").read_text())
    wanted = {"files": files, "seed": seed, "limit": limit}
    if features.get("written") != wanted:
        raise SystemExit(f"{out} holds files written with {features.get('written')}, not "
                         f"{wanted}: delete it or choose another folder")
    return features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/fleetx_adult")
    ap.add_argument("--files", type=int, default=8, help="files per split")
    ap.add_argument("--seed", type=int, default=0, help="the split, as data.py's")
    ap.add_argument("--limit", type=int, default=0, help="training rows to write (0: all)")
    args = ap.parse_args()
    summary = write(args.out, args.files, args.seed, args.limit)
    print(f"wrote {summary['train_rows']} training rows and {summary['test_rows']} held-out "
          f"rows into {args.files} files each under {args.out}")


if __name__ == "__main__":
    main()
