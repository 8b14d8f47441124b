"""Plain-sum oracle for the aggregation stack, and the tree-equals-flat property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.aggregation import Accumulator, Partial, ServerOptimizer, finalize, merge
from orchard.config import ServerOptimizerConfig
from orchard.errors import UpdateSchemaError
from orchard.typing import TensorSpec, schema_of


def _updates(rng: np.random.Generator, n: int, shapes: list[tuple[int, ...]]):
    ups = []
    for _ in range(n):
        arrays = {f"t{i}": rng.normal(size=s).astype(np.float32) * rng.uniform(0.01, 100) for i, s in enumerate(shapes)}
        w = float(rng.integers(1, 500))
        ups.append((arrays, w, {"loss": float(rng.uniform(0, 3))}))
    return ups


def _fold_tree(ups, schema, rng: np.random.Generator, depth: int) -> Partial:
    """Fold updates through a random tree of the given depth: split, fold each part, merge."""
    if depth == 0 or len(ups) <= 1:
        acc = Accumulator(schema)
        for a, w, m in ups:
            acc.accumulate(a, w, m)
        return acc.partial
    k = int(rng.integers(1, min(4, len(ups)) + 1))
    cuts = np.sort(rng.choice(np.arange(1, len(ups)), size=k - 1, replace=False)) if k > 1 else []
    parts = np.split(np.arange(len(ups)), cuts)
    acc = Accumulator(schema)
    for idx in parts:
        acc.merge(_fold_tree([ups[i] for i in idx], schema, rng, depth - 1))
    return acc.partial


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    depth=st.integers(1, 4),
    shapes=st.lists(st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4),
)
def test_tree_equals_flat_and_plain_oracle(seed, n, depth, shapes):
    rng = np.random.default_rng(seed)
    ups = _updates(rng, n, shapes)
    schema = schema_of(ups[0][0])
    tree_mean, tree_metrics = finalize(_fold_tree(ups, schema, rng, depth))
    flat_mean, flat_metrics = finalize(_fold_tree(ups, schema, rng, 0))
    total_w = sum(w for _, w, _ in ups)
    for k in flat_mean:
        oracle = sum(np.float64(w) * a[k].astype(np.float64) for a, w, _ in ups) / total_w
        scale = np.abs(oracle).max() + 1e-12
        assert np.abs(tree_mean[k] - flat_mean[k]).max() <= 1e-6 * scale
        assert np.abs(flat_mean[k] - oracle).max() <= 1e-6 * scale
    oracle_loss = sum(w * m["loss"] for _, w, m in ups) / total_w
    assert tree_metrics["loss"] == pytest.approx(oracle_loss, rel=1e-9)
    assert flat_metrics["loss"] == pytest.approx(oracle_loss, rel=1e-9)


def test_merge_counts_and_is_pure():
    rng = np.random.default_rng(0)
    ups = _updates(rng, 6, [(3, 2)])
    schema = schema_of(ups[0][0])
    a, b = _fold_tree(ups[:2], schema, rng, 0), _fold_tree(ups[2:], schema, rng, 0)
    before = a.sums["t0"].copy()
    m = merge(a, b)
    assert m.count == 6 and m.weight == pytest.approx(a.weight + b.weight)
    np.testing.assert_array_equal(a.sums["t0"], before)


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"t0": np.zeros((2, 2), np.float32)}, "shape"),
        ({"t0": np.zeros((3, 2), np.float64)}, "dtype"),
        ({"t0": np.full((3, 2), np.nan, np.float32)}, "NaN"),
        ({"t0": np.zeros((3, 2), np.float32), "x": np.zeros(1, np.float32)}, "unexpected"),
        ({}, "missing"),
    ],
)
def test_bad_updates_are_refused_and_leave_state_unchanged(bad, msg):
    acc = Accumulator([TensorSpec("t0", (3, 2), "float32")])
    acc.accumulate({"t0": np.ones((3, 2), np.float32)}, 2.0)
    with pytest.raises(UpdateSchemaError, match=msg):
        acc.accumulate(bad, 1.0)
    assert acc.count == 1 and acc.weight == 2.0
    np.testing.assert_array_equal(acc.partial.sums["t0"], np.full((3, 2), 2.0))


def test_bad_weight_refused():
    acc = Accumulator([TensorSpec("t0", (1,), "float32")])
    for w in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UpdateSchemaError, match="weight"):
            acc.accumulate({"t0": np.ones(1, np.float32)}, w)


def test_finalize_empty_refused():
    with pytest.raises(UpdateSchemaError, match="empty"):
        finalize(Accumulator([TensorSpec("t", (1,), "float32")]).partial)


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_server_optimizers_move_toward_the_mean_update(name):
    x0 = {"w": np.zeros(4, np.float32)}
    cfg = ServerOptimizerConfig(name=name, lr=1.0 if name in ("fedavg", "fedavgm") else 0.1)
    opt = ServerOptimizer(cfg, x0)
    delta = {"w": np.array([1.0, -1.0, 0.5, 0.0], np.float32)}
    x1 = opt.step(delta)["w"]
    # Every optimizer moves each coordinate in the direction of the mean delta.
    assert np.all(np.sign(x1) == np.sign(delta["w"]))
    if name == "fedavg":
        np.testing.assert_allclose(x1, delta["w"])  # x + mean_delta exactly


def test_fedadam_matches_torch_adam_by_hand():
    # Reference: Adam with bias correction, written out (Kingma & Ba, Alg. 1).
    cfg = ServerOptimizerConfig(name="fedadam", lr=0.05, beta1=0.9, beta2=0.99, tau=1e-3)
    x = np.array([0.3, -0.2], np.float64)
    opt = ServerOptimizer(cfg, {"w": x.astype(np.float32)})
    m = np.zeros(2)
    v = np.zeros(2)
    rng = np.random.default_rng(1)
    for t in range(1, 6):
        d = rng.normal(size=2).astype(np.float32)
        got = opt.step({"w": d})["w"]
        g = -d.astype(np.float64)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        mh, vh = m / (1 - 0.9**t), v / (1 - 0.99**t)
        x = x - 0.05 * mh / (np.sqrt(vh) + 1e-3)
        np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-6)


def test_server_optimizer_state_roundtrip():
    cfg = ServerOptimizerConfig(name="fedyogi", lr=0.1)
    a = ServerOptimizer(cfg, {"w": np.zeros(3, np.float32)})
    a.step({"w": np.ones(3, np.float32)})
    b = ServerOptimizer(cfg, a.arrays())
    b.load_state_bytes(a.state_bytes())
    d = {"w": np.array([0.5, -0.5, 1.0], np.float32)}
    np.testing.assert_array_equal(a.step(d)["w"], b.step(d)["w"])
