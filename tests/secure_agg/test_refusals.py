"""Malformed, replayed, tampered and out-of-stage messages are refused with a named
SecAggError, change no state, and the session still completes; below t it aborts.

These sessions run the semi-honest protocol (version 1), where a client leaves on any bad
message; what an active session does instead is in test_active_adversary.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import entropy, make_config

from orchard.secure_agg import (
    AdvertiseKeys,
    DuplicateMessage,
    ExcludedNode,
    MalformedMessage,
    SecAggAbort,
    SecAggClient,
    SecAggError,
    SecAggServer,
    SessionSetup,
    ShareKeys,
    SharesBroadcast,
    Stage,
    TamperedCiphertext,
    UnknownPeer,
    UnmaskRequest,
    UnmaskShares,
    WrongSession,
    WrongStage,
    decode,
)

N, D, K, T = 8, 50, 4, 3


class Session:
    """A session driven by hand: ``step(stage)`` runs every live client through a stage."""

    def __init__(self, seed: int = 0, round_number: int = 1) -> None:
        self.cfg = make_config(N, D, K, T, seed=seed, round_number=round_number, active=False)
        self.server = SecAggServer(self.cfg)
        self.clients = {p: SecAggClient(p, entropy=entropy(p, seed)) for p in self.cfg.participants}
        rng = np.random.default_rng(seed)
        self.inputs = {p: rng.integers(0, 2**16, D, dtype=np.uint32) for p in self.cfg.participants}
        self.replies: dict[Stage, dict[str, bytes]] = {}

    def reply(self, node: str) -> bytes:
        stage = self.server.stage
        vec = self.inputs[node] if stage is Stage.MASKED_INPUT else None
        return self.clients[node].respond(self.server.broadcast_for(node), vec).to_bytes()

    def step(self, skip: tuple[str, ...] = (), close: bool = True) -> None:
        stage = self.server.stage
        out = self.replies.setdefault(stage, {})
        for node in sorted(self.server.pending()):
            if node not in skip:
                out[node] = self.reply(node)
                self.server.receive(stage, node, out[node])
        if close:
            self.server.close_stage()

    def run_to(self, stage: Stage) -> Session:
        """Every client through every stage before ``stage``; the server is then in it."""
        while self.server.stage is not stage:
            assert self.server.stage not in (Stage.DONE, Stage.ABORTED), f"ended {self.server.stage} before {stage}"
            self.step()
        return self

    def finish(self) -> np.ndarray:
        while self.server.stage is not Stage.DONE:
            self.step()
        r = self.server.result()
        return r.total, sum(self.inputs[p].astype(np.uint64) for p in r.contributors) % 2**32


def _assert_finishes(s: Session) -> None:
    total, plain = s.finish()
    assert np.array_equal(total, plain)


def test_replayed_message_in_the_same_stage() -> None:
    s = Session()
    s.step(close=False)
    node = s.cfg.participants[0]
    with pytest.raises(DuplicateMessage, match="already sent"):
        s.server.receive(Stage.ADVERTISE_KEYS, node, s.replies[Stage.ADVERTISE_KEYS][node])
    s.server.close_stage()
    _assert_finishes(s)


def test_message_from_a_previous_round_or_session() -> None:
    old = Session(seed=1, round_number=1)
    old.step()
    new = Session(seed=2, round_number=2)
    node = new.cfg.participants[0]
    with pytest.raises(WrongSession, match="replayed or misrouted"):
        new.server.receive(Stage.ADVERTISE_KEYS, node, old.replies[Stage.ADVERTISE_KEYS][node])
    # Same session id, other round number: still refused.
    msg = decode(new.reply(node))
    stale = dataclasses.replace(msg, round_number=1)
    with pytest.raises(WrongSession):
        new.server.receive(Stage.ADVERTISE_KEYS, node, stale.to_bytes())
    new.server.receive(Stage.ADVERTISE_KEYS, node, msg)
    new.step()
    _assert_finishes(new)


def test_message_from_the_wrong_stage() -> None:
    s = Session().run_to(Stage.SHARE_KEYS)
    node = s.cfg.participants[1]
    with pytest.raises(WrongStage):
        s.server.receive(Stage.SHARE_KEYS, node, s.replies[Stage.ADVERTISE_KEYS][node])
    with pytest.raises(WrongStage, match="session is in share_keys"):
        s.server.receive(Stage.ADVERTISE_KEYS, node, s.replies[Stage.ADVERTISE_KEYS][node])
    reply = s.clients[node].respond(s.server.broadcast_for(node))
    with pytest.raises(WrongStage, match="waits for the masked_input broadcast"):
        s.clients[node].respond(SessionSetup(node, s.cfg))
    # A re-polled broadcast (a lost reply) gets the very same reply, not fresh shares.
    assert s.clients[node].respond(s.server.broadcast_for(node)) is reply
    s.server.receive(Stage.SHARE_KEYS, node, reply)
    _assert_finishes(s)


def test_sender_must_match_the_authenticated_node() -> None:
    s = Session()
    a, b = s.cfg.participants[:2]
    with pytest.raises(UnknownPeer, match="claims sender"):
        s.server.receive(Stage.ADVERTISE_KEYS, b, s.reply(a))
    with pytest.raises(UnknownPeer, match="not a participant"):
        s.server.receive(Stage.ADVERTISE_KEYS, "intruder",
                         AdvertiseKeys(s.cfg.session_id, 1, "intruder", b"\x05" * 32,
                                       b"\x06" * 32))
    _assert_finishes(s)


def test_public_key_reuse_is_refused() -> None:
    s = Session()
    a, b = s.cfg.participants[:2]
    msg_a = decode(s.reply(a))
    s.server.receive(Stage.ADVERTISE_KEYS, a, msg_a)
    copied = AdvertiseKeys(msg_a.session_id, 1, b, msg_a.channel_pk, msg_a.mask_pk)
    with pytest.raises(DuplicateMessage, match="already in use"):
        s.server.receive(Stage.ADVERTISE_KEYS, b, copied)
    s.step()
    _assert_finishes(s)


def test_tampered_ciphertext_is_refused_by_its_recipient() -> None:
    s = Session().run_to(Stage.MASKED_INPUT)
    victim = s.cfg.participants[2]
    bcast = s.server.broadcast_for(victim)
    sender, ct = bcast.ciphertexts[0]
    flipped = bytes([ct[0] ^ 1]) + ct[1:]
    tampered = SharesBroadcast(bcast.session_id, 1, victim,
                               ((sender, flipped),) + bcast.ciphertexts[1:])
    with pytest.raises(TamperedCiphertext, match=sender):
        s.clients[victim].respond(tampered, s.inputs[victim])
    # Readdressed: a ciphertext for someone else presented as if from another sender.
    other_sender, other_ct = bcast.ciphertexts[1]
    swapped = SharesBroadcast(bcast.session_id, 1, victim,
                              ((sender, other_ct), (other_sender, ct)) + bcast.ciphertexts[2:])
    with pytest.raises(TamperedCiphertext):
        s.clients[victim].respond(swapped, s.inputs[victim])
    # The genuine broadcast still works: refusals change no state.
    _assert_finishes(s)


def test_ciphertext_replayed_from_another_session_fails_authentication() -> None:
    old, new = Session(seed=3), Session(seed=4)
    for s in (old, new):
        s.step()
        s.step()
    victim = new.cfg.participants[2]
    b_new = new.server.broadcast_for(victim)
    b_old = old.server.broadcast_for(victim)
    old_ct = dict(b_old.ciphertexts)
    sender = next(snd for snd, _ in b_new.ciphertexts if snd in old_ct)
    replayed = SharesBroadcast(b_new.session_id, 1, victim, tuple(
        (snd, old_ct[snd] if snd == sender else ct) for snd, ct in b_new.ciphertexts))
    with pytest.raises(TamperedCiphertext):
        new.clients[victim].respond(replayed, new.inputs[victim])


def test_shares_for_or_from_unknown_peers() -> None:
    s = Session().run_to(Stage.SHARE_KEYS)
    a = s.cfg.participants[0]
    msg = decode(s.reply(a))
    non_neighbour = next(p for p in s.cfg.participants
                         if p != a and p not in {r for r, _ in msg.ciphertexts})
    bad = ShareKeys(msg.session_id, 1, a, msg.ciphertexts[:-1] + ((non_neighbour, msg.ciphertexts[-1][1]),))
    with pytest.raises(UnknownPeer, match="not one of its neighbours"):
        s.server.receive(Stage.SHARE_KEYS, a, bad)
    dup = ShareKeys(msg.session_id, 1, a, msg.ciphertexts + msg.ciphertexts[:1])
    with pytest.raises(DuplicateMessage):
        s.server.receive(Stage.SHARE_KEYS, a, dup)
    short = ShareKeys(msg.session_id, 1, a, msg.ciphertexts[:-1])
    with pytest.raises(MalformedMessage, match="every neighbour"):
        s.server.receive(Stage.SHARE_KEYS, a, short)
    s.server.receive(Stage.SHARE_KEYS, a, msg)
    s.step()
    # Client side: shares from a node that is not its neighbour.
    b = s.cfg.participants[1]
    bcast = s.server.broadcast_for(b)
    stranger = next(p for p in s.cfg.participants
                    if p != b and p not in {x for x, _ in bcast.ciphertexts})
    forged = SharesBroadcast(bcast.session_id, 1, b, bcast.ciphertexts + ((stranger, b"\x00" * 200),))
    with pytest.raises(UnknownPeer):
        s.clients[b].respond(forged, s.inputs[b])
    _assert_finishes(s)


def test_unmasking_refusals() -> None:
    s = Session().run_to(Stage.MASKED_INPUT)
    dropped = s.cfg.participants[5]
    s.step(skip=(dropped,))  # masked inputs; `dropped` goes silent
    node = next(p for p in s.cfg.participants if p != dropped and
                dropped in s.server.broadcast_for(p).dropped)
    req = s.server.broadcast_for(node)
    # A server asking for both shares of one node is refused by the client.
    greedy = UnmaskRequest(req.session_id, 1, node, req.survivors + req.dropped, req.dropped)
    with pytest.raises(MalformedMessage, match="both shares"):
        s.clients[node].respond(greedy)
    reply = s.clients[node].respond(req)
    # Server side: shares for a node it did not ask about, duplicates, wrong lengths.
    owner, share = reply.self_mask_shares[0]
    extra = UnmaskShares(reply.session_id, 1, node, reply.self_mask_shares + (("nobody", share),),
                         reply.mask_key_shares)
    with pytest.raises(UnknownPeer):
        s.server.receive(Stage.UNMASKING, node, extra)
    twice = UnmaskShares(reply.session_id, 1, node, reply.self_mask_shares + ((owner, share),),
                         reply.mask_key_shares)
    with pytest.raises(DuplicateMessage):
        s.server.receive(Stage.UNMASKING, node, twice)
    cut = UnmaskShares(reply.session_id, 1, node, ((owner, share[:-1]),) + reply.self_mask_shares[1:],
                       reply.mask_key_shares)
    with pytest.raises(MalformedMessage):
        s.server.receive(Stage.UNMASKING, node, cut)
    with pytest.raises(ExcludedNode):
        s.server.receive(Stage.UNMASKING, dropped, UnmaskShares(reply.session_id, 1, dropped, (), ()))
    with pytest.raises(ExcludedNode):
        s.server.broadcast_for(dropped)
    s.server.receive(Stage.UNMASKING, node, reply)
    _assert_finishes(s)


def test_masked_input_of_the_wrong_shape_or_range() -> None:
    s = Session().run_to(Stage.MASKED_INPUT)
    a = s.cfg.participants[0]
    with pytest.raises(SecAggError) as err:
        s.server.receive(Stage.MASKED_INPUT, a, decode(s.replies[Stage.SHARE_KEYS][a]))
    assert isinstance(err.value, WrongStage)
    good = decode(s.reply(a))
    short = dataclasses.replace(good, vector=good.vector[:-1].copy())
    with pytest.raises(MalformedMessage, match="expected 50 words"):
        s.server.receive(Stage.MASKED_INPUT, a, short)
    with pytest.raises(MalformedMessage, match="cannot fit"):
        s.server.receive(Stage.MASKED_INPUT, a, good.to_bytes()[:-3])
    s.server.receive(Stage.MASKED_INPUT, a, good)
    _assert_finishes(s)


@pytest.mark.parametrize("stage_index", [0, 1, 2, 3])
def test_abort_below_threshold_at_every_stage(stage_index: int) -> None:
    s = Session()
    for _ in range(stage_index):
        s.step()
    silent = s.cfg.participants[: N - T + 1]  # only T - 1 nodes keep talking
    with pytest.raises(SecAggAbort):
        s.step(skip=tuple(silent))
    assert s.server.stage is Stage.ABORTED
    assert s.server.abort_reason
    # The abort is final and explicit for every later call.
    with pytest.raises(SecAggAbort):
        s.server.result()
    with pytest.raises(SecAggAbort):
        s.server.close_stage()
    with pytest.raises(SecAggAbort):
        s.server.broadcast_for(s.cfg.participants[-1])


def test_unmasking_aborts_when_too_few_shares_arrive() -> None:
    # Every masked input arrives, then almost nobody answers the unmask request.
    s = Session().run_to(Stage.UNMASKING)
    talkers = s.cfg.participants[:2]
    with pytest.raises(SecAggAbort, match="fewer than t=3"):
        s.step(skip=tuple(p for p in s.cfg.participants if p not in talkers))
    assert s.server.stage is Stage.ABORTED


def test_client_aborts_when_too_few_neighbours_remain() -> None:
    s = Session().run_to(Stage.SHARE_KEYS)
    a = s.cfg.participants[0]
    bcast = s.server.broadcast_for(a)
    starved = dataclasses.replace(bcast, keys=bcast.keys[: T - 1])
    with pytest.raises(SecAggAbort, match="threshold"):
        s.clients[a].respond(starved)
    with pytest.raises(WrongStage):
        s.clients[a].respond(bcast)


@pytest.mark.parametrize("stage_index", [0, 1])
def test_starved_neighbourhood_aborts_at_once(stage_index: int) -> None:
    # Silencing k - t + 1 neighbours of one node leaves it t - 1 holders: it can never
    # be unmasked and is excluded. In a Harary graph its ring neighbours lose the same
    # nodes plus it, so exclusions cascade and the session aborts at the end of this
    # stage, with a reason, instead of failing after the masked inputs.
    from orchard.secure_agg import NeighbourGraph

    s = Session(seed=21)
    graph = NeighbourGraph(N, K, s.cfg.graph_seed)
    silent = tuple(s.cfg.participants[j] for j in sorted(graph.neighbours(0))[: K - T + 1])
    for _ in range(stage_index):
        s.step()
    with pytest.raises(SecAggAbort, match="enough live neighbours"):
        s.step(skip=silent)
    assert s.server.stage is Stage.ABORTED
