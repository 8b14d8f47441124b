"""How devices report their own evaluation of the global and the personal adapter, and
how a mean and a 10th percentile across devices are read back from a round's metrics.

A device's numbers travel as upload metrics, which every tier sums (``metric_sums``,
``metric_weights``) and the round record reports as means. So that the means are across
devices, not across examples, each of these metrics carries weight 1 per device
(:func:`per_device`; ``orchard.client.update.upload_header`` weights them so). Beside the
mean accuracy of each model, a device reports which of :data:`BINS` equal accuracy bins
it falls in (1 for its bin, 0 for the others): the round's mean of a bin is the fraction
of devices in it, and the 10th percentile is read from that histogram by linear
interpolation within its bin (:func:`summary`), to within one bin's width
(1 / :data:`BINS`). The simulator knows every device's value and reports exact figures
(:func:`exact`).

No tier learns more than this histogram and the means; under differential privacy no
metric leaves the device at all (``upload_header``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

PREFIX = "device."
BINS = 20
MODELS = ("global", "personal")


def per_device(name: str) -> bool:
    """Whether metric ``name`` is one device's value, weighted 1 per device."""
    return name.startswith(PREFIX)


def _mean_key(model: str) -> str:
    return f"{PREFIX}{model}_accuracy"


def _bin_key(model: str, b: int) -> str:
    return f"{PREFIX}{model}_accuracy.bin{b:02d}"


def encode(global_accuracy: float, personal_accuracy: float) -> dict[str, float]:
    """One device's metrics: each model's accuracy and its one-hot bin."""
    out: dict[str, float] = {}
    for model, acc in zip(MODELS, (global_accuracy, personal_accuracy), strict=True):
        if not math.isfinite(acc):
            continue
        a = min(max(acc, 0.0), 1.0)
        out[_mean_key(model)] = a
        hit = min(int(a * BINS), BINS - 1)
        out.update({_bin_key(model, b): float(b == hit) for b in range(BINS)})
    return out


def _p10_from_histogram(fractions: Sequence[float]) -> float:
    total = sum(fractions)
    if total <= 0:
        return float("nan")
    want, seen = 0.1 * total, 0.0
    for b, f in enumerate(fractions):
        if f > 0 and seen + f >= want:
            return (b + (want - seen) / f) / BINS
        seen += f
    return 1.0


def summary(metrics: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{"global": {"mean": .., "p10": ..}, "personal": {...}}`` from a round's metric
    means; empty when the round carries no device evaluation."""
    out: dict[str, dict[str, float]] = {}
    for model in MODELS:
        mean = metrics.get(_mean_key(model))
        if mean is None:
            continue
        hist = [float(metrics.get(_bin_key(model, b), 0.0)) for b in range(BINS)]
        out[model] = {"mean": float(mean), "p10": _p10_from_histogram(hist)}
    return out


def percentile10(values: Sequence[float]) -> float:
    """The 10th percentile of ``values`` (linear interpolation, numpy's default)."""
    xs = sorted(v for v in values if math.isfinite(v))
    if not xs:
        return float("nan")
    pos = 0.1 * (len(xs) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def exact(values: Sequence[float]) -> dict[str, float]:
    """Mean and 10th percentile of per-device values."""
    xs = [v for v in values if math.isfinite(v)]
    return {"mean": sum(xs) / len(xs) if xs else float("nan"), "p10": percentile10(xs), "devices": len(xs)}
