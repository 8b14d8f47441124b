"""The root: runs rounds of a run, finalizes, steps the server optimizer, checkpoints.

The root is a :class:`Coordinator` whose round tasks come from a run. The run's rounds
follow ``orchard.server.runloop`` (the loop the simulator runs too); the root plays each
round on its coordinator and records it: after a round closes, the loop steps the
server optimizer, and the root writes the new global model as an atomic safetensors
checkpoint and only then indexes it in the store. A round that misses its minimum
leaves the global model untouched and is retried; a killed root restarts into the last
indexed round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from orchard import wire
from orchard.aggregation.ledger import PrivacyLedger
from orchard.aggregation.server_opt import ServerOptimizer
from orchard.aggregation.staleness import merge_histograms
from orchard.config import RunConfig, ServerConfig, ServerOptimizerConfig, base_model_dir
from orchard.errors import ConfigError, RoundClosedError, StoreError, UpdateSchemaError
from orchard.files import atomic_write
from orchard.server.buffer import BufferState
from orchard.server.charges import Charge, ChargeLog, SQLiteChargeLog
from orchard.server.coordinator import Coordinator
from orchard.server.round import RoundRecord, RoundStatus, root_task
from orchard.server.runloop import Played, RoundPlan, RunState, run_rounds, updates_needed
from orchard.server.store import Store
from orchard.typing import NDArrays, Role, schema_of

T = TypeVar("T")
log = logging.getLogger("orchard.server.root")


def aggregate_path(checkpoint: Path) -> Path:
    """Where a completed round's aggregate lies (``[server] keep_aggregates``): its float64
    sums, ``Σ w·x`` per tensor; the round's record holds the weight ``Σ w`` and the count."""
    return checkpoint.with_suffix(".aggregate.safetensors")


def _dimension(arrays: NDArrays) -> int:
    """The model's coordinates (a client's noise share draws one each)."""
    return sum(int(np.size(v)) for v in arrays.values())


def warm_up() -> None:
    """Build one optimizer at start: torch imports its compiler stack on first use (seconds),
    which would otherwise land inside the first round."""
    ServerOptimizer(ServerOptimizerConfig(), {"w": np.zeros(1, np.float32)}).step({"w": np.zeros(1, np.float32)})


@dataclass
class ActiveRun(RunState):
    """The root's run: the loop's state, the current model as the root serves it (blob
    and sha256), and what the status shows."""

    blob: bytes = b""
    blob_hash: str = ""
    current: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    # Asynchronous mode after a restart: the journaled buffer the next round takes back.
    restore: BufferState | None = None


class RootRunner:
    def __init__(self, coordinator: Coordinator, store: Store, data_dir: Path, server_cfg: ServerConfig,
                 start_grace_s: float = 5.0, base_model: str | Path | None = None) -> None:
        self.coord = coordinator
        # The base model (a directory written by `orchard pretrain`) that runs of a LoRA
        # task adapt unless they name their own; `run start` reads it from the status.
        self.base_model = str(base_model_dir(base_model)) if base_model is not None else None
        self.store = store
        self.data_dir = data_dir
        # Every privacy charge, by population, durable before the round it pays for opens.
        self.charges: ChargeLog = SQLiteChargeLog(data_dir / "privacy-ledger.db")
        # DP-FTRL's participation counts, journaled there whenever the selection records one.
        self.coord.registry.participation.journal = \
            lambda run_id, state: self.charges.save_state(run_id, "participation", state.encode())
        self.server_cfg = server_cfg
        self.start_grace_s = start_grace_s
        self.run: ActiveRun | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def resume(self) -> None:
        """Continue a run that was active when the root stopped (crash or kill -9)."""
        for row in self.store.active_runs():
            ck = self.store.checkpoint(row.run_id)
            if ck is None:
                self.store.set_run_status(row.run_id, "failed", "no checkpoint to resume from")
                continue
            blob = Path(ck.path).read_bytes()
            if wire.sha256_hex(blob) != ck.sha256:
                raise StoreError(f"checkpoint {ck.path} does not match its recorded sha256; refusing to resume")
            self.store.interrupt_open_rounds(row.run_id)
            cfg = RunConfig.model_validate_json(row.config_json)
            arrays = wire.blob_to_arrays(blob)
            opt = ServerOptimizer(cfg.server_optimizer, arrays)
            if ck.optimizer_path and Path(ck.optimizer_path).is_file():
                opt.load_state_bytes(Path(ck.optimizer_path).read_bytes())
            self.run = ActiveRun(row.run_id, cfg, row.config_json, arrays, opt, ck.round,
                                 privacy=self._restore_privacy(row.run_id, cfg, arrays), blob=blob,
                                 blob_hash=ck.sha256)
            if cfg.mode.is_async:
                self.run.restore = self._journaled_buffer(self.run)
                self.coord.journal = self._journal
                # The nodes still training on the buffer's tasks come back to deliver: they
                # count as waiting for work (Registry.register) while the root waits for clients.
                for h in self.run.restore.held if self.run.restore is not None else ():
                    self.coord.registry.register(h.node_id, Role(h.role), h.token_hash)
            if cfg.downlink_delta and ck.round > 0:
                self._remember_base(row.run_id, ck.round - 1)
            log.info("resuming run %s after round %d", row.run_id, ck.round)
            self._task = asyncio.create_task(self._loop(self.run))
            return

    def _restore_privacy(self, run_id: str, cfg: RunConfig, arrays: NDArrays) -> PrivacyLedger | None:
        """The ledger of a resumed run: the same plan, every attempt already opened charged
        (interrupted ones too: their cohort sums may have been released), the clip norm
        the last completed round left, and its mechanism's journal (DP-FTRL: the tree of
        noise, and the participation bound's counts)."""
        ledger = PrivacyLedger.plan(cfg, prior=self._prior(cfg, run_id), dimension=_dimension(arrays))
        if ledger is None:
            return None
        rounds = self.store.rounds(run_id)
        ledger.rounds = max(len(rounds), self.charges.run_rounds(run_id))
        ledger.epsilon = ledger.epsilon_after(ledger.rounds)
        done = [r for r in rounds if r.get("status") == "completed" and r.get("privacy")]
        if done:
            ledger.clip_norm = float(done[-1]["privacy"].get("next_clip_norm", ledger.clip_norm))
        tree = self.charges.state(run_id, "tree")
        ledger.resume(None if tree is None else wire.blob_to_arrays(tree),
                      int(done[-1]["privacy"].get("attempts_charged", 0)) if done else 0,
                      {k: np.shape(v) for k, v in arrays.items()}, self.coord.noise_rng)
        seen = self.charges.state(run_id, "participation")
        if seen is not None:
            self.coord.registry.participation.restore(seen.decode())
        return ledger
    def _journaled_buffer(self, run: ActiveRun) -> BufferState | None:
        """The buffer a killed root had acknowledged updates into (asynchronous mode).

        Buffers of rounds after the last checkpoint are the open one and, if the root died
        while applying a full buffer, the continuation that took uploads meanwhile; both
        are merged into the next round's buffer (the continuation's updates are then
        applied one version early), and that merged state replaces them in one
        transaction, so a second crash finds each update once."""
        rows = [b for b in self.store.buffers(run.run_id) if b.round > run.completed_rounds]
        if not rows:
            return None
        schema = tuple(schema_of(run.arrays))
        states = [BufferState.from_bytes(b.state_json, b.sums, schema) for b in rows]
        merged = states[0]
        for st in states[1:]:
            merged.absorb(st)
        merged.round = run.completed_rounds + 1
        state_json, sums = merged.to_bytes()
        self.store.save_buffer(run.run_id, merged.round, merged.seq, state_json, sums, supersede_later=True)
        log.info("run %s: %d acknowledged updates back in the buffer of round %d", run.run_id,
                 merged.partial.count, merged.round)
        return merged

    def _journal(self, state: BufferState) -> None:
        """Journal an asynchronous buffer before its newest update is acknowledged."""
        run = self.run
        if run is None:
            return
        state_json, sums = state.to_bytes()
        self.store.save_buffer(run.run_id, state.round, state.seq, state_json, sums)

    def _remember_base(self, run_id: str, rnd: int) -> None:
        """Clients that trained in the last completed round hold the model it started from:
        after a restart, keep that model as a downlink-delta base, as ``open_round`` does
        while the root runs, so their first pulls are deltas rather than full models.
        (Reconstructions served before the restart are not kept: those clients pull in full.)"""
        prev = self.store.checkpoint(run_id, rnd)
        if prev is None:
            return
        try:
            blob = Path(prev.path).read_bytes()
        except OSError as err:
            log.warning("no downlink base after restart: checkpoint %s unreadable (%s)", prev.path, err)
            return
        if wire.sha256_hex(blob) != prev.sha256:
            log.warning("no downlink base after restart: checkpoint %s does not match its sha256", prev.path)
            return
        self.coord.downlink.remember(prev.sha256, blob)

    async def start_run(self, config: RunConfig, initial_blob: bytes) -> str:
        if self.run is not None and self._task is not None and not self._task.done():
            raise ConfigError(f"run {self.run.run_id} is still running; stop it first (`orchard run stop`)")
        arrays = wire.blob_to_arrays(initial_blob)
        if not arrays:
            raise UpdateSchemaError("the initial model holds no tensors")
        for k, v in arrays.items():
            if v.dtype != np.float32:
                raise UpdateSchemaError(f"initial tensor {k!r} is {v.dtype}; the global model must be float32")
            if not np.isfinite(v).all():
                raise UpdateSchemaError(f"initial tensor {k!r} holds NaN or Inf")
        # Refuses a run whose noise cannot meet its target, or its population's lifetime budget.
        privacy = PrivacyLedger.plan(config, prior=self._prior(config), dimension=_dimension(arrays))
        run_id = time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        config_json = config.model_dump_json()
        self.store.create_run(run_id, config_json)
        path = self._ckpt_path(run_id, 0)
        atomic_write(path, initial_blob)
        h = wire.sha256_hex(initial_blob)
        self.store.index_checkpoint(run_id, 0, str(path), h)
        opt = ServerOptimizer(config.server_optimizer, arrays)
        self.run = ActiveRun(run_id, config, config_json, arrays, opt, 0, privacy=privacy, blob=initial_blob,
                             blob_hash=h)
        self.coord.journal = self._journal if config.mode.is_async else None
        self._task = asyncio.create_task(self._loop(self.run))
        return run_id

    def stop_run(self, run_id: str) -> bool:
        r = self.run
        if r is None or (run_id and r.run_id != run_id) or self._task is None or self._task.done():
            return False  # no such run, or it has ended: nothing was stopped
        r.stop_requested = True
        if self.coord.current is not None:
            self.coord.close_round(self.coord.current, "run stopped by operator")
        self._wake.set()
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def _ckpt_path(self, run_id: str, rnd: int) -> Path:
        return self.data_dir / "checkpoints" / run_id / f"round-{rnd:06d}.safetensors"

    # ------------------------------------------------------------------ the run loop

    async def _loop(self, run: ActiveRun) -> None:
        """The run's rounds (``orchard.server.runloop``), this root playing them and
        recording them in its store; a failure is recorded, never crashes the server."""
        try:
            await run_rounds(run, self, self, self.coord.noise_rng)
            self.store.set_run_status(run.run_id, run.status, run.reason)
            if run.status == "failed":
                log.error("run %s failed: %s (never reached its minimum)", run.run_id, run.reason)
            else:
                log.info("run %s %s after %d rounds%s", run.run_id, run.status, run.completed_rounds,
                         f": {run.reason}" if run.reason else "")
        except asyncio.CancelledError:
            raise
        except Exception as err:  # record, never crash the server
            log.exception("run %s failed", run.run_id)
            self.store.set_run_status(run.run_id, "failed", f"{type(err).__name__}: {err}")
        finally:
            run.current = None
            # An asynchronous run leaves the continuation of its last buffer open (it refuses
            # what comes). Closed, this tier answers "no round open", which is how an
            # aggregator learns the run is over: it then closes its own continuation and
            # reports what that took as dropped. Left open, it would hear "not selected" and
            # hold those acknowledged uploads, unreported, until the next run.
            cur = self.coord.current
            if cur is not None and cur.task.run_id == run.run_id:
                self.coord.close_round(cur, "run over")

    async def _wait_capacity(self, run: ActiveRun) -> None:
        cfg = run.config
        need_min = updates_needed(cfg)
        waited_from = time.monotonic()
        while not run.stop_requested:
            _, eligible = self.coord.capacity(cfg)
            if eligible >= cfg.buffer_target:
                return
            if eligible >= need_min and time.monotonic() - waited_from >= self.start_grace_s:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)

    # ------------------------------------------------------------------ the loop's backend and sink

    async def play(self, state: RunState, plan: RoundPlan) -> Played | None:
        """Open the attempt on this tier once enough clients are below it; its outcome."""
        run = self.run
        assert run is state and run is not None
        run.current = {"round": plan.round, "attempt": plan.attempt, "phase": "waiting for clients"}
        await self._wait_capacity(run)
        if run.stop_requested:
            return None
        if plan.config.privacy.bounds_participation and any(
                c.role is Role.AGGREGATOR for c in self.coord.children.values()):
            # An aggregator's counts are in its memory only, and a device may join another.
            raise ConfigError("privacy.mode 'dpftrl' needs its clients directly under the root, which journals "
                              "the participation bound; this root has aggregators below it: run DP-FTRL on a "
                              "flat federation, or use privacy.mode 'central'")
        started = time.time()
        task = root_task(run.run_id, plan.round, plan.attempt, plan.config, plan.config_json, run.arrays, run.blob,
                         run.blob_hash, started, plan.noise_stddev)
        restore = None
        if run.restore is not None and run.restore.round == plan.round:
            restore, run.restore = run.restore, None
        cr = self.coord.open_round(task, restore=restore)
        if plan.config.privacy.bounds_participation:
            # Journaled before any selected device can take its task (no await between).
            self.coord.registry.participation.flush()
        run.current = {"round": plan.round, "attempt": plan.attempt, "phase": "training", "cohort": cr}
        self.store.record_round(run.run_id, plan.round, plan.attempt, "running", started, None,
                                {"selected": len(cr.assignments)})
        return Played(await self.coord.wait_round(cr), started=started)

    def offload(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _prior(self, cfg: RunConfig, run_id: str = "") -> tuple[tuple[float, int], ...]:
        """Earlier runs' charges on this run's population (none without DP)."""
        p = cfg.privacy
        return self.charges.prior(p.population_ledger, p.adjacency, run_id) if p.enabled else ()

    def charged(self, state: RunState, plan: RoundPlan) -> None:
        ledger = state.privacy
        assert ledger is not None
        self.charges.record(Charge(state.config.privacy.population_ledger, state.run_id, plan.round, plan.attempt,
                                   ledger.charge_multiplier, ledger.adjacency))
        snapshot = ledger.snapshot()
        if snapshot is not None:  # DP-FTRL: the tree with this attempt's leaf, before it opens
            self.charges.save_state(state.run_id, "tree", wire.arrays_to_blob(snapshot))

    def first_attempt(self, state: RunState, rnd: int) -> int:
        return self.store.attempts(state.run_id, rnd)  # > 0 after a restart mid-round

    async def failed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played) -> None:
        self.store.record_round(state.run_id, plan.round, plan.attempt, record.status.value, played.started,
                                time.time(), record.as_dict())
        if record.status is RoundStatus.FAILED:
            log.warning("round %d attempt %d failed: %s", plan.round, plan.attempt, record.reason)

    async def completed(self, state: RunState, plan: RoundPlan, record: RoundRecord, played: Played,
                        new_arrays: NDArrays) -> None:
        """Write the new global model as an atomic checkpoint (and the optimizer's state),
        then index it: a killed root restarts into the last indexed round."""
        run = self.run
        assert run is state and run is not None
        blob = await self.offload(wire.arrays_to_blob, new_arrays)
        path = self._ckpt_path(run.run_id, plan.round)
        opt_path = path.with_suffix(".optim.pt")
        opt_bytes = run.optimizer.state_bytes()
        await self.offload(atomic_write, path, blob)
        await self.offload(atomic_write, opt_path, opt_bytes)
        if self.server_cfg.keep_aggregates:  # before the index: an indexed round has its aggregate
            sums = played.outcome.partial.sums
            await self.offload(atomic_write, aggregate_path(path), await self.offload(wire.arrays_to_blob, sums))
        h = wire.sha256_hex(blob)
        self.store.complete_round(run.run_id, plan.round, plan.attempt, played.started, record.as_dict(), str(path),
                                  h, str(opt_path))
        run.blob, run.blob_hash = blob, h
        log.info("round %d done: %d updates, metrics %s", plan.round, record.participants,
                 {k: round(v, 4) for k, v in record.metrics.items()})

    # ------------------------------------------------------------------ status

    def status(self, run_id: str = "") -> dict[str, Any]:
        row = self.store.get_run(run_id) if run_id else self.store.latest_run()
        if row is None:
            if run_id:
                raise RoundClosedError(f"no run {run_id!r} on this server")
            return {"run_id": None, "status": "idle", "completed_rounds": 0, "rounds": [], "nodes": self.nodes_summary(),
                    "base_model": self.base_model}
        cfg = json.loads(row.config_json)
        rounds = [r for r in self.store.rounds(row.run_id)
                  if r["status"] in ("completed", "failed", "stopped", "interrupted")]
        out: dict[str, Any] = {
            "run_id": row.run_id, "status": row.status, "error": row.error, "task": cfg.get("task"),
            "target_rounds": cfg.get("rounds"), "completed_rounds": row.completed_rounds,
            "codec": cfg.get("codec", {}).get("name"),
            "secure_aggregation": cfg.get("secure_aggregation", {}).get("enabled", False),
            "rounds": rounds, "nodes": self.nodes_summary(),
            "bytes_up_total": sum(r.get("bytes_up", 0) for r in rounds),
            "bytes_down_total": sum(r.get("bytes_down", 0) for r in rounds),
            "base_model": self.base_model,
        }
        r = self.run
        if r is not None and r.run_id == row.run_id and r.privacy is not None:
            out["privacy"] = r.privacy.as_dict()
        elif cfg.get("privacy", {}).get("mode", "off") != "off":
            charged = [x["privacy"] for x in rounds if x.get("privacy")]
            # The last charge's delta includes what clamped noise shares add (distributed DP).
            delta = charged[-1].get("delta", cfg["privacy"]["delta"]) if charged else cfg["privacy"]["delta"]
            out["privacy"] = {"mode": cfg["privacy"]["mode"], "delta": delta,
                              "target_epsilon": cfg["privacy"].get("target_epsilon"),
                              "epsilon": charged[-1]["epsilon"] if charged else 0.0}
        if r is not None and r.run_id == row.run_id and r.current is not None:
            cur = {k: v for k, v in r.current.items() if k != "cohort"}
            cr = r.current.get("cohort")
            if cr is not None:
                cur.update(selected=len(cr.assignments), received=cr.received, target=cr.task.target,
                           deadline_in_s=round(cr.task.deadline_unix - time.time(), 1))
            out["current_round"] = cur
        if cfg.get("mode", {}).get("kind") == "async":
            out.update(self._async_status(row.run_id, row.completed_rounds, rounds))
        return out

    def _async_status(self, run_id: str, version: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
        """Model version, the open buffer's fill and the staleness of every update applied
        or buffered so far (asynchronous mode)."""
        hist: dict[int, int] = {}
        for r in rounds:
            if r["status"] == "completed":
                hist = merge_histograms(hist, {int(k): v for k, v in r.get("staleness", {}).items()})
        buf: dict[str, Any] = {}
        cr = self.coord.current
        if self.run is not None and self.run.run_id == run_id and cr is not None and cr.task.run_id == run_id:
            buf = {"fill": cr.received, "size": cr.task.target, "serving_version": cr.task.round - 1,
                   "staleness": {str(k): v for k, v in sorted(dict(cr.staleness).items())}}
            hist = merge_histograms(hist, dict(cr.staleness))
        return {"mode": "async", "model_version": version, "buffer": buf,
                "staleness_histogram": {str(k): v for k, v in hist.items()}}

    def nodes_summary(self) -> dict[str, int]:
        clients = sum(1 for c in self.coord.children.values() if c.role.value == "client" and self.coord.live(c))
        aggs = [c for c in self.coord.children.values() if c.role.value == "aggregator" and self.coord.live(c)]
        size, _ = self.coord.capacity()
        return {"direct_clients": clients, "aggregators": len(aggs), "clients_total": size}

    def global_blob(self, run_id: str, rnd: int) -> bytes:
        row = self.store.get_run(run_id) if run_id else self.store.latest_run()
        if row is None:
            raise RoundClosedError("no run on this server")
        ck = self.store.checkpoint(row.run_id, None if rnd < 0 else rnd)
        if ck is None:
            raise RoundClosedError(f"run {row.run_id} has no checkpoint for round {rnd}")
        return Path(ck.path).read_bytes()
