"""A client's side of secure aggregation (SecAgg+) for one task.

The key stages run while the model trains; at the masked-input stage the client builds
its upload exactly as without secure aggregation (``build_upload``: codec, header),
decodes its own payload back to the values the codec carries (a field-linear codec's
values add), and masks ``(min(w, weight_scale) / weight_scale) * values`` quantised to
the run's clip and bits. The header (weight, counts, metrics) travels in the clear with
it; the payload never leaves the device.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np

from orchard.aggregation import prescale_factor
from orchard.compression import Codec, decode_update
from orchard.config import RunConfig
from orchard.errors import SecAggAbort
from orchard.link import FleetLink
from orchard.messages import TaskAssignment, UploadHeader
from orchard.secure_agg import SecAggClient, Stage, decode, quantize
from orchard.secure_agg.stages import stage_of
from orchard.updates import split


def masked_vector(cfg: RunConfig, codec: Codec, t: TaskAssignment, header: UploadHeader, payload: bytes,
                  rng: np.random.Generator) -> np.ndarray:
    """The field vector a client masks: its weighted, scaled, quantised update values."""
    shapes = {s.name: tuple(s.shape) for s in t.schema}
    parts = dict(zip(shapes, split(payload, header.payload_sizes), strict=True))
    values = decode_update(codec, parts, shapes, num_summands=1, shared_seed=t.shared_seed)
    flat = np.concatenate([np.asarray(values[k], np.float64).ravel() for k in shapes])
    sa = cfg.secure_aggregation
    return quantize(flat * prescale_factor(header.weight, sa.weight_scale), sa.clip, sa.bits, rng)


async def secure_session(link: FleetLink, t: TaskAssignment, cfg: RunConfig, codec: Codec,
                         upload: asyncio.Future[tuple[UploadHeader, bytes]], seed: int) -> None:
    """Run this client's SecAgg+ stages for task ``t``.

    Started when the task arrives, so the key stages overlap training; ``upload`` is
    resolved with the encoded update (header, payload) once training is done, and only
    its masked form leaves the device."""
    client = SecAggClient(link.node_id, entropy=secrets.token_bytes(32))
    answered: set[int] = set()
    sent_input = False
    reply = await link.secagg(t)
    while True:
        if reply.aborted:
            raise SecAggAbort(f"the cohort's secure aggregation aborted: {reply.aborted}")
        if reply.done:
            break
        if not reply.broadcast or reply.stage in answered:
            reply = await link.secagg(t)
            continue
        stage = stage_of(reply.stage)
        vector = header = None
        if stage is Stage.MASKED_INPUT:
            header, payload = await upload
            vector = masked_vector(cfg, codec, t, header, payload, np.random.default_rng([seed, 0x5EC]))
            sent_input = True
        message = client.respond(decode(reply.broadcast), vector).to_bytes()
        answered.add(reply.stage)
        reply = await link.secagg(t, reply.stage, message, header)
    if not sent_input:
        raise SecAggAbort("the cohort's sum was formed without this client's update (dropped from the session)")
