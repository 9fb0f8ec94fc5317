"""The data generator of the dataset example: raw Adult rows on stdin, slot text on stdout.

    cat /tmp/fleetx_adult/train/part-00000 | python reader.py /tmp/fleetx_adult/features.json

It is the dataset's ``pipe_command``, run once per file. Each row becomes one sample of four
slots, the features of ``data.py``:

* ``dense``: the 6 numeric columns (fnlwgt and capital gain / loss log-scaled), standardised
  with the training split's mean and deviation from ``features.json`` (6 floats);
* ``wide``: the 12 hashed ids of the categorical values, the age bucket and the crosses;
* ``deep``: the 8 categorical columns numbered with the vocabularies of ``features.json``;
* ``label``: 1 if the income is above 50K.

It imports ``fleetx.data`` only (no torch), so each file's generator starts fast.
"""
from __future__ import annotations

import bisect
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402  (the example's feature definitions)
from adult_files import COLUMNS  # noqa: E402

from fleetx.data import MultiSlotDataGenerator  # noqa: E402


class AdultReader(MultiSlotDataGenerator):
    """Args:
        features: the content of ``features.json`` (vocabularies, numeric mean and std).
    """

    def __init__(self, features: dict) -> None:
        super().__init__()
        self.deep_ids, offset = {}, 0
        for column in data.CATEGORICAL:  # each column's values numbered from its offset
            values = features["vocabulary"][column]
            self.deep_ids[column] = {v: offset + i for i, v in enumerate(values)}
            offset += len(values)
        self.mean, self.std = features["mean"], features["std"]

    def wide(self, row: dict) -> list:
        keys = [f"{c}={row[c]}" for c in data.CATEGORICAL + ("age_bucket",)]
        keys += ["x".join(cross) + "=" + "|".join(row[c] for c in cross)
                 for cross in data.CROSSES]
        return [data.feature_id(k) for k in keys]

    def generate_sample(self, line):
        def local_iter():
            row = dict(zip(COLUMNS, line.rstrip("\n").split(",")))
            row["age_bucket"] = str(bisect.bisect_right(data.AGE_EDGES, int(row["age"])))
            numeric = [math.log1p(float(row[c])) if c in data.LOG_SCALED else float(row[c])
                       for c in data.NUMERIC]
            dense = [(v - m) / s for v, m, s in zip(numeric, self.mean, self.std)]
            yield [("dense", dense), ("wide", self.wide(row)),
                   ("deep", [self.deep_ids[c][row[c]] for c in data.CATEGORICAL]),
                   ("label", [int(row["income"].rstrip(".") == ">50K")])]
        return local_iter


if __name__ == "__main__":
    AdultReader(json.loads(Path(sys.argv[1]).read_text())).run_from_stdin()
