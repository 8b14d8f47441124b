"""The pure parts of benchmarks/async.py and benchmarks/quality.py: which synchronous
closing policy is the best, the async / best-sync ratio, the correlated population's
shifted availability, and when a centralised baseline has plateaued."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_async() -> ModuleType:
    return _load("async")


@pytest.fixture(scope="module")
def bench_quality() -> ModuleType:
    return _load("quality")


def _row(mode: str, seconds: float | None) -> dict:
    return {"mode": mode, "to_target": None if seconds is None else {"simulated_s": seconds}}


def test_best_sync_is_the_fastest_that_reached_the_target(bench_async: ModuleType) -> None:
    rows = [_row("a", 30.0), _row("b", None), _row("c", 12.5), _row("d", 40.0)]
    assert bench_async.best_sync(rows)["mode"] == "c"
    assert bench_async.best_sync([_row("a", None)]) is None
    assert bench_async.best_sync([]) is None


def test_ratio_is_against_the_best_and_none_when_either_missed(bench_async: ModuleType) -> None:
    rows = [_row("slow", 20.0), _row("fast", 8.0)]
    best = bench_async.best_sync(rows)
    assert bench_async.time_ratio(_row("async", 2.0), best) == pytest.approx(0.25)
    assert bench_async.time_ratio(_row("async", None), best) is None
    assert bench_async.time_ratio(_row("async", 2.0), None) is None


def test_correlated_population_shifts_each_region_by_its_time_zone(bench_async: ModuleType) -> None:
    from orchard.simulation.config import DEFAULT_MIX, DEFAULT_PROFILES

    profiles, mix = bench_async.correlated_population(2)
    assert sum(mix.values()) == pytest.approx(sum(DEFAULT_MIX.values()))
    phone = DEFAULT_PROFILES["low_end_phone"].availability
    assert profiles["low_end_phone-r0"].availability == phone
    assert profiles["low_end_phone-r1"].availability == [phone[(h - 12) % 24] for h in range(24)]
    assert profiles["edge_box"] == DEFAULT_PROFILES["edge_box"]  # always on: no region
    assert bench_async.correlated_population(1)[1] == DEFAULT_MIX
    with pytest.raises(ValueError, match="divide 24"):
        bench_async.correlated_population(5)


def test_plateau_rule(bench_quality: ModuleType) -> None:
    plateaued = bench_quality.plateaued
    assert not plateaued([0.90, 0.95, 0.96], epochs=3)  # too short to judge
    assert not plateaued([0.90, 0.95, 0.96, 0.9620], epochs=3)  # +0.2 point over the best before
    assert plateaued([0.90, 0.95, 0.96, 0.9605, 0.9608, 0.9609], epochs=3)  # +0.09 point
    assert plateaued([0.97, 0.96, 0.96, 0.96], epochs=3)  # worse: plateaued (or past it)
    assert not plateaued([0.97, 0.96, 0.96, 0.9712], epochs=3)


def test_federated_minus_central_is_the_difference_of_means_in_points(bench_quality: ModuleType) -> None:
    fed = [{"seed": s, "accuracy_at": {"90": a}} for s, a in ((0, 0.980), (1, 0.982))]
    central = [{"best_accuracy": 0.990}, {"best_accuracy": 0.988}]
    out = bench_quality.mnist_comparison(fed, central, 90)
    assert out["federated_minus_central_points"] == pytest.approx(-0.8)
    with pytest.raises(ValueError, match="not evaluated"):
        bench_quality.mnist_comparison([{"seed": 0, "accuracy_at": {"90": None}}], central[:1], 90)
