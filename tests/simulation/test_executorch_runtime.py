"""``orchard simulate --runtime executorch``: the simulated clients train through the
task's ExecuTorch training program and the run matches the torch-trained one."""

from __future__ import annotations

import pytest

pytest.importorskip("executorch")

from orchard.config import CohortConfig, RunConfig  # noqa: E402
from orchard.errors import ConfigError  # noqa: E402
from orchard.simulation import DeviceProfile, SimulationConfig, run_simulation, simulation_problems  # noqa: E402

SMALL = dict(base="random", seq_len=16, n_layer=1, n_head=2, d_model=16, lora_rank=4, lora_alpha=8,
             lora_variant="full")
ALWAYS_ON = DeviceProfile(gflops=10.0, battery=False, availability=[1.0] * 24, dropout=0.0, latency_s=0.05)


def _sim(runtime: str, **kw: object) -> SimulationConfig:
    run = RunConfig(task="shakespeare", task_params=SMALL,
                    train={"steps": 5, "batch_size": 16, "learning_rate": 0.5},  # type: ignore[arg-type]
                    cohort=CohortConfig(target=6, over_selection=1.0, min_fraction=1.0, deadline_s=600.0))
    base: dict[str, object] = dict(clients=40, clients_per_round=6, rounds=2, progress=False, runtime=runtime,
                                   profiles={"box": ALWAYS_ON}, devices={"box": 1.0}, run=run, governor=False)
    base.update(kw)
    return SimulationConfig.model_validate(base)


def test_executorch_clients_match_torch_clients() -> None:
    et = run_simulation(_sim("executorch"))
    ref = run_simulation(_sim("torch", vectorize=False))
    assert [r["participants"] for r in et.rounds] == [6, 6]
    for a, b in zip(et.rounds, ref.rounds, strict=True):
        # 40 partitions hold more windows than a batch: the two runtimes draw batches
        # from different generators, so the runs agree statistically, not bit for bit.
        assert abs(a["accuracy"] - b["accuracy"]) <= 0.01, (a, b)
        assert abs(a["loss"] - b["loss"]) <= 0.02, (a, b)
    assert et.rounds[-1]["loss"] < ref.rounds[0]["loss"] + 0.02


def test_executorch_runtime_needs_the_local_backend() -> None:
    cfg = _sim("executorch", backend="process", workers=2)
    problems = simulation_problems({"simulation": cfg.model_dump(mode="python", exclude_none=True)})
    assert any("runtime 'executorch' runs on the local backend only" in p for p in problems)
    with pytest.raises(ConfigError, match="local backend only"):
        run_simulation(cfg)
