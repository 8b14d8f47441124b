"""Which slot of a replay buffer a new sample takes, and which slots a step replays.

Pure functions of the buffer's labels, its counters and an explicit
``numpy.random.Generator``: no files, no clocks, no global RNG. The store
(:mod:`orchard.client.replay`) calls them and keeps the bytes.

Two policies, each an admission rule and a draw rule:

- ``reservoir``: Vitter's Algorithm R (Vitter, 1985, "Random sampling with a
  reservoir"). The n-th sample offered (1-based) to a full buffer of capacity C
  replaces slot ``j ~ U{0..n-1}`` when ``j < C``, so every sample seen so far is in the
  buffer with probability C / n. Draws are uniform over the filled slots.
- ``class_balanced``: class-balancing reservoir sampling (Chrysakis & Moens, 2020,
  "Online continual learning from imbalanced data", Algorithm 1). A sample of a class
  that is not among the largest in the buffer replaces a random slot of a largest
  class; a sample of a largest class c replaces a random slot of its own class with
  probability m_c / n_c (m_c: its slots, n_c: its samples seen), else is dropped. Draws
  pick a class uniformly among those present, then a slot of it uniformly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

SAMPLINGS = ("reservoir", "class_balanced")


def reservoir_slot(seen_before: int, capacity: int, rng: np.random.Generator) -> int | None:
    """The slot the next sample takes (None: it is dropped).

    ``seen_before``: samples offered before this one. Below capacity it is appended
    (slot ``seen_before``); above, Algorithm R draws ``j ~ U{0..seen_before}``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if seen_before < capacity:
        return seen_before
    j = int(rng.integers(0, seen_before + 1))
    return j if j < capacity else None


def class_balanced_slot(labels: np.ndarray, label: int, class_seen: Mapping[int, int], capacity: int,
                        rng: np.random.Generator) -> int | None:
    """The slot a sample of class ``label`` takes (None: dropped).

    ``labels``: the filled slots' classes, slot order. ``class_seen[label]`` counts the
    samples of that class offered so far, this one included.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    filled = int(labels.shape[0])
    if filled < capacity:
        return filled
    classes, counts = np.unique(labels, return_counts=True)
    largest = int(counts.max())
    mine = int(counts[classes == label][0]) if np.any(classes == label) else 0
    if mine < largest:
        victims = np.flatnonzero(np.isin(labels, classes[counts == largest]))
        return int(victims[int(rng.integers(0, victims.shape[0]))])
    n_c = int(class_seen.get(label, 0))
    if n_c < 1:
        raise ValueError(f"class_seen[{label}] must count this sample, got {n_c}")
    if rng.random() * n_c < mine:
        own = np.flatnonzero(labels == label)
        return int(own[int(rng.integers(0, own.shape[0]))])
    return None


def draw_slots(sampling: str, labels: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` slots to replay (with replacement) from filled slots with these ``labels``."""
    filled = int(labels.shape[0])
    if k <= 0 or filled == 0:
        return np.zeros(0, dtype=np.int64)
    if sampling == "reservoir":
        return rng.integers(0, filled, size=k).astype(np.int64)
    if sampling == "class_balanced":
        classes = np.unique(labels)
        picked = classes[rng.integers(0, classes.shape[0], size=k)]
        out = np.empty(k, dtype=np.int64)
        for i, c in enumerate(picked):
            own = np.flatnonzero(labels == c)
            out[i] = own[int(rng.integers(0, own.shape[0]))]
        return out
    raise ValueError(f"unknown replay sampling {sampling!r}; expected one of {', '.join(SAMPLINGS)}")
