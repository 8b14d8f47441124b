"""End to end: the unmasked sum equals the plain sum of the contributors' inputs exactly,
whatever drops out at whichever stage, as long as the threshold holds; otherwise the
session aborts with SecAggAbort and never returns a wrong sum."""

from __future__ import annotations

import numpy as np
import pytest
from harness import STAGES, make_config, run_session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from uniformity import chi_square_uniform_bytes

from orchard.secure_agg import SecAggAbort, SecAggServer, Stage, dequantize, quantize
from orchard.secure_agg.prg import DEFAULT_CHUNK_BYTES


def _plain_sum(inputs, contributors, modulus_bits: int) -> np.ndarray:
    total = 0
    for p in contributors:
        total = total + inputs[p].astype(object if modulus_bits > 32 else np.uint64)
    if not contributors:
        return None
    return np.asarray(total % (1 << modulus_bits), dtype=np.uint64 if modulus_bits > 32 else np.uint32)


@st.composite
def sessions(draw: st.DrawFn, max_n: int = 14):
    n = draw(st.integers(3, max_n))
    sparse = [k for k in range(2, n - 1, 2)]
    k = draw(st.sampled_from(sparse + [n - 1]))
    t = draw(st.integers(k // 2 + 1, k))
    d = draw(st.integers(0, 40))
    bits = draw(st.sampled_from([16, 20, 32, 48]))
    seed = draw(st.integers(0, 2**16))
    return n, k, t, d, bits, seed


def _inputs(cfg, bits: int, seed: int):
    rng = np.random.default_rng(seed)
    dtype = np.uint32 if bits <= 32 else np.uint64
    hi = 1 << min(bits, 63)
    return {p: rng.integers(0, hi, cfg.vector_length, dtype=dtype) for p in cfg.participants}


def _tolerable_drops(draw: st.DrawFn, cfg, k: int, t: int):
    """At most k - t nodes go silent, each at some stage: no node can lose more than
    k - t neighbours, so every secret keeps t holders."""
    budget = draw(st.integers(0, k - t))
    victims = draw(st.lists(st.sampled_from(cfg.participants), max_size=budget, unique=True))
    drops: dict[Stage, list[str]] = {}
    for v in victims:
        drops.setdefault(draw(st.sampled_from(STAGES)), []).append(v)
    return drops


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=sessions(), data=st.data())
def test_sum_is_exact_under_tolerable_dropouts(spec, data: st.DataObject) -> None:
    n, k, t, d, bits, seed = spec
    cfg = make_config(n, d, k, t, seed=seed, modulus_bits=bits)
    inputs = _inputs(cfg, bits, seed)
    drops = _tolerable_drops(data.draw, cfg, k, t)
    server, _ = run_session(cfg, inputs, drops, seed=seed)
    result = server.result()
    gone = {p for v in drops.values() for p in v}
    late = set(drops.get(Stage.UNMASKING, ()))
    # Contributors: everyone who sent a masked input (silent only at unmasking still counts).
    assert set(result.contributors) == (set(cfg.participants) - gone) | late
    assert np.array_equal(result.total, _plain_sum(inputs, result.contributors, bits))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=sessions(max_n=10), data=st.data())
def test_any_dropouts_give_the_exact_sum_or_an_abort(spec, data: st.DataObject) -> None:
    n, k, t, d, bits, seed = spec
    cfg = make_config(n, d, k, t, seed=seed, modulus_bits=bits)
    inputs = _inputs(cfg, bits, seed)
    drops = {s: data.draw(st.lists(st.sampled_from(cfg.participants), unique=True), label=s.value)
             for s in STAGES}
    try:
        server, _ = run_session(cfg, inputs, drops, seed=seed)
    except SecAggAbort:
        return
    result = server.result()
    assert len(result.contributors) >= t
    assert np.array_equal(result.total, _plain_sum(inputs, result.contributors, bits))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=sessions(max_n=12), data=st.data())
def test_uneven_ids_and_message_objects_give_the_same_exact_sum(spec, data: st.DataObject) -> None:
    """Ids of several lengths take the server's general paths (share lists walked record
    by record, ciphertext lengths checked one by one); message objects take the path that
    does not decode. Both must sum exactly as the fixed-stride byte path does."""
    n, k, t, d, bits, seed = spec
    uneven, via_objects = data.draw(st.booleans(), label="uneven"), data.draw(st.booleans(), label="objects")
    cfg = make_config(n, d, k, t, seed=seed, modulus_bits=bits, uneven_ids=uneven)
    inputs = _inputs(cfg, bits, seed)
    drops = _tolerable_drops(data.draw, cfg, k, t)
    server, _ = run_session(cfg, inputs, drops, seed=seed, via_objects=via_objects)
    result = server.result()
    assert np.array_equal(result.total, _plain_sum(inputs, result.contributors, bits))


def test_complete_graph_is_the_original_protocol() -> None:
    cfg = make_config(8, 100, 7, 5)
    inputs = _inputs(cfg, 32, 1)
    p = cfg.participants
    server, _ = run_session(cfg, inputs, {Stage.SHARE_KEYS: [p[0]], Stage.MASKED_INPUT: [p[1]]})
    r = server.result()
    assert r.contributors == p[2:]
    assert np.array_equal(r.total, _plain_sum(inputs, p[2:], 32))


@pytest.mark.parametrize("threads", [1, 3])
def test_sum_is_exact_with_masks_longer_than_a_chunk(threads: int) -> None:
    # Vectors of several mask-folder chunks plus a ragged tail, folded on one thread or
    # spread over three: survivors' self masks and dropped nodes' pairwise masks all come off.
    n, d, k, t = 12, 2 * DEFAULT_CHUNK_BYTES // 4 + 777, 6, 4
    cfg = make_config(n, d, k, t, seed=21)
    rng = np.random.default_rng(21)
    inputs = {p: rng.integers(0, 1 << 16, d, dtype=np.uint32) for p in cfg.participants}
    p = cfg.participants
    server, _ = run_session(cfg, inputs, {Stage.MASKED_INPUT: [p[2], p[7]]}, seed=21,
                            threads=threads)
    r = server.result()
    assert server.threads == threads
    assert r.contributors == tuple(q for q in p if q not in (p[2], p[7]))
    assert np.array_equal(r.total, _plain_sum(inputs, r.contributors, 32))
    assert r.measurements["mask_expansions"] == 10 + r.measurements["key_agreements"]


def test_larger_sparse_session_with_quantised_floats() -> None:
    n, d, k, t = 60, 3000, 12, 8
    cfg = make_config(n, d, k, t, seed=5)
    rng = np.random.default_rng(5)
    floats = {p: rng.uniform(-1, 1, d) for p in cfg.participants}
    inputs = {p: quantize(x, 1.0, 16, rng) for p, x in floats.items()}
    p = cfg.participants
    drops = {Stage.ADVERTISE_KEYS: [p[3]], Stage.SHARE_KEYS: [p[10]],
             Stage.MASKED_INPUT: [p[20], p[41]], Stage.UNMASKING: [p[50]]}
    server, _ = run_session(cfg, inputs, drops, seed=5)
    r = server.result()
    assert np.array_equal(r.total, _plain_sum(inputs, r.contributors, 32))
    mean = dequantize(r.total, 1.0, 16, len(r.contributors)) / len(r.contributors)
    plain_mean = np.mean([floats[q] for q in r.contributors], axis=0)
    assert np.max(np.abs(mean - plain_mean)) < 2 / 65535 + 1e-12
    assert r.measurements["mask_expansions"] > 0


@pytest.mark.parametrize("fill", ["zeros", "max"])
def test_masked_inputs_are_uniform_whatever_the_inputs(fill: str) -> None:
    # Chi-square on the bytes of every masked vector the server sees, at ALPHA = 1e-3
    # with fixed seeds (see uniformity.py). All-zero or all-max inputs must not show.
    n, d, k, t = 10, 20_000, 4, 3
    cfg = make_config(n, d, k, t, seed=11)
    value = 0 if fill == "zeros" else (1 << 16) - 1
    inputs = {p: np.full(d, value, dtype=np.uint32) for p in cfg.participants}
    seen: list[np.ndarray] = []
    run_session(cfg, inputs, seed=11, server_sees=seen)
    assert len(seen) == n
    for y in seen:
        ok, stat, crit = chi_square_uniform_bytes(y)
        assert ok, f"masked input not uniform: chi2 = {stat:.1f} > {crit:.1f}"
    ok, stat, crit = chi_square_uniform_bytes(np.concatenate(seen))
    assert ok, (stat, crit)


def test_the_uniformity_test_has_power() -> None:
    # The same test rejects what it should: unmasked quantised inputs, and inputs
    # masked with a mask that is reused (so y - y' leaks x - x').
    rng = np.random.default_rng(0)
    x = quantize(rng.normal(0, 0.3, 20_000), 1.0, 16, rng)
    assert not chi_square_uniform_bytes(x)[0]
    mask = rng.integers(0, 2**32, 20_000, dtype=np.uint32)
    assert chi_square_uniform_bytes(x + mask)[0]
    assert not chi_square_uniform_bytes((x + mask) - (np.zeros_like(x) + mask))[0]


@pytest.mark.slow
def test_paper_parameters_at_a_few_hundred_clients() -> None:
    # k and t from choose_parameters (sparse graph), 10% of clients drop after sharing
    # keys, so the server must rebuild their pairwise masks with surviving neighbours.
    from orchard.secure_agg import choose_parameters

    n, d = 300, 20_000
    params = choose_parameters(n, 0.1)
    assert not params.complete_graph
    cfg = make_config(n, d, params.neighbours, params.threshold, seed=9)
    inputs = _inputs(cfg, 16, 9)
    rng = np.random.default_rng(9)
    gone = list(rng.choice(cfg.participants, size=n // 10, replace=False))
    server, _ = run_session(cfg, inputs, {Stage.MASKED_INPUT: gone}, seed=9)
    r = server.result()
    assert len(r.contributors) == n - n // 10
    assert np.array_equal(r.total, _plain_sum(inputs, r.contributors, 32))


def test_server_refuses_zero_threads() -> None:
    with pytest.raises(ValueError, match="threads"):
        SecAggServer(make_config(4, 10, 2, 2), threads=0)
