"""Pre-scaled updates (secure aggregation only: its field holds plain sums) and the
accumulator that takes a cohort's partial whole."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.aggregation import (
    Accumulator,
    MetricSums,
    Partial,
    capped_weight,
    finalize,
    prescale_factor,
)
from orchard.errors import UpdateSchemaError
from orchard.typing import TensorSpec

SCHEMA = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (2, 2), "float32")]


def test_secure_prescaled_sums_give_the_capped_weighted_mean() -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(5) for _ in range(4)]
    weights, scale = [2.0, 50.0, 1000.0, 2500.0], 1000.0
    total = scale * sum(prescale_factor(w, scale) * x for w, x in zip(weights, xs, strict=True))
    weight = sum(capped_weight(w, scale) for w in weights)
    want = sum(min(w, scale) * x for w, x in zip(weights, xs, strict=True)) / sum(min(w, scale) for w in weights)
    np.testing.assert_allclose(total / weight, want, rtol=1e-12)
    assert prescale_factor(2500.0, scale) == 1.0 and capped_weight(2500.0, scale) == 1000.0


def _partial(value: float, weight: float, count: int) -> Partial:
    sums = {s.name: np.full(s.shape, value, np.float64) for s in SCHEMA}
    return Partial(sums=sums, weight=weight, count=count, metrics=MetricSums({"loss": 2.0 * weight}, {"loss": weight}))


def test_an_empty_accumulator_allocates_nothing_and_takes_an_owned_partial_as_is() -> None:
    acc = Accumulator(SCHEMA)
    assert acc.count == 0 and acc.weight == 0.0 and acc._partial is None
    p = _partial(3.0, 6.0, 2)
    acc.merge(p, owned=True)
    assert acc.partial.sums["a"] is p.sums["a"]  # no float64 copy of the model
    acc.merge(_partial(1.0, 2.0, 1))  # later partials add as before
    mean, metrics = finalize(acc.partial)
    np.testing.assert_allclose(mean["b"], np.full((2, 2), 4.0 / 8.0, np.float32))
    assert acc.count == 3 and metrics == pytest.approx({"loss": 2.0})


def test_an_owned_partial_is_still_checked() -> None:
    bad = _partial(1.0, 1.0, 1)
    bad.sums["a"][0] = np.nan
    acc = Accumulator(SCHEMA)
    with pytest.raises(UpdateSchemaError, match="NaN or Inf"):
        acc.merge(bad, owned=True)
    assert acc.count == 0
    # Reading the partial of an empty accumulator gives zeros of the schema's shapes.
    assert {k: v.shape for k, v in acc.partial.sums.items()} == {"a": (3,), "b": (2, 2)}
