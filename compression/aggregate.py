"""Summing payloads: in the compressed domain where the algebra allows, else decoded.

:class:`PayloadSum` follows the accumulate / merge / finalize shape of the aggregation
package, and like the float64 accumulator it keeps a weighted sum: each payload is
added with its weight ``w`` (1 unless the caller says otherwise). A field-linear
codec's payloads add coordinate-wise (:meth:`Codec.coordinates`): float32 values,
randk's kept values, fixed-scale qsgd's integer codes (alone or inside randk). Float
coordinates are added as ``w * coords`` into a float64 sum (each product in float64,
as the accumulator forms it), so the sum is the exact weighted sum up to float64
rounding and does not depend on the order the payloads came in; integer codes are
added exactly, in uint32, and only unweighted (``w = 1``): they carry an offset per
summand that decoding removes by counting summands (:attr:`Algebra.weighted_sums`).
Either sum is decoded once, from the payload of the sum (:meth:`PayloadSum.encoded`).
Every other payload is decoded and added, times ``w``, to a dense float64 sum: that
includes PowerSGD, whose factors add only by concatenation (a sum that grows by
``(n + m) r`` floats per summand), so each is decoded on arrival and memory stays one
dense tensor.

A payload is checked whole before it joins a sum (:meth:`PayloadSum.check`: parsed as
decode would, and every value it stands for finite), and a sum refuses a payload that
could take it past float32's range once weighted (``w * bound``), or integer codes past
uint32, so a bad payload never changes a sum.

:class:`UpdateSum` is the same for a whole update (one :class:`PayloadSum` per tensor,
each with its tensor's shared seed): what a tier keeps for its direct clients when the
run aggregates in the compressed domain (:func:`sums_compressed`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from orchard.compression.base import Codec

# The sums live in their own modules (one tensor's, a whole update's); their names stay
# importable from here, where the package and its tests have always found them.
from orchard.compression.payload_sum import (
    FLOAT32_MAX,
    UINT32_MAX,
    CheckedPayload,
    PayloadSum,
    add_weighted,
    check_weight,
)
from orchard.compression.update_sum import CheckedUpdate, UpdateSum
from orchard.compression.wire import EncodedTensor
from orchard.config import RunConfig
from orchard.errors import CodecError

__all__ = [
    "FLOAT32_MAX",
    "UINT32_MAX",
    "CheckedPayload",
    "CheckedUpdate",
    "PayloadSum",
    "UpdateSum",
    "add_weighted",
    "check_weight",
    "sum_encoded",
    "sum_payloads",
    "sums_compressed",
]


def sums_compressed(cfg: RunConfig, codec: Codec | None = None) -> bool:
    """Whether a tier sums its direct clients' uploads in the compressed domain.

    Decided by the tier from the run's config alone; clients encode their plain update
    either way. A tier sums in the compressed domain when ``compressed_aggregation`` is
    "auto", secure aggregation is off (it has its own, pre-scaled sums) and the codec is
    linear. The tier then adds each payload times its header's weight ``w_i``
    (:class:`UpdateSum`), which is what the decode path's accumulator folds, for every
    weighting. That includes FedNova: its tiers fold ``sum_i p_i d_i`` with ``p_i`` the
    header's weight and the metric ``fednova_tau`` from the header, as on the decode
    path; only the root rescales.

    Codecs whose payloads add exactly only unweighted -- integer codes, qsgd with a fixed
    ``scale`` alone or inside randk (:attr:`Algebra.weighted_sums` is False) -- take this
    path only under ``weighting = "uniform"``, where every weight is 1; under any other
    weighting their uploads are decoded and then accumulated.

    A run that clips updates (DP's clip norm, ``robust.norm_bound``) sums compressed too,
    for codecs with real weights: the tier reads each update's norm from its payload
    (:meth:`Codec.coordinate_scale`, else what it decodes to) and adds it times
    ``w_i min(1, C / ||x_i||)``, still counted at ``w_i``.
    """
    if cfg.compressed_aggregation == "off" or cfg.secure_aggregation.enabled or cfg.needs_decoded_updates:
        return False  # also when each update must be seen, for a robust statistic
    if codec is None:
        from orchard.compression.registry import build_codec

        codec = build_codec(cfg.codec)
    if not codec.algebra.linear:
        return False
    if cfg.clip_norm is not None:
        # A tier clips each update by scaling its weight (its norm read from the payload),
        # which integer codes cannot take: they add only unweighted.
        return codec.algebra.weighted_sums
    return codec.algebra.weighted_sums or cfg.cohort.weighting == "uniform"


def sum_payloads(
    codec: Codec, payloads: Iterable[bytes], shape: tuple[int, ...], shared_seed: int = 0
) -> np.ndarray:
    """Decoded float32 sum of ``payloads`` (compressed-domain where the codec allows)."""
    acc = PayloadSum(codec, shape, shared_seed)
    for p in payloads:
        acc.accumulate(p)
    return acc.result()


def sum_encoded(codec: Codec, payloads: Iterable[bytes], shape: tuple[int, ...]) -> bytes:
    """One payload that decodes (with ``num_summands=len(payloads)``) to the sum.

    Only for payloads that add in the compressed domain; otherwise CodecError says which
    one did not.
    """
    total: EncodedTensor | None = None
    for i, p in enumerate(payloads):
        enc = codec.parse(p, shape)
        if total is None:
            total = enc
            continue
        summed = codec.add(total, enc)
        if summed is None:
            raise CodecError(
                f"{codec.name} payload {i} cannot be added to the others without decoding "
                f"(linear={codec.algebra.linear}: data-dependent scales or coordinates); "
                "use sum_payloads"
            )
        total = summed
    if total is None:
        raise CodecError("sum_encoded needs at least one payload")
    return total.to_bytes()
