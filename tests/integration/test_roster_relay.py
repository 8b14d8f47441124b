"""Signed rosters in a live federation over gRPC (TLS, enrolled devices): the root signs
the roster of the client devices it admits, aggregators pass each client its credential
as the root issued it, and clients check their neighbours' keys against the root's
roster. An aggregator that substitutes a neighbour's keys (relaying the root's session,
scope "tree", or in its own, scope "cohort") is caught by the clients below it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest
from fed_harness import FAST, Federation, add_clients, start_run, wait_status

from orchard.config import CohortConfig, RunConfig, SecureAggregationConfig
from orchard.secure_agg import KeysBroadcast, SessionSetup, crypto, decode
from orchard.secure_agg.active import advertise_message
from orchard.server.app import start_aggregator, start_root
from orchard.server.store import SQLiteStore
from orchard.server.tls import TlsPaths


def _issue(data_dir: Path, role: str, n: int) -> list[str]:
    st = SQLiteStore(data_dir / "orchard.db")
    try:
        return [st.issue_token(role) for _ in range(n)]
    finally:
        st.close()


class SubstitutingAggregator:
    """Wraps an aggregator's answers to the clients below it (what its servicer sends
    down, relayed from the root's session or from its own): in every keys broadcast, the
    keys of the recipient's first neighbour become X25519 keys the aggregator made, signed
    with its own identity key and vouched for by another member's genuine roster
    credential: what it must show to read that neighbour's shares."""

    def __init__(self, coord, identity) -> None:
        self.inner, self.identity = coord.secagg_exchange, identity
        self.setup: SessionSetup | None = None
        self.substituted: set[tuple[str, str]] = set()  # (recipient, the neighbour whose keys were swapped)

    async def secagg_exchange(self, *args, **kwargs):
        reply = await self.inner(*args, **kwargs)
        if not reply.broadcast:
            return reply
        msg = decode(reply.broadcast)
        if isinstance(msg, SessionSetup):
            self.setup = msg
        if isinstance(msg, KeysBroadcast) and self.setup is not None and len(msg.keys) >= 2:
            keys = list(msg.keys)
            k, other = keys[0], keys[1]
            c_pk = crypto.public_bytes(crypto.load_private(bytes(range(1, 33))))
            s_pk = crypto.public_bytes(crypto.load_private(bytes(range(2, 34))))
            signed = advertise_message(self.setup.config, k.node, c_pk, s_pk, k.seed_commitment)
            keys[0] = dataclasses.replace(k, channel_pk=c_pk, mask_pk=s_pk, credential=other.credential,
                                          signature=self.identity.sign(signed))
            self.substituted.add((msg.recipient, k.node))
            return dataclasses.replace(reply, broadcast=dataclasses.replace(msg, keys=tuple(keys)).to_bytes())
        return reply


@pytest.mark.parametrize("scope", ["tree", "cohort"])
def test_an_aggregator_that_substitutes_a_neighbours_keys_is_caught(tmp_path: Path, caplog, scope: str) -> None:
    caplog.set_level(logging.WARNING, logger="orchard.client.secure")

    async def main():
        data = tmp_path / "root"
        root = await start_root(data, server_cfg=FAST, start_grace_s=0.2)
        paths = TlsPaths.in_dir(data / "tls")
        aggs = []
        for tok in _issue(data, "aggregator", 2):
            aggs.append(await start_aggregator(root.address, token=tok, ca_cert=paths.ca_cert, tls_dir=data / "tls",
                                               server_cfg=FAST))
        fed = Federation(root, aggs)
        for i, tok in enumerate(_issue(data, "client", 6)):
            await add_clients(fed, aggs[i % 2].address, [i], 6, token=tok, ca=paths.ca_cert, insecure=False)
        # Aggregator 0 lies to the clients below it (client-0, -2, -4).
        relay = SubstitutingAggregator(aggs[0].coordinator, aggs[0].upstream.link.identity)
        aggs[0].coordinator.secagg_exchange = relay.secagg_exchange
        run = RunConfig(task="digits", rounds=1,
                        cohort=CohortConfig(target=6, over_selection=1.0, min_fraction=0.5, deadline_s=10.0, max_retries=0),
                        secure_aggregation=SecureAggregationConfig(enabled=True, scope=scope, dropout_rate=0.3))
        await start_run(root, run, insecure=False)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed"), 120)
        await fed.stop()
        return st, relay

    st, relay = asyncio.run(main())
    below = {"client-0", "client-2", "client-4"}
    assert {r for r, _ in relay.substituted} == below, (relay.substituted, st)
    # Each client below the relay left the neighbour out, naming it and why (the root's
    # roster does not hold the relay's key for it), and left the session rather than
    # take shares under keys it could not check; no client refused a genuine neighbour.
    caught = set()
    for rec in caplog.records:
        m = rec.getMessage()
        if "leaves out neighbour" in m:
            assert "does not hold this identity key" in m, m
            words = m.split()
            caught.add((words[2], words[6].rstrip(",")))
    assert caught == relay.substituted, (caught, relay.substituted)
    # The relay learns nothing: no round completes with every client in it.
    assert st["status"] == "failed" or all(r["participants"] < 6 for r in st["rounds"]), st
