"""Distributed DP over a real gRPC tree: root, 2 aggregators, 6 clients, SecAgg+ with each
client adding its share of discrete Gaussian noise; epsilon in `run status --json`. With
scope "cohort" each aggregator runs its cohort's session; with scope "tree" the root runs
one session over all 6 clients and the aggregators relay (``Fleet.SecAgg``)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status
from typer.testing import CliRunner

from orchard import wire
from orchard.aggregation.accounting import epsilon_spent
from orchard.cli import app
from orchard.config import RunConfig
from orchard.ops import ControlClient
from orchard.server.app import start_aggregator, start_root
from orchard.tasks import get_task

DIGITS = {"with_replacement": True, "samples_per_client": 20}
RUN = RunConfig.model_validate({
    "task": "digits", "task_params": DIGITS, "rounds": 3, "seed": 3,
    "train": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
    "cohort": {"target": 6, "over_selection": 1.0, "min_fraction": 1.0, "deadline_s": 120, "weighting": "uniform"},
    "secure_aggregation": {"enabled": True},
    "privacy": {"mode": "distributed", "target_epsilon": 20.0, "population": 6, "clip_norm": 1.0},
})


async def _run(tmp: Path, run: RunConfig) -> tuple[dict, str, dict[str, np.ndarray]]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST, start_grace_s=0.2, seed=3)
    fed = Federation(root)
    try:
        for j in range(2):
            agg = await start_aggregator(root.address, insecure=True, server_cfg=FAST, seed=3)
            fed.aggregators.append(agg)
            await add_clients(fed, agg.address, [j, j + 2, j + 4], 6, task_params=DIGITS)
        for agg in fed.aggregators:
            await wait_joined(agg, 3)
        await start_run(root, run)
        st = await wait_status(root, lambda s: s.get("status") in ("completed", "failed", "stopped"), 240)
        res = await asyncio.to_thread(CliRunner().invoke, app, ["run", "status", "--server", root.address,
                                                                "--insecure", "--json"])
        assert res.exit_code == 0, res.output
        ctl = ControlClient(root.address, insecure=True)
        try:
            model = wire.blob_to_arrays(await asyncio.to_thread(ctl.pull_global))
        finally:
            ctl.close()
        return st, res.output, model
    finally:
        await fed.stop()


@pytest.mark.parametrize("scope", ["cohort", "tree"])
def test_distributed_dp_over_grpc_reports_epsilon(tmp_path: Path, scope: str) -> None:
    run = RunConfig.model_validate({**RUN.model_dump(), "secure_aggregation": {"enabled": True, "scope": scope}})
    st, cli_json, model = asyncio.run(_run(tmp_path, run))
    assert st["status"] == "completed" and st["completed_rounds"] == 3, st
    for r in st["rounds"]:
        assert r["participants"] == 6 and r["tier_participants"] and "root" not in r["tier_participants"]
        if scope == "tree":  # one session at the root; each client counted for the aggregator it came through
            assert sum(r["tier_participants"].values()) == 6 and len(r["tier_participants"]) == 2, r
    shown = json.loads(cli_json)["privacy"]
    z = shown["noise_multiplier"]
    # The epsilon the run reports is the accountant's for the three rounds it charged.
    assert shown["mode"] == "distributed" and shown["rounds_charged"] == 3 and shown["accountant_delta"] == 1e-5
    assert shown["epsilon"] == round(epsilon_spent(z, 3, 1e-5), 6) and 0 < shown["epsilon"] <= 20.0
    assert [r["privacy"]["epsilon"] for r in st["rounds"]] == sorted(r["privacy"]["epsilon"] for r in st["rounds"])
    init = get_task("digits", **DIGITS).initial_arrays(3)
    # The delta reported includes what clamping the noise shares at 10 sigma adds: at most
    # one share per device of the population per attempt, one draw per coordinate.
    draws = 3 * shown["population"] * sum(v.size for v in init.values())
    clamp = (1 + math.exp(epsilon_spent(z, 3, 1e-5))) * draws * 2 * math.exp(-50)
    assert shown["delta"] == pytest.approx(1e-5 + clamp, rel=1e-6) and shown["delta"] > 1e-5
    # Trained, noisy but finite: the model moved from its start.
    assert all(np.isfinite(v).all() for v in model.values())
    assert any(not np.allclose(model[k], init[k]) for k in init)
