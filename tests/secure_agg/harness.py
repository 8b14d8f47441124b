"""Drive a whole session in-process: real clients, real server, every message through
its binary form, dropouts chosen per stage."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from orchard.secure_agg import (
    ClientPolicy,
    SecAggClient,
    SecAggServer,
    SessionConfig,
    Stage,
    decode,
)
from orchard.secure_agg.prg import FoldWorkers, MaskExpander

STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING)
# An active session (the default) signs the survivor view between masked input and unmasking.
ACTIVE_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.CONSISTENCY,
                 Stage.UNMASKING)


# Sessions of every shape the protocol allows (the tests pick t down to a bare majority).
PERMISSIVE = ClientPolicy(min_participants=2, min_neighbours=1, corrupt_fraction=0.0)


def entropy(label: str, seed: int = 0) -> bytes:
    return hashlib.sha256(f"{label}/{seed}".encode()).digest()


def one_shot_sum(terms: Sequence[tuple[bytes, int]], length: int, bits: int) -> np.ndarray:
    """sum_i sign_i * PRG(seed_i) from whole one-shot masks: the reference for MaskFolder."""
    acc = np.zeros(length, dtype=np.uint32 if bits <= 32 else np.uint64)
    for seed, sign in terms:
        m = MaskExpander(length, bits).expand(seed)
        if sign > 0:
            acc += m
        else:
            acc -= m
    return acc


def make_config(n: int, d: int, k: int, t: int, *, seed: int = 0, round_number: int = 1,
                modulus_bits: int = 32, uneven_ids: bool = False, active: bool = True) -> SessionConfig:
    # Ids of one length (the server's fixed-stride paths) or of several (its general ones).
    ids = [f"c{i}" if uneven_ids else f"c{i:04d}" for i in range(n)]
    return SessionConfig.create(ids, d, neighbours=k, threshold=t, round_number=round_number,
                                entropy=entropy("session", seed), modulus_bits=modulus_bits, active=active)


def run_session(config: SessionConfig, inputs: Mapping[str, np.ndarray],
                drop: Mapping[Stage, Sequence[str]] | None = None, *, seed: int = 0,
                server_sees: list[np.ndarray] | None = None, threads: int | None = None,
                via_objects: bool = False, workers: FoldWorkers | None = None):
    """Run every stage; ``drop[stage]`` lists nodes that go silent from that stage on.
    ``via_objects`` hands the server decoded message objects instead of their bytes.

    Returns (server, clients). Raises whatever the protocol raises (e.g. SecAggAbort).
    """
    drop = drop or {}
    server = SecAggServer(config, threads=threads, workers=workers)
    clients = {p: SecAggClient(p, entropy=entropy(p, seed), policy=PERMISSIVE) for p in config.participants}
    gone: set[str] = set()
    for stage in ACTIVE_STAGES if config.active else STAGES:
        gone |= set(drop.get(stage, ()))
        for node in sorted(server.pending()):
            if node in gone:
                continue
            raw = server.broadcast_bytes(node)
            assert raw == server.broadcast_for(node).to_bytes()  # the direct writer is exact
            bcast = decode(raw)
            vec = inputs[node] if stage is Stage.MASKED_INPUT else None
            reply = clients[node].respond(bcast, vec).to_bytes()
            if server_sees is not None and stage is Stage.MASKED_INPUT:
                server_sees.append(decode(reply).vector.copy())
            server.receive(stage, node, decode(reply) if via_objects else reply)
        server.close_stage()
    return server, clients
