"""``run_simulation``: the recipe. Validate, build the task, the population, the tree and
the backend, run the rounds, write what happened."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from orchard import wire
from orchard.aggregation import ServerOptimizer
from orchard.aggregation.layer import CLIP_BELOW
from orchard.aggregation.privacy import PrivacyLedger
from orchard.errors import ConfigError, PrivacyBudgetExceeded
from orchard.heap import keep_freed_memory
from orchard.simulation.backends import make_backend
from orchard.simulation.config import SimulationConfig, simulation_problems
from orchard.simulation.engine import Engine
from orchard.simulation.gcpause import cyclic_gc_paused
from orchard.simulation.population import Population
from orchard.simulation.report import SimulationReport, append_round, write_report
from orchard.tasks import get_task

# An arbitrary fixed epoch for simulated wall time (2025-01-06 00:00 UTC), so that
# time-of-day rules see the same hours on every host; the simulation's local time is
# its start_hour on that day.
_WALL_ORIGIN = 1736121600.0


def _flops_per_example(task: Any, arrays: dict[str, np.ndarray]) -> float:
    # Forward plus backward is ~6 flops per parameter per example (the usual estimate);
    # a frozen base still runs forward and backward through, so count the whole model.
    build = getattr(task, "build_model", None)
    if build is not None:
        n = sum(p.numel() for p in build().parameters())
    else:
        n = sum(int(v.size) for v in arrays.values())
    return 6.0 * n


def _failure(rnd: int, rec: dict[str, Any], cfg: SimulationConfig) -> str:
    """Why the run stopped at a round that failed every attempt, and what to change when
    too few devices checked in for the round to fill."""
    reason = rec.get("reason", "too few updates")
    attempts = int(rec.get("attempt", 0)) + 1
    msg = f"failed at round {rnd} ({attempts} attempt{'s' if attempts > 1 else ''}): {reason}"
    checked_in = rec.get("checked_in")
    if isinstance(checked_in, int) and checked_in < cfg.clients_per_round:
        msg += (f". Only {checked_in:,} of the {cfg.clients:,} devices checked in for the "
                f"{cfg.clients_per_round:,} wanted: a device checks in when its profile's hourly "
                "availability, its battery and the device policy allow, so a round fills from a "
                "population a few times clients_per_round (raise --clients or lower --clients-per-round)")
    return msg


def run_simulation(cfg: SimulationConfig, progress: Any = None,
                   stop: Callable[[dict[str, Any]], bool] | None = None) -> SimulationReport:
    """Run ``cfg`` to the end; write ``rounds.jsonl``, ``report.json`` and plots under ``cfg.out``.

    ``progress``: a callable ``(round_record) -> None`` called after each round (the CLI
    passes one that drives a rich progress bar); None to stay quiet. ``stop``: a
    predicate on a round's record; the run ends after the first round it accepts
    (e.g. a target accuracy), with status "stopped early".
    """
    problems = simulation_problems({"simulation": cfg.model_dump(mode="python", exclude_none=True)})
    if problems:
        raise ConfigError(problems)
    run = cfg.run_config()
    keep_freed_memory()  # this process and each worker reuse their freed blocks (orchard.heap)
    task = get_task(run.task, **run.task_params)
    if cfg.runtime == "executorch":  # clients train through the task's ExecuTorch program
        from orchard.edge_runtime.et_task import ExecuTorchTask

        task = ExecuTorchTask(task)
    # The global model as a root holds it: read back from its blob, so its tensors (and
    # every round's schema) come in the blob's canonical order, as on the gRPC path.
    arrays = wire.blob_to_arrays(wire.arrays_to_blob(task.initial_arrays(run.seed)))
    population = Population(cfg.clients, cfg.all_profiles(), cfg.devices, cfg.seed,
                            _flops_per_example(task, arrays), cfg.start_hour * 3600.0)
    backend = make_backend(cfg.backend, task, run.task, dict(run.task_params), cfg.clients, run, cfg.workers,
                           cfg.vectorize, cfg.device)
    out: Path | None = cfg.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "rounds.jsonl").write_text("")
    report = SimulationReport(task=run.task, population=cfg.clients, clients_per_round=cfg.clients_per_round,
                              aggregators=cfg.fanout(), codec=run.codec.name,
                              secure_aggregation=run.secure_aggregation.enabled, backend=cfg.backend,
                              vectorized=cfg.vectorize, out=str(out) if out else None)
    engine = Engine(task, population, run, cfg.fanout(), backend, chunk_size=cfg.chunk_size, workers=cfg.workers,
                    governor=cfg.governor, checkin_factor=cfg.checkin_factor, node_timeout_s=cfg.node_timeout_s,
                    aggregator_mbps=cfg.aggregator_mbps, wall_origin=_WALL_ORIGIN, num_partitions=cfg.clients,
                    seed=cfg.seed, attack=cfg.attack, sharded=cfg.shard)
    optimizer = ServerOptimizer(run.server_optimizer, arrays)
    # The same ledger as the root's: noise from the target epsilon for the planned rounds
    # at this population's sampling rate; every attempt charged; the run stops at the budget.
    ledger = PrivacyLedger.plan(run, population=cfg.clients)
    noise_rng = np.random.default_rng([cfg.seed, 0xADA])  # adaptive clipping's count noise (seeded here)
    trained_total, busy_total = 0, 0.0
    ended_early = False  # by the privacy budget or the caller's stop, after a completed round
    try:
        for rnd in range(1, cfg.rounds + 1):
            rec: dict[str, Any] = {}
            for attempt in range(run.cohort.max_retries + 1):
                round_cfg, noise_stddev = run, 0.0
                if ledger is not None:
                    try:
                        ledger.check_next()
                    except PrivacyBudgetExceeded as err:
                        report.status = f"stopped: {err}"
                        rec = {}
                        break
                    round_cfg, noise_stddev = ledger.round_config(run), ledger.noise_stddev
                t0, c0 = time.perf_counter(), time.process_time()
                # Asynchronous mode: a round is one buffer (one model version).
                with cyclic_gc_paused():
                    if run.mode.is_async:
                        rec = engine.buffer(rnd, attempt, arrays, optimizer)
                    else:
                        rec = engine.round(rnd, attempt, arrays, optimizer, round_cfg if ledger else None,
                                           noise_stddev)
                rec["seconds"] = round(time.perf_counter() - t0, 4)
                # CPU time of the whole process (all workers): what to compare on a busy host.
                rec["cpu_seconds"] = round(time.process_time() - c0, 4)
                if ledger is not None:
                    privacy = ledger.charge()
                    adaptive = run.privacy.adaptive
                    if rec["ok"] and adaptive is not None:
                        ledger.adapt(rec["metrics"].get(CLIP_BELOW), rec["participants"], adaptive.target_quantile,
                                     adaptive.learning_rate, noise_rng)
                    rec["privacy"] = privacy
                    report.privacy = ledger.as_dict()
                engine.time.advance_to(engine.time.t + cfg.round_gap_s)
                if rec["ok"]:
                    break
                report.failed_attempts += 1
            if not rec:  # the privacy budget ended the run
                ended_early = True
                break
            if not rec["ok"]:
                report.rounds.append(_public(rec))
                report.status = _failure(rnd, rec, cfg)
                break
            arrays = rec.pop("new_arrays")
            trained_total += rec["trained"]
            busy_total += rec["seconds"]
            rec["clients_per_second"] = round(rec["trained"] / rec["seconds"], 1) if rec["seconds"] > 0 else None
            evaluate = (cfg.evaluate_every and rnd % cfg.evaluate_every == 0) or rnd == cfg.rounds
            rec["accuracy"] = rec["loss"] = None
            if evaluate:
                t0 = time.perf_counter()
                ev = task.evaluate(arrays)
                rec["accuracy"], rec["loss"] = float(ev["accuracy"]), float(ev["loss"])
                rec["eval_seconds"] = round(time.perf_counter() - t0, 4)
            row = _public(rec)
            report.rounds.append(row)
            if out is not None:
                append_round(out / "rounds.jsonl", row)
            if progress is not None:
                progress(row)
            if stop is not None and stop(row):
                report.status = f"stopped early after round {rnd}"
                ended_early = True
                break
    finally:
        backend.close()
        engine.shutdown()
    report.clients_per_second = round(trained_total / busy_total, 1) if busy_total > 0 else 0.0
    report.total_seconds = round(busy_total, 3)
    report.simulated_seconds = round(sum(r.get("simulated_seconds", 0.0) for r in report.rounds), 3)
    last = report.rounds[-1] if report.rounds else None
    if ended_early and last is not None and last.get("accuracy") is None:
        # The run ended before its last planned round: the model it ends with is the last
        # completed round's, tested here as a last round would be.
        ev = task.evaluate(arrays)
        last["accuracy"], last["loss"] = float(ev["accuracy"]), float(ev["loss"])
    done = [r for r in report.rounds if r.get("accuracy") is not None]
    if done:
        report.final_accuracy, report.final_loss = done[-1]["accuracy"], done[-1]["loss"]
    if out is not None:
        write_report(report, out)
    report.final_arrays = arrays
    return report


def _public(rec: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in rec.items() if k not in ("new_arrays", "ok")}
    for k, v in list(row.items()):
        if isinstance(v, float) and not math.isfinite(v):
            row[k] = None
    return row
