"""Property: whatever up to the configured fraction of malicious clients send (garbage
shares, garbage ciphertexts, low-order keys, wrong-length vectors), an active session
returns the exact sum of its contributors' inputs, names only malicious clients as
offenders, or aborts; it never returns a wrong sum."""

from __future__ import annotations

import dataclasses

import numpy as np
from harness import PERMISSIVE, entropy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchard.secure_agg import (
    SecAggAbort,
    SecAggClient,
    SecAggError,
    SecAggServer,
    SessionConfig,
    Stage,
)

BEHAVIOURS = ("garbage_shares", "garbage_ciphertexts", "low_order_key", "wrong_length")
CORRUPT_FRACTION = 0.2


@st.composite
def attacks(draw: st.DrawFn):
    n = draw(st.integers(6, 12))
    k = draw(st.sampled_from([k for k in range(4, n - 1, 2)] + [n - 1]))
    t = draw(st.integers(k // 2 + 1, k))
    bad = draw(st.lists(st.integers(0, n - 1), unique=True, min_size=1,
                            max_size=max(1, int(CORRUPT_FRACTION * n))))
    how = [draw(st.sampled_from(BEHAVIOURS)) for _ in bad]
    return n, k, t, dict(zip(bad, how, strict=True)), draw(st.integers(0, 2**16))


def _garbage(rng: np.random.Generator, size: int) -> bytes:
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attacks())
def test_malicious_clients_never_change_the_sum(case) -> None:
    n, k, t, bad, seed = case
    d = 6
    ids = [f"c{i:02d}" for i in range(n)]
    cfg = SessionConfig.create(ids, d, neighbours=k, threshold=t, round_number=1, entropy=entropy("mal", seed))
    rng = np.random.default_rng(seed)
    inputs = {p: rng.integers(0, 2**16, d, dtype=np.uint32) for p in ids}
    role = {ids[i]: how for i, how in bad.items()}
    server = SecAggServer(cfg, entropy=entropy("server", seed))
    clients = {p: SecAggClient(p, entropy=entropy(p, seed), policy=PERMISSIVE) for p in ids}
    try:
        while server.stage is not Stage.DONE:
            stage = server.stage
            for p in sorted(server.pending()):
                try:
                    reply = clients[p].respond(server.broadcast_for(p),
                                               inputs[p] if stage is Stage.MASKED_INPUT else None)
                except SecAggAbort:
                    continue  # this client leaves; the session goes on without it
                how = role.get(p)
                if how == "low_order_key" and stage is Stage.ADVERTISE_KEYS:
                    reply = dataclasses.replace(reply, mask_pk=bytes(32))
                elif how == "garbage_ciphertexts" and stage is Stage.SHARE_KEYS:
                    reply = dataclasses.replace(reply, ciphertexts=tuple(
                        (r, _garbage(rng, len(c))) for r, c in reply.ciphertexts))
                elif how == "wrong_length" and stage is Stage.MASKED_INPUT:
                    reply = dataclasses.replace(reply, vector=np.zeros(d + 1, dtype=np.uint32))
                elif how == "garbage_shares" and stage is Stage.UNMASKING:
                    reply = dataclasses.replace(
                        reply, self_mask_shares=tuple((o, _garbage(rng, len(s))) for o, s in reply.self_mask_shares),
                        mask_key_shares=tuple((o, _garbage(rng, len(s))) for o, s in reply.mask_key_shares))
                try:
                    server.receive(stage, p, reply.to_bytes())
                except SecAggAbort:
                    raise
                except SecAggError:
                    assert p in role, f"an honest client's {stage.value} message was refused"
            server.close_stage()
    except SecAggAbort:
        assert server.stage is Stage.ABORTED
        return
    res = server.result()
    want = sum(inputs[p].astype(np.uint64) for p in res.contributors) % 2**32
    assert np.array_equal(res.total, want)
    assert set(res.offenders) <= set(role), "an honest holder was named an offender"
    assert not {p for p, how in role.items() if how in ("low_order_key", "wrong_length")} & set(res.contributors)
