"""The check of the trained embedding: do a probe word's nearest neighbours make sense?

``RELATED`` was written by hand, from what clothing reviews talk about (a dress is near a skirt
and a gown, a colour near other colours, a size near other sizes), before and independently of
any trained model; it is never derived from one. For each probe word, the 10 words whose
vectors have the highest cosine similarity with its vector (itself excluded) are its
neighbours; a *hit* is a neighbour on the probe's list. The embedding is good when it scores
at least ``FACTOR`` times the hits of a random embedding of the same vocabulary (normal
entries, seed ``RANDOM_SEED``), and at least ``FACTOR`` hits in all, so that a random score of
zero does not make any score pass.
"""
from __future__ import annotations

import numpy as np

TOP = 10
FACTOR = 3.0
RANDOM_SEED = 12345

RELATED = {
    "dress": ["dresses", "skirt", "gown", "sundress", "maxi", "frock", "shift", "romper",
              "jumpsuit", "tunic", "slip", "sheath", "midi", "shirtdress", "caftan", "top"],
    "jeans": ["denim", "pants", "trousers", "jean", "leggings", "skinny", "skinnies", "slacks",
              "chinos", "shorts", "cords", "khakis", "joggers", "capris", "jeggings", "flares",
              "bootcut", "pilcro", "ag", "paige"],
    "sweater": ["cardigan", "pullover", "sweatshirt", "jumper", "knit", "hoodie", "cardi",
                "turtleneck", "fleece", "poncho", "shrug", "vest", "sweaters", "jacket",
                "coat", "cowl"],
    "shirt": ["blouse", "tee", "top", "tshirt", "shirts", "button", "tunic", "cami", "tank",
              "camisole", "henley", "polo", "blouses", "sweater", "tops"],
    "small": ["xs", "petite", "medium", "large", "size", "sizes", "tiny", "xxs", "smaller",
              "larger", "big", "xl", "xsp", "sp", "mp", "lp", "regular", "m", "s", "l"],
    "blue": ["navy", "green", "red", "black", "white", "grey", "gray", "purple", "pink", "teal",
             "turquoise", "yellow", "orange", "brown", "cobalt", "coral", "colors", "color",
             "ivory", "cream", "olive", "burgundy", "mint", "beige", "royal", "periwinkle"],
    "soft": ["cozy", "comfy", "silky", "smooth", "plush", "fuzzy", "luxurious", "warm",
             "supple", "buttery", "lightweight", "thick", "stretchy", "snuggly", "cushy", "thin",
             "drapey", "scratchy", "itchy"],
    "comfortable": ["comfy", "cozy", "soft", "wearable", "flattering", "easy", "relaxed",
                    "breathable", "cute", "stretchy", "versatile", "practical", "warm",
                    "lightweight", "forgiving"],
    "beautiful": ["gorgeous", "lovely", "stunning", "pretty", "elegant", "beautifully", "cute",
                  "adorable", "exquisite", "amazing", "classy", "feminine", "unique",
                  "striking", "vibrant", "rich"],
    "fabric": ["material", "cotton", "linen", "silk", "polyester", "rayon", "knit", "wool",
               "texture", "weave", "fabrics", "materials", "chiffon", "lace", "jersey",
               "viscose", "quality", "cloth"],
    "boots": ["shoes", "booties", "sandals", "heels", "flats", "sneakers", "pumps", "wedges",
              "boot", "clogs", "loafers", "tights", "leggings", "socks"],
    "waist": ["waistline", "hips", "bust", "waistband", "torso", "tummy", "midsection", "belly",
              "hip", "chest", "stomach", "shoulders", "middle", "ribcage", "bodice", "rise"],
    "summer": ["spring", "fall", "winter", "autumn", "season", "beach", "vacation", "warm",
               "hot", "weather", "seasons", "months", "year", "cooler", "warmer"],
    "cotton": ["linen", "silk", "polyester", "rayon", "wool", "cashmere", "spandex", "fabric",
               "material", "viscose", "nylon", "acrylic", "modal", "knit", "jersey"],
    "long": ["short", "length", "longer", "shorter", "tall", "cropped", "hem", "mini", "ankle",
             "knee", "maxi", "lengths", "midi", "hits"],
}


def top_neighbours(vectors: np.ndarray, word: int, top: int = TOP) -> np.ndarray:
    """The ``top`` word ids of highest cosine similarity with ``word`` (itself excluded)."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    scores = unit @ unit[word]
    scores[word] = -np.inf
    top = min(top, len(vectors) - 1)
    best = np.argpartition(-scores, top - 1)[:top]
    return best[np.argsort(-scores[best])]


def hits(vectors: np.ndarray, words: list, top: int = TOP) -> dict:
    """Per probe word in the vocabulary: ``(its top neighbours, how many are on its list)``."""
    index = {w: i for i, w in enumerate(words)}
    out = {}
    for probe, related in RELATED.items():
        if probe not in index:
            continue
        near = [words[i] for i in top_neighbours(vectors, index[probe], top)]
        out[probe] = (near, sum(w in related for w in near))
    return out


def random_vectors(vocabulary: int, dim: int) -> np.ndarray:
    """The baseline: a random embedding of the same vocabulary (``RANDOM_SEED``)."""
    return np.random.default_rng(RANDOM_SEED).standard_normal((vocabulary, dim))


def check(trained: np.ndarray, words: list) -> tuple[int, int, dict]:
    """``(trained hits, random hits, per-probe result)`` over the probes in the vocabulary."""
    mine = hits(trained, words)
    baseline = hits(random_vectors(len(words), trained.shape[1]), words)
    return (sum(h for _, h in mine.values()), sum(h for _, h in baseline.values()), mine)


def passes(trained_hits: int, random_hits: int) -> bool:
    """At least ``FACTOR`` times the random embedding's hits, and at least ``FACTOR`` hits."""
    return trained_hits >= FACTOR * max(random_hits, 1)
