"""Nodes dropped below an aggregator reach the root's record: a tier's partial carries its
own drops and those its partials reported, and the parent adds them to its outcome."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchard import wire
from orchard.client.update import build_upload
from orchard.compression import build_codec
from orchard.config import CohortConfig, RunConfig, ServerConfig
from orchard.errors import UpdateSchemaError
from orchard.server.coordinator import Coordinator
from orchard.server.decoding import ClientUpdateDecoder
from orchard.server.round import RoundRecord, RoundStatus, RoundTask
from orchard.server.tier.relay import ParentUpstream
from orchard.server.upstream import ChildRound
from orchard.trainer import TrainResult
from orchard.typing import DeviceState, Role, TensorSpec
from tests.server.clock import Clock

SCHEMA = (TensorSpec("w", (4,), "float32"),)


def _coord(name: str, clock: Clock) -> Coordinator:
    return Coordinator(name, ServerConfig(node_timeout_s=5.0), np.random.default_rng(0), ClientUpdateDecoder(),
                       monotonic=clock, inline=True)


def _update(coord: Coordinator, cfg: RunConfig, node: str) -> tuple:
    t = coord.assign(node)
    assert t is not None
    res = TrainResult(arrays={}, weight=1.0, num_examples=1, num_steps=1)
    h, p, _ = build_upload(t, cfg, cfg.train, build_codec(cfg.codec), node, {"w": np.ones(4, np.float32)}, res,
                           seed=0, states=None)
    return h, p


def test_a_client_dropped_below_an_aggregator_is_counted_in_the_roots_record() -> None:
    clock = Clock(100.0)
    root, agg = _coord("root", clock), _coord("agg", clock)
    cfg = RunConfig(cohort=CohortConfig(target=3, over_selection=1.0))
    root.join("agg", Role.AGGREGATOR, "tok", DeviceState())
    root.touch("agg", pool_size=3, pool_eligible=3)
    for n in ("a", "b", "c"):
        agg.join(n, Role.CLIENT, "tok", DeviceState())
    task = RoundTask(run_id="run", round=1, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                     model_blob=b"", model_hash="h", schema=SCHEMA, deadline_unix=time.time() + 600, target=3,
                     shared_seed=1)
    rcr = root.open_round(task)
    a = root.assign("agg")
    assert a is not None
    child = ChildRound(agg, "agg", a, b"", lambda t: ParentUpstream(root, "agg", t))
    assert set(child.cr.assignments) == {"a", "b", "c"}
    for n in ("a", "b"):
        agg.upload_now(n, *_update(agg, cfg, n))
    # "c" took its task and went silent: the sweep drops it once its timeout passed.
    assert agg.assign("c") is not None
    clock.t += 6.0
    agg.touch("a")
    agg.touch("b")
    root.touch("agg")
    agg.sweep()
    assert child.cr.closed
    out = agg.outcome(child.cr)
    assert out.dropped == 1
    header, payload = child.partial(out)
    assert header.dropped == 1
    assert wire.header_from_proto(wire.header_to_proto(header)).dropped == 1  # it travels on the wire
    root.upload_now("agg", header, payload)
    assert rcr.closed
    rec = RoundRecord.from_outcome(root.outcome(rcr), RoundStatus.COMPLETED)
    assert (rec.participants, rec.dropped) == (2, 1)


def test_a_client_update_that_claims_drops_below_it_is_refused() -> None:
    clock = Clock(100.0)
    tier = _coord("tier", clock)
    cfg = RunConfig(cohort=CohortConfig(target=1, over_selection=1.0))
    tier.join("a", Role.CLIENT, "tok", DeviceState())
    tier.open_round(RoundTask(run_id="run", round=1, attempt=0, config=cfg, config_json=cfg.model_dump_json(),
                              model_blob=b"", model_hash="h", schema=SCHEMA, deadline_unix=time.time() + 600,
                              target=1, shared_seed=1))
    h, p = _update(tier, cfg, "a")
    with pytest.raises(UpdateSchemaError, match="drops no one"):
        tier.upload_now("a", h.__class__(**{**h.__dict__, "dropped": 3}), p)
