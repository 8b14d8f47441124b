"""Update codecs: encode/decode pairs that declare their algebra, and their pipelines.

Pure: no I/O, no logging, no global RNG. Encoders take an explicit
``np.random.Generator``; cohort-wide randomness (random-k coordinates) comes from an
explicit ``shared_seed``. Everything is numpy-vectorised.

API
---
::

    codec = build_codec(spec)             # orchard.config.CodecSpec (or a dict like it);
                                          # unknown name/params -> ConfigError with the options
    available_codecs() -> tuple[str, ...]
    codec.name: str
    codec.algebra: Algebra                # linear, field_linear, stateful, unbiased,
                                          # needs_num_summands (see Algebra)
    payload, new_state = codec.encode(x, rng, state=None, shared_seed=0)   # bytes, State | None
    y = codec.decode(payload, shape, num_summands=1, shared_seed=0, state=None)  # float32

    encode_update(codec, arrays, rng, states=None, shared_seed=0) -> (payloads, new_states)
    encode_packed(codec, arrays, names, rng, ...)  # the same, joined: (payload, sizes, new_states)
    encode_packed_many(codec, rows, names, ...)    # many updates' joined payloads at once (a cast)
    decode_update(codec, payloads, shapes, num_summands=1, shared_seed=0) -> arrays
    states_to_bytes(states) / states_from_bytes(blob)    # persist codec state on a device
    validate_codec_for_secure_aggregation(spec)          # ConfigError naming what works

    codec.bound(enc, num_summands, shared_seed) -> float   # checks enc as decode would; bounds
                                          # |decoded|, NaN/inf for a non-finite payload
    codec.coordinates(enc, shared_seed)   # field-linear codecs: the vector payloads add by
    codec.from_coordinates(like, coords)  # ... and the payload of a sum of them
    PayloadSum(codec, shape, shared_seed)  # check(payload) / add(checked, w) /
                                          # accumulate(payload, w) / merge(other) /
                                          # result() / encoded(); a weighted sum,
                                          # O(one dense tensor)
    UpdateSum(codec, shapes, shared_seed)  # one PayloadSum per tensor: a cohort's sum
    sum_payloads(codec, payloads, shape, shared_seed) -> float32 sum
    sum_encoded(codec, payloads, shape) -> one payload of the sum (linear codecs)
    sums_compressed(run_config) -> bool   # does a tier sum this run's uploads in the
                                          # compressed domain (weighting each itself)?

    encode_model_delta(old, new, rng, from_version=v) -> ModelDelta (.smaller, .payloads, ...)
    apply_model_delta(old, payloads, from_version=v) -> model v+1

``State`` is ``dict[str, np.ndarray]`` per tensor. Every payload starts with a header
(magic, wire version, codec id, codec version, shape; see :mod:`.wire`), and its size
is ``len(payload)``. Malformed payloads raise :class:`orchard.errors.CodecError`
subclasses (:class:`MalformedPayloadError`, :class:`CodecMismatchError`) saying what
was expected and what came, never a numpy IndexError/ValueError.

Codecs (d elements; algebra as linear / field-linear / stateful / unbiased / needs n)
-------------------------------------------------------------------------------------
============== ====================================== ============================== ===========
name           params                                 algebra (L/F/S/U/N)            bytes
============== ====================================== ============================== ===========
float32        --                                     L F - U -                      4d
float16        --                                     - - - - -                      2d
bfloat16       --                                     - - - - -                      2d
qsgd           bits {1,2,4,8}=8, block=None, scale    - - - U N (L F with ``scale``) bits*d/8 + 4/block
sign           --                                     - - - - -                      d/8 + 4
topk           fraction=0.01 | k                      - - - - -                      ~k(4 + log2(d/k)/8)
randk          fraction=0.01 | k, unbiased=True       L F - U -                      4k
powersgd       rank=4                                 L - S - -                      4r(n+m)
pipeline       stages=[topk|randk..., value codec]    from its stages                indices + values
error_feedback codec=spec                             the inner's, S, biased         the inner's
============== ====================================== ============================== ===========

* ``linear``: payloads add without decoding (``Codec.add``) and the decode of the sum
  is the sum of the decodes. ``field_linear``: that sum is an element-wise sum of one
  data-independent vector, so it survives secure aggregation's field; only these pass
  :func:`validate_codec_for_secure_aggregation`.
* qsgd (Alistarh et al. 2017) with a per-tensor or per-block scale is unbiased but not
  linear (clients' scales differ); ``Codec.add`` (``sum_encoded``) still adds payloads
  whose scales coincide. A fixed ``scale`` makes it field-linear.
* sign (Karimireddy et al. 2019), topk and powersgd (Vogels et al. 2019) are biased:
  wrap them in ``error_feedback`` (Seide et al. 2014; Stich et al. 2018), whose
  residual telescopes: decoded sends plus the final residual equal the inputs' sum.
* randk's coordinates come from ``shared_seed``; every member of a cohort and the
  server must run the same numpy (``Generator.choice`` draws them).
* :class:`PayloadSum` adds field-linear codecs' payloads coordinate-wise without
  decoding them -- float values as ``w * values`` in float64 (an exact weighted sum up
  to float64 rounding, independent of arrival order), integer codes exactly in uint32
  and only with weight 1 (``Algebra.weighted_sums``) -- and decodes the sum once; it
  decodes every other payload (PowerSGD included: its factors add only by
  concatenation, which grows) into a dense float64 sum, times its weight.
* Tiers sum in the compressed domain (:func:`sums_compressed`) when the codec is linear
  and secure aggregation is off: clients encode their plain update, the tier folds each
  payload times its header's weight into an :class:`UpdateSum` and decodes once per
  cohort. Integer codes (qsgd with a fixed scale, alone or inside randk) take that path
  only under uniform weighting; otherwise, and for every other codec, tiers decode each
  update and accumulate it.
* Encode+decode throughput on a 10M-element tensor: ``benchmarks/compression.py``.
"""

from orchard.compression.aggregate import (
    CheckedPayload,
    PayloadSum,
    UpdateSum,
    sum_encoded,
    sum_payloads,
    sums_compressed,
)
from orchard.compression.base import Algebra, BaseCodec, Codec, State
from orchard.compression.downlink import (
    DOWNLINK_CODEC,
    ModelDelta,
    apply_model_delta,
    encode_model_delta,
)
from orchard.compression.errors import (
    CodecMismatchError,
    MalformedPayloadError,
    NonFiniteError,
    StateError,
    UpdateMismatchError,
)
from orchard.compression.registry import (
    CODEC_PARAMS,
    available_codecs,
    build_codec,
    validate_codec_for_secure_aggregation,
)
from orchard.compression.update import (
    decode_update,
    encode_packed,
    encode_packed_many,
    encode_update,
    states_from_bytes,
    states_to_bytes,
    tensor_seed,
)
from orchard.compression.wire import EncodedTensor, Field, parse_payload

__all__ = [
    "CODEC_PARAMS",
    "DOWNLINK_CODEC",
    "Algebra",
    "BaseCodec",
    "CheckedPayload",
    "Codec",
    "CodecMismatchError",
    "EncodedTensor",
    "Field",
    "MalformedPayloadError",
    "ModelDelta",
    "NonFiniteError",
    "PayloadSum",
    "State",
    "StateError",
    "UpdateMismatchError",
    "UpdateSum",
    "apply_model_delta",
    "available_codecs",
    "build_codec",
    "decode_update",
    "encode_model_delta",
    "encode_packed",
    "encode_packed_many",
    "encode_update",
    "parse_payload",
    "states_from_bytes",
    "states_to_bytes",
    "sum_encoded",
    "sum_payloads",
    "sums_compressed",
    "tensor_seed",
    "validate_codec_for_secure_aggregation",
]
