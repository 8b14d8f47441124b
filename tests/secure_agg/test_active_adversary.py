"""Attacks by a lying server, a key-substituting relay and malicious clients, run against
the real ``SecAggClient`` / ``SecAggServer``: each must be refused, detected or survived
with the exact sum (Bonawitz et al., 2017, §6; Bell et al., 2020, malicious variant)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import entropy, make_config

from orchard.identity import SigningKey, certify
from orchard.secure_agg import (
    ClientPolicy,
    ConsistencyRequest,
    PeerKeys,
    SecAggClient,
    SecAggConfigError,
    SecAggError,
    SecAggServer,
    SessionConfig,
    SessionIdentity,
    SessionSetup,
    SharesBroadcast,
    Stage,
    UnmaskRequest,
    View,
    crypto,
)
from orchard.secure_agg.active import advertise_message
from orchard.secure_agg.graph import NeighbourGraph
from orchard.secure_agg.prg import expand_mask
from orchard.secure_agg.shamir import reconstruct_bytes

# What choose_parameters(1000, 0.1) picks; n is smaller (the attack needs n >= ~2k).
N_ATTACK, K_ATTACK, T_ATTACK = 180, 86, 57


def _clients(cfg: SessionConfig, seed: int = 0) -> dict[str, SecAggClient]:
    return {p: SecAggClient(p, entropy=entropy(p, seed)) for p in cfg.participants}


def _run_keys(server: SecAggServer, clients: dict[str, SecAggClient]) -> None:
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS):
        for p in sorted(server.pending()):
            server.receive(stage, p, clients[p].respond(server.broadcast_for(p)).to_bytes())
        server.close_stage()


def test_dropout_equivocation_recovers_nothing() -> None:
    """The server tells A's neighbours that A survived (they reveal b_A) and tells the
    neighbours of A's peers that those peers dropped (they reveal the peers' mask keys),
    keeping every client's dropped list within k - t; it delivers only t of the share
    ciphertexts to A, so A masks with t peers only. The clients must refuse before the
    server holds t shares of both kinds."""
    n, k, t, d = N_ATTACK, K_ATTACK, T_ATTACK, 8
    cfg = make_config(n, d, k, t)
    ids = cfg.participants
    idx = {p: i for i, p in enumerate(ids)}
    graph = NeighbourGraph(n, k, cfg.graph_seed)
    nb = {p: {ids[j] for j in graph.neighbours(idx[p])} for p in ids}
    server, clients = SecAggServer(cfg), _clients(cfg)
    rng = np.random.default_rng(0)
    inputs = {p: rng.integers(0, 2**16, d, dtype=np.uint32) for p in ids}
    victim = ids[0]
    _run_keys(server, clients)
    mask_pk = {victim: crypto.public_bytes(clients[victim]._s_sk)}
    # S: the t peers A will mask with; Q[p]: t holders of p's shares, each asked to reveal
    # at most k - t "dropped" peers (so that its own check, >= t survivors, passes).
    load = dict.fromkeys(ids, 0)
    peers: list[str] = []
    holders: dict[str, list[str]] = {}
    for p in sorted(nb[victim], key=idx.__getitem__):
        if len(peers) == t:
            break
        cand = sorted((q for q in nb[p] if q != victim and load[q] < k - t), key=load.__getitem__)
        if len(cand) >= t:
            holders[p] = cand[:t]
            peers.append(p)
            for q in holders[p]:
                load[q] += 1
    assert len(peers) == t, "the attack's assignment must be feasible at this n"
    masked = {}
    refused = 0
    for p in ids:
        b = server.broadcast_for(p)
        if p == victim:
            b = SharesBroadcast(b.session_id, b.round_number, b.recipient,
                                tuple(c for c in b.ciphertexts if c[0] in peers))
        try:
            masked[p] = clients[p].respond(b, inputs[p]).vector.copy()
        except SecAggError:
            refused += 1
    # The consistency round: each client is shown the view the attacker needs from it
    # (U3 without the peers whose keys it should reveal) and signs what it accepts; each
    # unmask request then carries every signature the attacker holds on that view.
    views: dict[str, bytes] = {}
    sigs: dict[str, bytes] = {}
    for r in masked:
        d_r = {idx[p] for p in peers if r in holders[p]}
        views[r] = View(n, frozenset(range(n)), frozenset(range(n)) - d_r).to_bytes()
        try:
            sigs[r] = clients[r].respond(ConsistencyRequest(cfg.session_id, cfg.round_number, r, views[r])).signature
        except SecAggError:
            refused += 1
    seed_shares: dict[int, bytes] = {}
    key_shares: dict[str, dict[int, bytes]] = {p: {} for p in peers}
    for r in sigs:
        signed = tuple((q, sigs[q]) for q in sorted(nb[r]) if q in sigs and views[q] == views[r])
        req = UnmaskRequest(cfg.session_id, cfg.round_number, r, (), (), views[r], signed)
        try:
            reply = clients[r].respond(req)
        except SecAggError:
            refused += 1
            continue
        for owner, share in reply.self_mask_shares:
            if owner == victim:
                seed_shares[idx[r] + 1] = share
        for owner, share in reply.mask_key_shares:
            if owner in key_shares:
                key_shares[owner][idx[r] + 1] = share
    got_seed = len(seed_shares) >= t
    got_keys = all(len(v) >= t for v in key_shares.values())
    if victim in masked and got_seed and got_keys:
        x = masked[victim] - expand_mask(reconstruct_bytes(seed_shares, t, 16), d, 32)
        for p in peers:
            sk = crypto.load_private(reconstruct_bytes(key_shares[p], t, 32))
            m = expand_mask(crypto.pairwise_seed(sk, mask_pk[victim], cfg.session_id, cfg.round_number,
                                                 victim, p), d, 32)
            x = x - m if idx[victim] < idx[p] else x + m
        assert not np.array_equal(x, inputs[victim]), "the server recovered the victim's exact input"
    assert refused > 0, "no client refused the lying server"
    assert not (got_seed and got_keys)


def _certified(cfg: SessionConfig, root: SigningKey) -> dict[str, SecAggClient]:
    out = {}
    for p in cfg.participants:
        key = SigningKey.from_bytes(entropy(f"device/{p}"))
        out[p] = SecAggClient(p, entropy=entropy(p), identity=SessionIdentity(key, certify(root, p, key.public_key, 1)),
                              policy=ClientPolicy(root_public_key=root.public_key))
    return out


def test_relay_that_substitutes_a_key_is_detected() -> None:
    """A relay swaps a neighbour's keys for its own in A's key broadcast, re-signed with an
    identity key of its own: the root never certified that key for the neighbour, so A
    treats the neighbour as absent and sends the relay nothing."""
    cfg = make_config(8, 10, 4, 3)
    root = SigningKey.from_bytes(entropy("root"))
    server, clients = SecAggServer(cfg, root_public_key=root.public_key), _certified(cfg, root)
    for p in cfg.participants:
        server.receive(Stage.ADVERTISE_KEYS, p, clients[p].respond(server.broadcast_for(p)).to_bytes())
    server.close_stage()
    victim = cfg.participants[0]
    bcast = server.broadcast_for(victim)
    mine = crypto.load_private(entropy("relay"))
    peer = bcast.keys[0]
    relay_id = SigningKey.from_bytes(entropy("relay-identity"))
    c_pk = crypto.public_bytes(mine)
    s_pk = crypto.public_bytes(crypto.load_private(entropy("relay2")))
    signed = advertise_message(cfg, peer.node, c_pk, s_pk, peer.seed_commitment)
    for credential in (relay_id.public_key, certify(relay_id, peer.node, relay_id.public_key, 1), peer.credential):
        forged = dataclasses.replace(peer, channel_pk=c_pk, mask_pk=s_pk, credential=credential,
                                     signature=relay_id.sign(signed))
        assert isinstance(forged, PeerKeys)
        tampered = dataclasses.replace(bcast, keys=(forged, *bcast.keys[1:]))
        reply = SecAggClient(victim, entropy=entropy(victim), identity=clients[victim].identity,
                             policy=clients[victim].policy)
        reply.respond(SessionSetup(victim, cfg))
        out = reply.respond(tampered)
        assert peer.node not in {r for r, _ in out.ciphertexts}
    # Unforged, the same broadcast is taken whole.
    assert peer.node in {r for r, _ in clients[victim].respond(bcast).ciphertexts}


def test_one_tweaked_share_is_identified_and_the_sum_stays_exact() -> None:
    n, d, k, t = 10, 16, 6, 4
    cfg = make_config(n, d, k, t)
    server, clients = SecAggServer(cfg), _clients(cfg)
    rng = np.random.default_rng(1)
    inputs = {p: rng.integers(0, 2**16, d, dtype=np.uint32) for p in cfg.participants}
    _run_keys(server, clients)
    for p in sorted(server.pending()):
        server.receive(Stage.MASKED_INPUT, p, clients[p].respond(server.broadcast_for(p), inputs[p]).to_bytes())
    server.close_stage()
    liar = cfg.participants[0]  # the lowest evaluation point: reconstructions use it first
    idx = {p: i for i, p in enumerate(cfg.participants)}
    graph = NeighbourGraph(n, k, cfg.graph_seed)

    def holders(owner: str) -> list[str]:
        return [cfg.participants[j] for j in graph.neighbours(idx[owner])]
    while server.stage is not Stage.DONE:
        stage = server.stage
        for p in sorted(server.pending()):
            reply = clients[p].respond(server.broadcast_for(p))
            if p == liar and stage is Stage.UNMASKING:
                owner, share = reply.self_mask_shares[0]
                bad = _tweak(share, idx[liar] + 1, [idx[h] + 1 for h in holders(owner)], t)
                reply = dataclasses.replace(reply, self_mask_shares=((owner, bad), *reply.self_mask_shares[1:]))
            server.receive(stage, p, reply.to_bytes())
        server.close_stage()
    res = server.result()
    want = sum(inputs[p].astype(np.uint64) for p in res.contributors) % 2**32
    assert np.array_equal(res.total, want)
    assert liar in res.offenders


def _tweak(share: bytes, x: int, points: list[int], t: int) -> bytes:
    """A share changed so that the secret the t lowest points interpolate to moves by one
    in its first 16-bit limb (still a valid byte string: nothing looks wrong)."""
    p = 2**31 - 1
    pts = sorted(points)[:t]
    lam = 1
    for a in pts:
        if a != x:
            lam = lam * a * pow(a - x, -1, p) % p
    limbs = list(np.frombuffer(share, dtype="<u4"))
    limbs[0] = (int(limbs[0]) + pow(lam, -1, p)) % p
    return np.array(limbs, dtype="<u4").tobytes()


LOW_ORDER = bytes(32)  # the identity point: every X25519 agreement with it is zero


def test_a_low_order_key_is_refused_at_the_server_and_the_neighbours_finish() -> None:
    cfg = make_config(8, 10, 4, 3)
    server, clients = SecAggServer(cfg), _clients(cfg)
    bad = cfg.participants[3]
    for p in cfg.participants:
        reply = clients[p].respond(server.broadcast_for(p))
        if p == bad:
            reply = dataclasses.replace(reply, mask_pk=LOW_ORDER)
            with pytest.raises(SecAggError):
                server.receive(Stage.ADVERTISE_KEYS, p, reply.to_bytes())
            continue
        server.receive(Stage.ADVERTISE_KEYS, p, reply.to_bytes())
    server.close_stage()
    rng = np.random.default_rng(2)
    inputs = {p: rng.integers(0, 2**16, 10, dtype=np.uint32) for p in cfg.participants}
    while server.stage is not Stage.DONE:
        stage = server.stage
        for p in sorted(server.pending()):
            vec = inputs[p] if stage is Stage.MASKED_INPUT else None
            server.receive(stage, p, clients[p].respond(server.broadcast_for(p), vec).to_bytes())
        server.close_stage()
    res = server.result()
    assert bad not in res.contributors and len(res.contributors) == 7
    assert np.array_equal(res.total, sum(inputs[p].astype(np.uint64) for p in res.contributors) % 2**32)


def test_parameters_below_the_clients_floors_are_refused() -> None:
    cfg = SessionConfig.create(["a", "b"], 4, neighbours=1, threshold=1, round_number=1,
                               entropy=entropy("floors"))
    client = SecAggClient("a", entropy=entropy("a"))
    with pytest.raises((SecAggConfigError, SecAggError)):
        client.respond(SessionSetup("a", cfg))


def test_a_shares_broadcast_lacking_a_neighbour_is_refused() -> None:
    """The server leaves one neighbour's ciphertext out of A's shares broadcast although
    that neighbour shared keys: A must refuse before it reveals any share."""
    cfg = make_config(8, 10, 4, 3)
    server, clients = SecAggServer(cfg), _clients(cfg)
    _run_keys(server, clients)
    victim = cfg.participants[0]
    rng = np.random.default_rng(3)
    inputs = {p: rng.integers(0, 2**16, 10, dtype=np.uint32) for p in cfg.participants}
    revealed = False
    try:
        while server.stage is not Stage.DONE:
            stage = server.stage
            for p in sorted(server.pending()):
                b = server.broadcast_for(p)
                if p == victim and stage is Stage.MASKED_INPUT:
                    omitted = b.ciphertexts[0][0]
                    b = SharesBroadcast(b.session_id, b.round_number, b.recipient, b.ciphertexts[1:])
                if p == victim and stage is Stage.UNMASKING:  # keep the lie consistent for A
                    b = dataclasses.replace(b, survivors=tuple(x for x in b.survivors if x != omitted),
                                            dropped=tuple(x for x in b.dropped if x != omitted))
                reply = clients[p].respond(b, inputs[p] if stage is Stage.MASKED_INPUT else None)
                if p == victim and stage is Stage.UNMASKING:
                    revealed = True
                if not (p == victim and stage is Stage.UNMASKING):
                    server.receive(stage, p, reply.to_bytes())
            server.close_stage()
    except SecAggError:
        pass
    assert not revealed
