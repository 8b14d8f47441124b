"""``[server] keep_aggregates``: the root writes each completed round's aggregate beside
its checkpoint, and the initial model stepped through them with the server step is every
checkpoint, bit for bit (what benchmarks/chaos.py replays after its kills)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from fed_harness import FAST, Federation, add_clients, start_run, wait_joined, wait_status

from orchard import wire
from orchard.aggregation import Partial, server_step
from orchard.aggregation.server_opt import ServerOptimizer
from orchard.config import CohortConfig, RunConfig, ServerOptimizerConfig
from orchard.server.app import start_root
from orchard.server.root import aggregate_path


async def _run(tmp: Path, keep: bool) -> tuple[Federation, str]:
    root = await start_root(tmp / "root", insecure=True, server_cfg=FAST.model_copy(update={"keep_aggregates": keep}),
                            start_grace_s=0.5)
    fed = Federation(root)
    await add_clients(fed, root.address, [0, 1, 2], 3)
    await wait_joined(root, 3)
    cfg = RunConfig(task="digits", rounds=3, seed=3, server_optimizer=ServerOptimizerConfig(name="fedavgm", lr=0.5),
                    cohort=CohortConfig(target=3, over_selection=1.0, min_fraction=1.0, deadline_s=60))
    run_id = await start_run(root, cfg)
    await wait_status(root, lambda s: s.get("status") == "completed", 120)
    return fed, run_id


def test_the_kept_aggregates_replay_to_every_checkpoint(tmp_path: Path) -> None:
    async def main() -> None:
        fed, run_id = await _run(tmp_path, keep=True)
        try:
            store = fed.root.runner.store
            cfg = RunConfig.model_validate_json(store.get_run(run_id).config_json)
            arrays = wire.blob_to_arrays(Path(store.checkpoint(run_id, 0).path).read_bytes())
            opt = ServerOptimizer(cfg.server_optimizer, arrays)
            for rec in [r for r in store.rounds(run_id) if r["status"] == "completed"]:
                ck = Path(store.checkpoint(run_id, rec["round"]).path)
                sums = wire.blob_to_arrays(aggregate_path(ck).read_bytes())
                assert all(v.dtype == np.float64 for v in sums.values())
                arrays, _ = server_step(Partial(sums, rec["weight"], rec["participants"]), cfg, opt)
                want = wire.blob_to_arrays(ck.read_bytes())
                assert all(np.array_equal(arrays[k], want[k]) for k in want), rec["round"]
        finally:
            await fed.stop()

    asyncio.run(main())


def test_no_aggregate_is_kept_by_default(tmp_path: Path) -> None:
    async def main() -> None:
        fed, run_id = await _run(tmp_path, keep=False)
        try:
            ck = Path(fed.root.runner.store.checkpoint(run_id).path)
            assert ck.is_file() and not list(ck.parent.glob("*.aggregate.safetensors"))
        finally:
            await fed.stop()

    asyncio.run(main())
