"""SecAgg+ test vectors for liborchard_device (device/tests/test_secagg.cpp), written by
the Python package itself: whole sessions of both message versions through
``orchard.secure_agg``'s server and clients, broadcasts a lying server would send in
active sessions, Shamir shares, masks and the client's quantiser. Part of
``device_vectors.write_all``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from orchard.identity import SigningKey, certify
from orchard.secure_agg import (
    ClientPolicy,
    SecAggClient,
    SecAggServer,
    SessionConfig,
    SessionIdentity,
    Stage,
    decode,
    quantize,
)
from orchard.secure_agg.consistency import ConsistencyRequest
from orchard.secure_agg.errors import SecAggError
from orchard.secure_agg.messages import KeysBroadcast, Message, UnmaskRequest
from orchard.secure_agg.prg import ByteStream, expand_mask
from orchard.secure_agg.shamir import share_bytes


def _secagg_session(n: int, d: int, k: int, t: int, bits: int, drop_after_shares: list[str],
                    seed: int, active: bool = False, certified: bool = False) -> dict[str, Any]:
    """One whole SecAgg+ session through the Python server and clients, every message in
    its binary form: each client's entropy, and every broadcast it got with its reply.

    ``active``: the version-2 protocol (signed keys, the consistency stage, the signed
    view in the unmask request); ``certified``: each client signs with a device key the
    root certified and checks its neighbours' certificates against the root's key (else
    the key each derives from its entropy, taken on its word). Then a few broadcasts a
    lying server or relay could send, each with the Python client's reply or refusal."""
    ids = [f"client-{i:02d}" for i in range(n)]
    entropy = {p: hashlib.sha256(f"{p}/{seed}".encode()).digest() for p in ids}
    config = SessionConfig.create(ids, d, neighbours=k, threshold=t, round_number=seed + 1,
                                  entropy=hashlib.sha256(f"session/{seed}".encode()).digest(), modulus_bits=bits,
                                  active=active)
    g = np.random.default_rng(seed)
    inputs = {p: g.integers(0, 1 << min(bits, 16), size=d, dtype=np.uint32) for p in ids}
    root = SigningKey.from_bytes(hashlib.sha256(f"root/{seed}".encode()).digest()) if certified else None
    keys = {p: SigningKey.from_bytes(hashlib.sha256(f"device/{p}/{seed}".encode()).digest()) for p in ids}
    identity = {p: SessionIdentity(keys[p], certify(root, p, keys[p].public_key, 1_700_000_000 + seed))
                for p in ids} if root is not None else {p: None for p in ids}
    policy = ClientPolicy(root_public_key=root.public_key if root is not None else None)

    def client(p: str) -> SecAggClient:
        return SecAggClient(p, entropy=entropy[p], identity=identity[p], policy=policy)

    server = SecAggServer(config, root_public_key=policy.root_public_key,
                          entropy=hashlib.sha256(f"server/{seed}".encode()).digest())
    clients = {p: client(p) for p in ids}
    transcripts: dict[str, list[dict[str, Any]]] = {p: [] for p in ids}
    stages = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT) + \
        ((Stage.CONSISTENCY,) if active else ()) + (Stage.UNMASKING,)
    for stage in stages:
        for node in sorted(server.pending()):
            if stage not in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS) and node in drop_after_shares:
                continue
            raw = server.broadcast_bytes(node)
            vec = inputs[node] if stage is Stage.MASKED_INPUT else None
            reply = clients[node].respond(decode(raw), vec).to_bytes()
            transcripts[node].append({"broadcast": raw.hex(), "reply": reply.hex(),
                                      "vector": None if vec is None else [int(v) for v in vec]})
            server.receive(stage, node, reply)
        server.close_stage()
    result = server.result()
    want = sum(inputs[p].astype(np.uint64) for p in result.contributors) % (1 << bits)
    assert np.array_equal(result.total.astype(np.uint64), want)
    out: dict[str, Any] = {
        "participants": ids, "entropy": {p: e.hex() for p, e in entropy.items()}, "transcripts": transcripts,
        "dropped": drop_after_shares, "total": [int(v) for v in result.total], "active": active,
        "modulus_bits": bits,
        "root_public_key": root.public_key.hex() if root is not None else "",
        "identity": {p: {"key": keys[p].to_bytes().hex(), "certificate": identity[p].certificate.hex()}
                     for p in ids} if root is not None else None}
    if active:
        out["tampered"] = _secagg_tampered(transcripts, client, next(p for p in ids if p not in drop_after_shares))
    return out


def _secagg_tampered(transcripts: dict[str, list[dict[str, Any]]], client: Callable[[str], SecAggClient],
                     node: str) -> list[dict[str, Any]]:
    """Broadcasts of an active session altered as a lying server or relay would: each with
    the step it replaces and what a fresh Python client, replayed to there, answers (its
    reply, or the class of its refusal)."""
    steps = transcripts[node]

    def flip(b: bytes, at: int = 0) -> bytes:
        return b[:at] + bytes((b[at] ^ 0x41,)) + b[at + 1:]

    keys = KeysBroadcast.from_bytes(bytes.fromhex(steps[1]["broadcast"]))
    k0 = keys.keys[0]
    consistency = ConsistencyRequest.from_bytes(bytes.fromhex(steps[3]["broadcast"]))
    unmask = UnmaskRequest.from_bytes(bytes.fromhex(steps[4]["broadcast"]))
    n = len(transcripts)
    width = (n + 7) // 8
    u3_without_me = bytearray(consistency.view)
    me = sorted(transcripts).index(node)
    u3_without_me[width + me // 8] &= ~(1 << (me % 8)) & 0xFF
    cases: list[tuple[str, int, Message]] = [
        ("a neighbour's key signature altered", 1,
         replace(keys, keys=(replace(k0, signature=flip(k0.signature)), *keys.keys[1:]))),
        ("a neighbour's certificate altered", 1,
         replace(keys, keys=(replace(k0, credential=flip(k0.credential, len(k0.credential) - 1)), *keys.keys[1:]))),
        ("a neighbour's commitment altered", 1,
         replace(keys, keys=(replace(k0, seed_commitment=flip(k0.seed_commitment)), *keys.keys[1:]))),
        ("every neighbour's signature altered", 1,
         replace(keys, keys=tuple(replace(k, signature=flip(k.signature)) for k in keys.keys))),
        ("a view that leaves this client out of U3", 3, replace(consistency, view=bytes(u3_without_me))),
        ("an unmask request under another view", 4, replace(unmask, view=bytes(u3_without_me))),
        ("an unmask request with the signatures altered", 4,
         replace(unmask, signatures=tuple((s, flip(sig)) for s, sig in unmask.signatures))),
        ("an unmask request with one signature", 4, replace(unmask, signatures=unmask.signatures[:1])),
    ]
    out = []
    for what, at, msg in cases:
        c = client(node)
        for step in steps[:at]:
            c.respond(decode(bytes.fromhex(step["broadcast"])),
                      None if step["vector"] is None else np.array(step["vector"], dtype=np.uint32))
        raw = msg.to_bytes()
        try:
            got: dict[str, str] = {"reply": c.respond(decode(raw)).to_bytes().hex()}
        except SecAggError as err:
            got = {"error": type(err).__name__}
        out.append({"what": what, "node": node, "at": at, "broadcast": raw.hex(), **got})
    return out


def secagg_vectors() -> dict[str, Any]:
    """SecAgg+ from the Python package: whole sessions, Shamir shares, masks and the
    client's quantiser."""
    g = np.random.default_rng(7)
    shamir = []
    for secret_len, t, xs in ((32, 3, [1, 2, 5, 6]), (16, 1, [3]), (16, 4, [2, 4, 6, 8, 9]), (7, 2, [1, 9])):
        key = bytes(g.integers(0, 256, 32, dtype=np.uint8))
        secret = bytes(g.integers(0, 256, secret_len, dtype=np.uint8))
        shares = share_bytes(secret, t, xs, ByteStream(key))
        shamir.append({"key": key.hex(), "secret": secret.hex(), "threshold": t, "xs": xs,
                       "shares": [s.hex() for s in shares]})
    masks = []
    for length in (0, 1, 5, 4097):
        seed = bytes(g.integers(0, 256, 16, dtype=np.uint8))
        masks.append({"seed": seed.hex(), "length": length, "word": 4,
                      "mask": expand_mask(seed, length, 32).astype("<u4").tobytes().hex()})
    for length in (1, 3, 2049):  # 64-bit words: modulus_bits above 32
        seed = bytes(g.integers(0, 256, 16, dtype=np.uint8))
        masks.append({"seed": seed.hex(), "length": length, "word": 8,
                      "mask": expand_mask(seed, length, 64).astype("<u8").tobytes().hex()})
    quant = []
    for clip, bits in ((0.5, 16), (2.0, 8), (1e-3, 20)):
        x = g.standard_normal(300) * clip
        x[:3] = [clip * 3, -clip * 3, 0.0]
        seed = int(g.integers(0, 2**31 - 1))
        q = quantize(x, clip, bits, np.random.default_rng([seed, 0x5EC]))
        quant.append({"x": x.tolist(), "clip": clip, "bits": bits, "seed": seed, "q": [int(v) for v in q]})
    sessions = [_secagg_session(6, 37, 4, 3, 32, ["client-04"], 1),
                _secagg_session(4, 130, 3, 2, 20, [], 2),
                _secagg_session(9, 5, 6, 4, 24, ["client-00", "client-07"], 3),
                _secagg_session(7, 29, 6, 5, 32, ["client-03"], 4, active=True, certified=True),
                _secagg_session(5, 11, 4, 3, 24, [], 5, active=True),
                _secagg_session(10, 7, 8, 6, 20, ["client-01", "client-08"], 6, active=True, certified=True),
                # Fields above 32 bits: masked in 64-bit words.
                _secagg_session(5, 23, 4, 3, 48, ["client-02"], 7),
                _secagg_session(6, 17, 5, 4, 62, ["client-05"], 8, active=True, certified=True)]
    return {"shamir": shamir, "masks": masks, "quantize": quant, "sessions": sessions}
