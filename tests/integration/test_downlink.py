"""Downlink deltas over real gRPC: round 2's model travels as a quantised delta from round 1's.

What is asserted, and why (see orchard.server.downlink for the scheme):

* Bytes: with 4 clients and the digits model, round 2 sends each client the 8-bit delta
  instead of the float32 model: bytes down fall to about a quarter of round 1's.
* Accuracy: the server's model stays exact, clients train from their reconstruction and
  send updates against it. The final model therefore differs from the plain run's only
  because clients started from ``R`` instead of ``G1`` in round 2, and ``|R - G1|`` is one
  stochastic-rounding step of the delta at most: ``2 * max|G1 - G0| / 255`` per tensor
  (8 bits, a block's scale is at most the tensor's max). Local training maps a start
  perturbation to about its own size but couples tensors (one layer's start error moves
  another's gradient), so the test allows twice the largest step of any tensor. Measured:
  every tensor's gap is below 0.6 of that step; the plain and delta runs are each
  deterministic, so this is not a statistical bound.
* Determinism: a tree (root -> aggregator -> clients) gives the flat delta run's model
  exactly: the aggregator pulls exact models and encodes the same delta from the same base.
* Fallbacks: an unknown ``have_hash`` gets the full model; a delta altered in transit
  (with its transport hash recomputed) fails the reconstruction hash, each client pulls
  the full model, and the run then equals the plain run exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from fed_harness import Federation, start_run, tree, wait_status

from orchard import wire
from orchard.config import CohortConfig, RunConfig
from orchard.ops import ControlClient
from orchard.server.downlink import ModelReply
from orchard.tasks import get_task
from orchard.typing import Role
from orchard.v1 import orchard_pb2 as pb
from orchard.v1 import orchard_pb2_grpc as pbg

ALL_IN = CohortConfig(target=4, over_selection=1.0, min_fraction=1.0, deadline_s=60)
SEED = 7


def _cfg(downlink: bool) -> RunConfig:
    return RunConfig(task="digits", rounds=2, cohort=ALL_IN, seed=SEED, downlink_delta=downlink)


def _pull(fed: Federation, rnd: int = -1) -> dict[str, np.ndarray]:
    assert fed.root is not None
    ctl = ControlClient(fed.root.address, insecure=True)
    try:
        return wire.blob_to_arrays(ctl.pull_global(rnd=rnd))
    finally:
        ctl.close()


def _raw_pulls(address: str, model_hash: str, have_hashes: list[str]) -> list[tuple[pb.Chunk, bytes]]:
    """PullModel over a bare stub: the first chunk's header and the bytes, per have_hash."""
    import grpc

    with grpc.insecure_channel(address) as ch:
        stub = pbg.FleetStub(ch)
        node = stub.Join(pb.JoinRequest(node_id="probe", role=Role.CLIENT.value)).node_id
        out = []
        for have in have_hashes:
            chunks = list(stub.PullModel(pb.PullModelRequest(node_id=node, model_hash=model_hash, have_hash=have)))
            out.append((chunks[0], b"".join(c.data for c in chunks)))
        return out


def _tamper(reply: ModelReply) -> ModelReply:
    """Flip the delta's last byte (a quantisation code) and restate its transport hash."""
    if not reply.is_delta:
        return reply
    b = bytearray(reply.blob)
    b[-1] ^= 0xFF
    return dataclasses.replace(reply, blob=bytes(b), sha256=wire.sha256_hex(bytes(b)))


async def _run(tmp: Path, downlink: bool, depth: int = 1, tamper: bool = False,
               probe: bool = False) -> dict[str, Any]:
    fed = await tree(tmp, depth=depth, clients_per_leaf=4)
    assert fed.root is not None
    coord = fed.root.coordinator
    if tamper:
        inner = coord.model_reply

        async def tampered(model_hash: str, have_hash: str = "") -> ModelReply:
            return _tamper(await inner(model_hash, have_hash))

        coord.model_reply = tampered  # type: ignore[method-assign]
    try:
        await start_run(fed.root, _cfg(downlink))
        st = await wait_status(fed.root, lambda s: s.get("status") in ("completed", "failed"), 60)
        out: dict[str, Any] = {"status": st, "final": await asyncio.to_thread(_pull, fed),
                               "g1": await asyncio.to_thread(_pull, fed, 1),
                               "client_bytes": [c.link.bytes_down for c in fed.clients]}
        if probe:
            assert coord.current is not None
            h = coord.current.task.model_hash  # round 2's model, still served
            g0 = wire.sha256_hex(wire.arrays_to_blob(get_task("digits").initial_arrays(SEED)))
            out["probe"] = await asyncio.to_thread(_raw_pulls, fed.root.address, h, ["", "ab" * 32, g0])
            out["probe_hash"] = h
        return out
    finally:
        await fed.stop()


def _bytes_down(st: dict[str, Any]) -> list[int]:
    return [r["bytes_down"] for r in st["rounds"]]


def _max_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.abs(a[k] - b[k]).max()) for k in a}


def test_round_two_pulls_a_delta_and_the_model_stays_within_one_step(tmp_path: Path) -> None:
    plain = asyncio.run(_run(tmp_path / "plain", downlink=False))
    delta = asyncio.run(_run(tmp_path / "delta", downlink=True, probe=True))
    for run in (plain, delta):
        assert run["status"]["status"] == "completed" and run["status"]["completed_rounds"] == 2, run["status"]

    # Bytes as sent: the plain run sends the full model both rounds, the delta run a
    # quarter of it (8-bit codes plus one scale per block) in round 2.
    p1, p2 = _bytes_down(plain["status"])
    d1, d2 = _bytes_down(delta["status"])
    assert p1 == p2 == d1
    assert d2 < 0.3 * d1, (d1, d2)
    # The clients received what the tier says it sent.
    assert sum(delta["client_bytes"]) == d1 + d2

    g0 = get_task("digits").initial_arrays(SEED)
    g1 = plain["g1"]
    assert _max_gap(delta["g1"], g1) == dict.fromkeys(g1, 0.0)  # round 1 was a full pull in both
    gap = _max_gap(delta["final"], plain["final"])
    step = max(2 * float(np.abs(g1[k] - g0[k]).max()) / 255 for k in g1)
    assert max(gap.values()) <= 2 * step, (gap, step)
    assert any(v > 0 for v in gap.values())  # clients really trained from a reconstruction

    # An unknown base gets the full model; no base gets the full model; the previous
    # global gets a delta that rebuilds to the hash the server states.
    (none_head, none_blob), (unk_head, unk_blob), (d_head, d_blob) = delta["probe"]
    h = delta["probe_hash"]
    for head, blob in ((none_head, none_blob), (unk_head, unk_blob)):
        assert head.delta_from == "" and head.blob_sha256 == h and wire.sha256_hex(blob) == h
    assert d_head.delta_from and d_head.target_hash == h and d_head.total_bytes < 0.3 * len(none_blob)
    assert wire.sha256_hex(d_blob) == d_head.blob_sha256 and d_head.result_sha256 not in ("", h)


def test_tree_forwards_the_same_delta(tmp_path: Path) -> None:
    flat = asyncio.run(_run(tmp_path / "flat", downlink=True))
    deep = asyncio.run(_run(tmp_path / "tree", downlink=True, depth=2))
    assert deep["status"]["status"] == "completed", deep["status"]
    b1, b2 = _bytes_down(deep["status"])
    f1, f2 = _bytes_down(flat["status"])
    # The aggregator pulls the exact model from the root (one full model each round),
    # its clients get the delta from the aggregator.
    model_bytes = f1 // 4
    assert b1 == f1 + model_bytes and b2 == f2 + model_bytes, (b1, b2, f1, f2)
    assert _max_gap(deep["final"], flat["final"]) == dict.fromkeys(flat["final"], 0.0)


def test_tampered_delta_falls_back_to_the_full_model(tmp_path: Path) -> None:
    plain = asyncio.run(_run(tmp_path / "plain", downlink=False))
    bad = asyncio.run(_run(tmp_path / "bad", downlink=True, tamper=True))
    assert bad["status"]["status"] == "completed", bad["status"]
    p1, _ = _bytes_down(plain["status"])
    b1, b2 = _bytes_down(bad["status"])
    # Round 2 sent each client the refused delta and then the full model.
    assert b1 == p1 and b2 > p1
    # Every client trained from the exact model: the plain run's result, bit for bit.
    assert _max_gap(bad["final"], plain["final"]) == dict.fromkeys(plain["final"], 0.0)
