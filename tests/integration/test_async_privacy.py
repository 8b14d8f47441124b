"""FedBuff composes with clipping and central DP: asynchronous buffers fold through the
same aggregation stack as synchronous rounds (clip, then FedBuff's staleness weight,
then the root's noise), in the simulator and over gRPC.

What would fail if a stale update bypassed the stack: with a tiny norm bound the model
could move further per buffer than the bound allows, the clip metric would not say that
every update was clipped, and a DP run would show no noise in its record."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status

from orchard.aggregation.accounting import epsilon_spent
from orchard.config import CohortConfig, ModeConfig, RunConfig
from orchard.server.app import start_aggregator, start_root
from orchard.tasks import get_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulation"))
from test_simulation import _run, _sim  # noqa: E402

from orchard.simulation import run_simulation  # noqa: E402

DIGITS = {"with_replacement": True, "samples_per_client": 20}
MODE = ModeConfig(kind="async", buffer_size=5, max_staleness=3)
COHORT = CohortConfig(target=5, over_selection=4.0, min_fraction=0.5, deadline_s=600.0, weighting="uniform")
CENTRAL = {"mode": "central", "target_epsilon": 50.0, "clip_norm": 0.5}


def _norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def _simulate(rounds: int, **run: object):
    return run_simulation(_sim(clients=300, clients_per_round=5, rounds=rounds, aggregators=0, round_gap_s=0.0,
                               seed=5, run=_run(cohort=COHORT, mode=MODE, **run)))


def test_a_buffer_moves_the_model_at_most_its_norm_bound_stale_updates_included() -> None:
    bound, rounds = 1e-3, 5
    rep = _simulate(rounds, robust={"norm_bound": bound})
    assert rep.status == "completed" and len(rep.rounds) == rounds
    stale = sum(n for r in rep.rounds for s, n in r["staleness"].items() if int(s) > 0)
    assert stale > 0, [r["staleness"] for r in rep.rounds]  # stale updates went through the stack too
    # Every update was clipped (none within a norm this small) ...
    assert all(r["metrics"]["clip_below"] == 0.0 for r in rep.rounds), [r["metrics"] for r in rep.rounds]
    # ... so a buffer's mean, sum_i f(s_i) clip(x_i) / n with f <= 1, moves the model by at most the bound.
    init = get_task("digits", **DIGITS).initial_arrays(5)  # the simulation's seed is its run's
    assert _norm(rep.final_arrays, init) <= rounds * bound * (1 + 1e-6)
    free = _simulate(2)
    assert _norm(free.final_arrays, init) > 10 * rounds * bound  # unclipped, the same run moves much further


def test_central_dp_in_asynchronous_mode_adds_the_roots_noise_and_reports_epsilon() -> None:
    rounds = 4
    rep = _simulate(rounds, privacy=CENTRAL)
    assert rep.status == "completed" and len(rep.rounds) == rounds
    shown = rep.privacy
    z = shown["noise_multiplier"]
    assert shown["mode"] == "central" and shown["rounds_charged"] == rounds
    assert shown["epsilon"] == round(epsilon_spent(z, rounds, 1e-5), 6) and 0 < shown["epsilon"] <= 50.0
    for r in rep.rounds:  # the root's noise on each buffer, stddev z x C
        assert r["privacy"]["noise_stddev"] == z * 0.5, r["privacy"]
    assert any(int(s) > 0 for r in rep.rounds for s in r["staleness"]), [r["staleness"] for r in rep.rounds]
    # The noise is in the model: the same run with the same clip and no DP ends elsewhere.
    plain = _simulate(rounds, robust={"norm_bound": 0.5})
    assert _norm(rep.final_arrays, plain.final_arrays) > 1e-3


async def _grpc(tmp: Path, cfg: RunConfig) -> tuple[dict, dict[str, int]]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.5, seed=3)
    fed = Federation(root)
    agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST, seed=3)
    fed.aggregators.append(agg)
    await add_clients(fed, agg.address, list(range(6)), 6, task_params=DIGITS)
    try:
        await wait_joined(agg, 6)
        await start_run(root, cfg)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed", "stopped"), 180)
        return st, dict(agg.coordinator.staleness)
    finally:
        await fed.stop()


def test_fedbuff_with_central_dp_and_a_norm_bound_over_grpc(tmp_path: Path) -> None:
    """Root -> aggregator -> 6 clients: the aggregator clips the updates it decodes, the
    root weights each partial by its staleness and adds the noise to each buffer."""
    rounds = 4
    cfg = RunConfig.model_validate({
        "task": "digits", "task_params": DIGITS, "rounds": rounds, "seed": 3,
        "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
        "cohort": {"target": 2, "over_selection": 3.0, "min_fraction": 0.5, "deadline_s": 60, "weighting": "uniform"},
        "mode": {"kind": "async", "buffer_size": 2, "max_staleness": 4},
        "robust": {"norm_bound": 1e-3},
        "privacy": {"mode": "central", "target_epsilon": 30.0, "clip_norm": 0.5, "population": 6},
    })
    st, agg_staleness = asyncio.run(_grpc(tmp_path, cfg))
    assert st["status"] == "completed" and st["completed_rounds"] == rounds, st
    shown = st["privacy"]
    z = shown["noise_multiplier"]
    assert shown["mode"] == "central" and shown["rounds_charged"] == len(st["rounds"])
    assert shown["epsilon"] == round(epsilon_spent(z, shown["rounds_charged"], 1e-5), 6)
    assert 0 < shown["epsilon"] <= 30.0
    done = [r for r in st["rounds"] if r["status"] == "completed"]
    for r in done:
        # The noise is calibrated to the DP clip norm (z x 0.5); updates are clipped to the
        # tighter norm_bound, 1e-3. How many were clipped is not released under DP.
        assert r["privacy"]["noise_stddev"] == z * 0.5, r["privacy"]
        assert r["metrics"] == {} and "clipped" not in r["privacy"], r
    assert sum(agg_staleness.values()) >= sum(r["participants"] for r in done)
