"""``run_simulation``: the recipe. Validate, build the task, the population, the tree and
the backend, run the rounds, write what happened."""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from orchard import wire
from orchard.aggregation import ServerOptimizer
from orchard.aggregation.ledger import PrivacyLedger
from orchard.errors import ConfigError
from orchard.heap import keep_freed_memory
from orchard.server.coordinator import run_inline
from orchard.server.round import RoundRecord
from orchard.server.runloop import Played, RoundPlan, RunState, run_rounds
from orchard.simulation.backends import make_backend
from orchard.simulation.config import SimulationConfig, simulation_problems
from orchard.simulation.engine import Engine
from orchard.simulation.gcpause import cyclic_gc_paused
from orchard.simulation.population import Population
from orchard.simulation.report import SimulationReport, append_round, write_report
from orchard.tasks import get_task
from orchard.typing import NDArrays

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


def _device_root(out: Path | None) -> tuple[Path, bool]:
    """Where simulated devices keep their own files (replay buffers, personal adapters):
    under the run's output, else a temporary directory the run removes when it ends
    (the second value: whether it is one)."""
    if out is not None:
        return Path(out) / "devices", False
    import tempfile

    return Path(tempfile.mkdtemp(prefix="orchard-devices-")), True


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
    # Each device's own files (a replay buffer, a personal adapter), where a run keeps any.
    device_root, temporary = (_device_root(cfg.out) if run.continual is not None or run.personalization.enabled
                              else (None, False))
    if run.continual is not None:  # each device's data a stream, its replay buffer in its own directory
        from orchard.tasks.stream import StreamingTask

        task = StreamingTask(task, run.continual, cast(Path, device_root))
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
                    seed=cfg.seed, attack=cfg.attack, sharded=cfg.shard,
                    device_root=None if device_root is None else str(device_root))
    # The same loop and ledger as the root's (orchard.server.runloop): noise from the target
    # epsilon for the planned rounds, every device in every round (DP-FTRL: under the
    # participation bound); every attempt charged; the run stops at the budget.
    state = RunState(run_id=engine.run_id, config=run, config_json=run.model_dump_json(), arrays=arrays,
                     optimizer=ServerOptimizer(run.server_optimizer, arrays),
                     privacy=PrivacyLedger.plan(run, population=cfg.clients,
                                                dimension=sum(int(np.size(v)) for v in arrays.values())))
    rounds = _SimulatedRounds(cfg, engine, task, report, progress, stop)
    noise_rng = np.random.default_rng([cfg.seed, 0xADA])  # adaptive clipping's count noise (seeded here)
    try:
        run_inline(run_rounds(state, rounds, rounds, noise_rng))
        report.canary_folds = engine.jobs.canaries
        placement = getattr(backend, "placement", None)  # a cluster's backend says where jobs ran
        if placement is not None:
            report.placement = placement()
    finally:
        backend.close()
        engine.shutdown()
    arrays = state.arrays
    ended_early = state.status == "stopped"  # by the privacy budget or the caller's stop
    if state.status == "failed":
        assert rounds.last_failed is not None
        report.rounds.append(_public(rounds.last_failed))
        report.status = _failure(state.completed_rounds + 1, rounds.last_failed, cfg)
    elif state.status == "stopped":
        report.status = f"stopped: {state.reason}" if state.reason else \
            f"stopped early after round {state.completed_rounds}"
    trained_total, busy_total = rounds.trained_total, rounds.busy_total
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
    if run.personalization.enabled and done:
        from orchard.simulation.personal import report_entry

        report.personalization = report_entry(task, cfg.clients, run, arrays, state.completed_rounds,
                                              device_root, engine.run_id)
    if temporary and device_root is not None:
        shutil.rmtree(device_root, ignore_errors=True)
    if out is not None:
        write_report(report, out)
    report.final_arrays = arrays
    return report


class _SimulatedRounds:
    """The simulator as the run loop's backend (rounds played on the engine, in virtual
    time) and sink (the report, ``rounds.jsonl``, evaluation, progress)."""

    def __init__(self, cfg: SimulationConfig, engine: Engine, task: Any, report: SimulationReport,
                 progress: Any, stop: Callable[[dict[str, Any]], bool] | None) -> None:
        self.cfg, self.engine, self.task, self.report = cfg, engine, task, report
        self.progress, self.stop = progress, stop
        self.trained_total, self.busy_total = 0, 0.0
        self.last_failed: dict[str, Any] | None = None
        self._cpu0 = 0.0  # process CPU time when the attempt being recorded began

    async def play(self, state: RunState, plan: RoundPlan) -> Played:
        t0, c0 = time.perf_counter(), time.process_time()
        config = plan.config if plan.private else None
        with cyclic_gc_paused():
            if state.config.mode.is_async:  # a round is one buffer (one model version)
                played = self.engine.buffer(plan.round, plan.attempt, state.arrays, config, plan.noise_stddev)
            else:
                played = self.engine.round(plan.round, plan.attempt, state.arrays, config, plan.noise_stddev)
        played.started, self._cpu0 = t0, c0
        self.engine.time.advance_to(self.engine.time.t + self.cfg.round_gap_s)
        return played

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)  # on this thread: the simulator's loop never waits

    def charged(self, state: RunState, plan: RoundPlan) -> None:
        """Simulated devices are this simulation's own: no earlier run touched them, and
        the ledger in ``state`` holds every charge."""

    def first_attempt(self, state: RunState, rnd: int) -> int:
        return 0

    def _row(self, state: RunState, record: RoundRecord, played: Played) -> dict[str, Any]:
        rec = {**record.as_dict(), **played.extra}
        # The round's wall time: the engine's round and the server step.
        rec["seconds"] = round(time.perf_counter() - played.started, 4)
        # CPU time of the whole process (all workers): what to compare on a busy host.
        rec["cpu_seconds"] = round(time.process_time() - self._cpu0, 4)
        if state.privacy is not None:
            self.report.privacy = state.privacy.as_dict()
        return rec

    async def failed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played) -> None:
        self.last_failed = self._row(state, record, played)
        self.report.failed_attempts += 1

    async def completed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played,
                        new_arrays: NDArrays) -> None:
        rec = self._row(state, record, played)
        self.trained_total += rec["trained"]
        self.busy_total += rec["seconds"]
        rec["clients_per_second"] = round(rec["trained"] / rec["seconds"], 1) if rec["seconds"] > 0 else None
        cfg, rnd = self.cfg, plan.round
        evaluate = (cfg.evaluate_every and rnd % cfg.evaluate_every == 0) or rnd == cfg.rounds
        rec["accuracy"] = rec["loss"] = None
        if evaluate:
            t0 = time.perf_counter()
            ev = self.task.evaluate(new_arrays)
            rec["accuracy"], rec["loss"] = float(ev["accuracy"]), float(ev["loss"])
            # A streaming task also scores each period's classes (orchard.tasks.stream).
            rec.update({k: float(v) for k, v in ev.items() if k.startswith("accuracy_period_")})
            rec["eval_seconds"] = round(time.perf_counter() - t0, 4)
        row = _public(rec)
        self.report.rounds.append(row)
        if cfg.out is not None:
            append_round(cfg.out / "rounds.jsonl", row)
        if self.progress is not None:
            self.progress(row)
        if self.stop is not None and self.stop(row):
            state.stop_requested = True


def _public(rec: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in rec.items() if k not in ("new_arrays", "ok")}
    for k, v in list(row.items()):
        if isinstance(v, float) and not math.isfinite(v):
            row[k] = None
    return row
