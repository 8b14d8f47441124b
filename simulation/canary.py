"""Canary clients for empirical privacy estimation (Andrew, Kairouz, Oh, Oprea, McMahan
and Suriyakumar, 2023, "One-shot Empirical Privacy Estimation for Federated Learning").

A canary is a simulated device whose update is replaced by ``norm`` times a random unit
direction of the model's whole parameter vector, drawn from the simulation's seed and the
device alone, so an auditor can draw the same direction again after the run
(:func:`direction`) and compare it with the final model. Which devices are canaries is
``[simulation.attack] kind = "canary"``'s ``fraction``, drawn per device from the seed as
attackers are. Directions an auditor draws for devices that are not in the population
(:func:`unseen_direction`) follow the same law and never took part.

Pure: a seed, a device and shapes in, arrays out.
"""

from __future__ import annotations

import math

import numpy as np

from orchard.typing import NDArrays

_SALT, _UNSEEN = 0xCA1A, 0x0BE5


def _unit(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> NDArrays:
    # Sorted by name: the direction does not depend on the order the caller lists tensors in.
    out = {k: rng.standard_normal(math.prod(shapes[k])).reshape(shapes[k]) for k in sorted(shapes)}
    norm = math.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in out.values()))
    return {k: (v / norm) for k, v in out.items()}


def direction(shapes: dict[str, tuple[int, ...]], seed: int, device: int) -> NDArrays:
    """Canary ``device``'s unit direction (float64) in a simulation seeded ``seed``."""
    return _unit(shapes, np.random.default_rng([seed, device, _SALT]))


def unseen_direction(shapes: dict[str, tuple[int, ...]], seed: int, k: int) -> NDArrays:
    """The ``k``-th direction of the same law that no device sent."""
    return _unit(shapes, np.random.default_rng([seed, k, _UNSEEN]))


def update(shapes: dict[str, tuple[int, ...]], seed: int, device: int, norm: float) -> NDArrays:
    """What canary ``device`` sends: ``norm`` times its direction, float32."""
    return {k: np.multiply(norm, v).astype(np.float32) for k, v in direction(shapes, seed, device).items()}
