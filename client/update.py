"""From a trainer's result to an upload: delta, weighting, codec, header.

The one upload builder: the client runtime and the simulator both call
:func:`build_upload`, so both send exactly the same bytes for the same inputs, under
every weighting; nothing here touches the network. A simulator's batch of clients of
one round may go through :func:`build_uploads` instead, which builds the same headers
and bytes for many clients at once where it can (a cast codec, no per-client
normalisation) and says when it cannot. The delta is encoded as it is: its
weight travels in the header and is applied by the tier, whether it decodes the update
or sums payloads in the compressed domain (secure aggregation pre-scales the values it
masks itself: ``orchard.client.secure``).

FedNova (Wang et al., 2020; :mod:`orchard.edge_runtime.fednova`) with
``cohort.weighting = "fednova"``: the client sends ``d_i = Delta_i / a_i`` with its data
weight ``p_i`` and reports ``a_i`` as the metric ``fednova_tau`` under the same weight.
Tiers fold both into ordinary weighted sums (linear, so tiers, codecs and secure
aggregation are unaffected); the root's mean update is ``sum p_i d_i`` and its metric
mean ``tau_eff = sum p_i a_i``, and the root multiplies the two (eq. 6,
``orchard.aggregation.server_step``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from orchard import wire
from orchard.aggregation import FEDNOVA_TAU
from orchard.aggregation.privacy import clip_l2
from orchard.compression import Codec, encode_packed, encode_packed_many
from orchard.config import RunConfig
from orchard.edge_runtime.fednova import norm_a, normalise
from orchard.errors import UpdateSchemaError
from orchard.messages import TaskAssignment, UploadHeader, UploadKind
from orchard.personal_metrics import per_device
from orchard.seeds import derive_seed
from orchard.trainer import TrainConfig, TrainResult
from orchard.typing import NDArrays, Weighting


def train_seed(run_seed: int, rnd: int, partition_id: int) -> int:
    """Deterministic per (run seed, round, partition): same seed, same update. In
    ``[0, 2**31 - 1)``."""
    return derive_seed(run_seed, rnd, partition_id, bits=31) % (2**31 - 1)


class _LazyGenerator:
    """Stands in for ``np.random.default_rng(entropy)``, built on first attribute access:
    most codecs draw nothing, and building a Generator costs more than encoding a small
    update. A codec that draws gets the very stream the Generator would give."""

    __slots__ = ("_entropy", "_rng")

    def __init__(self, entropy: list[int]) -> None:
        self._entropy = entropy
        self._rng: np.random.Generator | None = None

    def __getattr__(self, name: str) -> Any:  # only for names the slots do not hold
        if self._rng is None:
            self._rng = np.random.default_rng(self._entropy)
        return getattr(self._rng, name)


def upload_rng(seed: int) -> np.random.Generator:
    """The encoder's randomness for an upload trained with ``seed`` (created lazily)."""
    return cast(np.random.Generator, _LazyGenerator([seed, 0xC0DEC]))


def weight_of(result: TrainResult, weighting: Weighting) -> float:
    if weighting is Weighting.STEPS:
        return float(result.num_steps)
    if weighting is Weighting.UNIFORM:
        return 1.0
    return float(result.weight)


def fednova_tau(result: TrainResult, config: TrainConfig) -> float:
    """``a_i = ||a_i||_1`` for the local steps of ``result``.

    Exact for SGD with heavy-ball momentum (the paper's cases). Adam and FedProx's
    proximal term change ``a_i`` in ways the paper does not reduce to the step count;
    for them the plain-SGD value (the steps) is used, as FedNova implementations do.
    """
    momentum = config.momentum if config.optimizer.lower() == "sgd" else 0.0
    return norm_a(result.num_steps, momentum)


def fednova_update(delta: NDArrays, result: TrainResult, config: TrainConfig) -> tuple[NDArrays, TrainResult, float]:
    """Client side: ``(d_i, result weighted by data, a_i)``.

    The weight is the data weight ``p_i`` (a run a governor stopped early is *not*
    down-weighted: dividing by ``a_i`` already accounts for the fewer steps).
    """
    momentum = config.momentum if config.optimizer.lower() == "sgd" else 0.0
    tau = fednova_tau(result, config)
    weight = result.weight if result.planned_weight is None else result.planned_weight
    return normalise(delta, result.num_steps, momentum), dataclasses.replace(result, weight=weight), tau


def with_fednova_tau(header: UploadHeader, tau: float) -> UploadHeader:
    """Report ``a_i`` as a metric weighted like the update itself (not by examples), so
    the cohort's metric mean is ``sum p_i a_i / sum p_i = tau_eff``."""
    return dataclasses.replace(
        header,
        metric_sums={**header.metric_sums, FEDNOVA_TAU: tau * header.weight},
        metric_weights={**header.metric_weights, FEDNOVA_TAU: header.weight},
    )


def delta_of(t: TaskAssignment, global_arrays: NDArrays, result: TrainResult) -> NDArrays:
    """``local - global`` over exactly the tensors the task's schema names."""
    names = [s.name for s in t.schema]
    missing = [n for n in names if n not in result.arrays]
    if missing:
        raise UpdateSchemaError(f"the trainer returned no value for {missing[:5]}; it must return every "
                                "tensor of the global model")
    out: NDArrays = {}
    for n in names:
        new = np.asarray(result.arrays[n], dtype=np.float32)
        if new.shape != global_arrays[n].shape:
            raise UpdateSchemaError(f"trainer returned {n!r} with shape {new.shape}, "
                                    f"the model has {global_arrays[n].shape}")
        out[n] = np.subtract(new, global_arrays[n], dtype=np.float32)
    return out


def deltas_of(t: TaskAssignment, global_arrays: NDArrays, results: Sequence[TrainResult]) -> NDArrays | None:
    """:func:`delta_of` for many results of one task's schema at once, stacked: row ``i``
    of each tensor is ``results[i]``'s delta, the same float32 values. None when a
    result lacks a tensor or has another shape: then take :func:`delta_of` of each,
    which says which and what is wrong."""
    out: NDArrays = {}
    for n in (s.name for s in t.schema):
        shape = global_arrays[n].shape
        stacked = np.empty((len(results), *shape), dtype=np.float32)
        for row, r in enumerate(results):
            v = r.arrays.get(n)
            if v is None or v.shape != shape:
                return None
            stacked[row] = v  # as np.asarray(v, dtype=np.float32)
        out[n] = np.subtract(stacked, global_arrays[n], out=stacked, dtype=np.float32)
    return out


def upload_header(t: TaskAssignment, cfg: RunConfig, node_id: str, payload: bytes, sizes: tuple[int, ...],
                  result: TrainResult, weight: float) -> UploadHeader:
    """A client update's header: its payload's sizes and hash, its weight, and the
    result's counts and metrics (weighted by its examples). Under DP the header carries
    no count and no metric: it travels in the clear to tiers (untrusted under
    distributed DP) and nothing noises it."""
    metric_w = float(max(result.num_examples, 1))
    metrics = {k: float(v) for k, v in result.metrics.items() if math.isfinite(v)}
    if cfg.privacy.enabled:
        metrics = {}
        result = dataclasses.replace(result, num_examples=0, num_steps=0)
    return UploadHeader(
        node_id=node_id, run_id=t.run_id, round=t.round, attempt=t.attempt, task_id=t.task_id,
        kind=UploadKind.CLIENT_UPDATE, schema=t.schema, payload_sizes=sizes, codec=cfg.codec.name,
        payload_sha256=wire.sha256_hex(payload), weight=weight, count=1, num_examples=result.num_examples,
        num_steps=result.num_steps, metric_sums={k: v * _metric_weight(k, metric_w) for k, v in metrics.items()},
        metric_weights={k: _metric_weight(k, metric_w) for k in metrics})


def _metric_weight(name: str, examples: float) -> float:
    """A metric's weight: its examples, or 1 for one device's own value (a device's
    evaluation of its personal adapter, ``orchard.personal_metrics``), so that the round's
    mean is across devices."""
    return 1.0 if per_device(name) else examples


def build_uploads(ts: Sequence[TaskAssignment], cfg: RunConfig, codec: Codec, node_ids: Sequence[str],
                  deltas: NDArrays, results: Sequence[TrainResult],
                  seeds: Sequence[int] | None = None) -> list[tuple[UploadHeader, bytes]] | None:
    """:func:`build_upload` for many clients of one round at once (a simulator's batch):
    ``deltas[name][i]`` is client ``i``'s delta (see :func:`deltas_of`), ``ts[i]`` its
    task. Only where nothing per client touches a delta before it is encoded and
    nothing is kept between rounds: no FedNova (it normalises each delta by its own
    steps), no clipping on the client, and a cast codec, which encodes every client's
    rows at once (:func:`~orchard.compression.encode_packed_many`), or, given each
    client's training ``seeds`` (its encoder randomness, :func:`upload_rng`), a
    quantiser such as ``qsgd``, whose rounding it computes for every client at once.
    None otherwise: then
    build each upload with :func:`build_upload`. The same headers and bytes as
    :func:`build_upload` gives client by client (a property test holds them together);
    a cast keeps no state, so there are no new states."""
    weighting = cfg.cohort.weighting
    if weighting is Weighting.FEDNOVA or cfg.clips_on_client or not ts:
        return None
    first = ts[0]
    if any(t.schema != first.schema or t.shared_seed != first.shared_seed for t in ts):
        return None
    names = [s.name for s in first.schema]
    # Payloads that carry their sha256: hashed once here, not again by a tier in this process.
    rngs = None if seeds is None else [upload_rng(s) for s in seeds]
    packed = encode_packed_many(codec, {n: deltas[n] for n in names}, names, first.shared_seed, wire.HashedBytes,
                                rngs)
    if packed is None:
        return None
    payloads, sizes = packed
    return [(upload_header(t, cfg, node_id, payload, sizes, res, weight_of(res, weighting)), payload)
            for t, node_id, payload, res in zip(ts, node_ids, payloads, results, strict=True)]


def build_upload(t: TaskAssignment, cfg: RunConfig, train_cfg: TrainConfig, codec: Codec, node_id: str,
                 delta: NDArrays, result: TrainResult, seed: int,
                 states: dict[str, Any] | None) -> tuple[UploadHeader, bytes, dict[str, Any]]:
    """Apply the run's weighting to ``delta`` (FedNova normalises it), encode it with the
    run's codec (unscaled: the header carries the weight); returns header, payload and
    the new codec state. ``train_cfg`` is the config the update was trained with."""
    weighting = cfg.cohort.weighting
    tau: float | None = None
    if weighting is Weighting.FEDNOVA:
        delta, result, tau = fednova_update(delta, result, train_cfg)
    if cfg.clips_on_client:
        # Under secure aggregation no tier sees the update: the client bounds its own norm
        # (DP's clip norm, robust.norm_bound), as ``aggregation.layer.Clip`` does at a tier.
        delta, _ = clip_l2(delta, cast(float, cfg.clip_norm))
    w = weight_of(result, weighting)
    payload, sizes, new_states = encode_packed(codec, delta, [s.name for s in t.schema], upload_rng(seed), states,
                                               t.shared_seed)
    header = upload_header(t, cfg, node_id, payload, sizes, result, w)
    if tau is not None:
        header = with_fednova_tau(header, tau)
    return header, payload, new_states
