"""Under DP nothing measured from the devices' data leaves un-noised: headers carry no
count or metric (they travel in the clear to tiers distributed DP does not trust), and
round records, the report and rounds.jsonl hold no clipped count, no clip_below, no
mean norm and no cohort metric mean (adaptive clipping's count is used noised only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from sim_cases import _deterministic, _run

from orchard.client.update import upload_header
from orchard.config import CohortConfig, RunConfig
from orchard.messages import TaskAssignment
from orchard.simulation import run_simulation
from orchard.trainer import TrainResult
from orchard.typing import TensorSpec

WITHHELD = ("clip_below", "mean_norm", "clipped", "train_loss", "train_accuracy")


def test_a_header_under_dp_carries_no_count_and_no_metric() -> None:
    t = TaskAssignment(run_id="r", round=1, attempt=0, task_id="t", model_hash="h", model_bytes=0, config_json="{}",
                       schema=(TensorSpec("w", (2,), "float32"),), deadline_unix=0.0, cohort_target=2, shared_seed=1)
    result = TrainResult(arrays={"w": np.zeros(2, np.float32)}, weight=1.0, num_examples=37, num_steps=4,
                         metrics={"train_loss": 0.42, "train_accuracy": 0.9})
    for mode, secure in (("central", False), ("distributed", True)):
        cfg = RunConfig.model_validate({"cohort": {"weighting": "uniform"}, "secure_aggregation": {"enabled": secure},
                                        "privacy": {"mode": mode, "noise_multiplier": 1.0}})
        h = upload_header(t, cfg, "n", b"", (0,), result, 1.0)
        assert (h.num_examples, h.num_steps, dict(h.metric_sums), dict(h.metric_weights)) == (0, 0, {}, {}), mode
    plain = upload_header(t, RunConfig(), "n", b"", (0,), result, 37.0)
    assert plain.num_examples == 37 and plain.metric_sums["train_loss"] > 0  # without DP, as ever


def test_records_and_the_report_withhold_what_no_noise_covers(tmp_path: Path) -> None:
    run = _run(rounds=2, cohort=CohortConfig(target=6, over_selection=1.0, min_fraction=1.0, deadline_s=600.0,
                                             weighting="uniform"),
               privacy={"mode": "central", "target_epsilon": 50.0, "clip_norm": 0.05,
                        "adaptive": {"target_quantile": 0.5}})
    rep = run_simulation(_deterministic(6, rounds=2, vectorize=False, run=run, out=str(tmp_path)))
    assert rep.status == "completed" and len(rep.rounds) == 2, rep.status
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    for where in (rep.rounds, rows):
        for r in where:
            assert r["metrics"] == {}, r["metrics"]
            assert "clipped" not in r["privacy"] and r["privacy"]["noise_stddev"] > 0
            text = json.dumps(r)
            assert not any(f'"{k}"' in text for k in WITHHELD), text
    # Adaptive clipping still moved the norm, from the noised count.
    assert rep.rounds[-1]["privacy"]["next_clip_norm"] != 0.05
