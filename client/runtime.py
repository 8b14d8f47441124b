"""The client runtime: join, long-poll, pull the model, train, encode, push.

The runtime knows nothing about what is trained: it calls a :class:`orchard.trainer.Trainer`
(a reference task's trainer, the LoRA trainer, or a Flower ``ClientApp`` through its
adapter). A trainer that fails fails that task only: the error is logged, no update is
sent, and the client goes back to polling.

Updates are deltas ``local - global`` over exactly the tensors the task's schema names,
encoded with the run's codec. Codec state that must live on the device across rounds
(error-feedback residuals, PowerSGD's warm start) is kept per run and, given a
``state_dir``, persisted there.

Given an :class:`~orchard.client.edge.EdgeGovernance` (device, budget policy, clock),
the client is an edge client: it checks in with its device state, waits until the
device is eligible before it polls, trains each task under a governor holding the
policy's per-round budget, and when the governor stops early sends the partial update
(its weight and ``num_steps`` say how much was done) unless not one step ran. After a
stop at the thermal ceiling or battery floor it waits past them before it polls again.
"""


from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchard import wire
from orchard.client.edge import EdgeGovernance
from orchard.client.personal import DevicePersonal
from orchard.client.update import build_upload, delta_of, train_seed
from orchard.compression import apply_model_delta, build_codec
from orchard.compression.update import states_from_bytes, states_to_bytes
from orchard.config import CodecSpec, RunConfig
from orchard.edge_runtime.governor import GovernorReport
from orchard.errors import AuthError, OrchardError
from orchard.files import atomic_write
from orchard.link import FleetLink, UploadRefused
from orchard.messages import Idle, TaskAssignment, UploadHeader
from orchard.trainer import TrainConfig, Trainer, TrainResult, round_config
from orchard.typing import DeviceState, NDArrays

if TYPE_CHECKING:
    from orchard.client.secure import RosterTrust

log = logging.getLogger("orchard.client")

DeviceProvider = Callable[[], DeviceState]


def apply_downlink_delta(base_blob: bytes, delta_blob: bytes, base_hash: str, encoding: str) -> bytes:
    """The model blob rebuilt from the one held and a downlink delta (the link checks its hash)."""
    spec = CodecSpec.model_validate_json(encoding)
    arrays = apply_model_delta(wire.blob_to_arrays(base_blob), wire.blob_to_payloads(delta_blob),
                               from_version=wire.downlink_seed(base_hash), spec=spec)
    return wire.arrays_to_blob(arrays)

TrainerFactory = Callable[[RunConfig], Trainer]


@dataclass
class TaskReport:
    round: int
    accepted: bool
    reason: str = ""
    num_examples: int = 0
    bytes_up: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    num_steps: int = 0
    weight: float = 0.0
    governor: GovernorReport | None = None  # None when no governor ran (not an edge client)


def _secure(t: TaskAssignment) -> bool:
    try:
        return RunConfig.model_validate_json(t.config_json).secure_aggregation.enabled
    except ValueError:
        return False


class ClientRuntime:
    def __init__(self, link: FleetLink, trainer_factory: TrainerFactory, *, partition_id: int = 0,
                 device: DeviceProvider | None = None, state_dir: str | Path | None = None, seed: int = 0,
                 edge: EdgeGovernance | None = None, reproducible_rounding: bool = False) -> None:
        self.link = link
        self._factory = trainer_factory
        self._trainer: Trainer | None = None
        self._trainer_key: str | None = None
        self.partition_id = partition_id
        self.edge = edge
        self.device: DeviceProvider = device or (edge.state if edge is not None else (lambda: DeviceState()))
        self.last_governor: GovernorReport | None = None  # the last task's, for when to resume
        self.state_dir = Path(state_dir) if state_dir else None
        self.personal = DevicePersonal(self.state_dir)
        self.seed = seed
        # Secure aggregation's stochastic rounding from the training seed instead of OS
        # entropy: only for tests that hold a federation to the simulator bit for bit.
        self.reproducible_rounding = reproducible_rounding
        self.reports: list[TaskReport] = []
        self._codec_state: dict[str, dict[str, Any]] = {}
        # Tasks whose secure session failed here: the server still hands them out until it
        # drops this client, but a SecAgg+ session cannot be joined again once left.
        self._lost_secure: set[str] = set()
        self.rosters: RosterTrust | None = None  # the root's signed rosters this device checked, across sessions

    def trainer_for(self, cfg: RunConfig) -> Trainer:
        key = f"{cfg.task}:{sorted(cfg.task_params.items())}"
        if self._trainer is None or self._trainer_key != key:
            self._trainer = self._factory(cfg)
            self._trainer_key = key
        return self._trainer

    async def run(self, max_tasks: int | None = None, stop: asyncio.Event | None = None) -> None:
        """Serve tasks until ``stop`` is set or ``max_tasks`` were done."""
        await self.link.join(self.device())
        done = 0
        while (max_tasks is None or done < max_tasks) and not (stop is not None and stop.is_set()):
            if self.edge is not None and not await self._wait_eligible(self.edge, stop):
                break
            got = await self.link.poll(self.device())
            if isinstance(got, Idle):
                if got.retry_after_s > 0:
                    await asyncio.sleep(got.retry_after_s)
                continue
            if got.task_id in self._lost_secure:
                await asyncio.sleep(min(1.0, self.link.long_poll_s))  # until the round moves on
                continue
            self.reports.append(await self.do_task(got))
            done += 1

    async def _wait_eligible(self, edge: EdgeGovernance, stop: asyncio.Event | None) -> bool:
        """Wait (on the edge clock, in slices) until the device may train; False if stopped."""
        said: list[str] = []
        while not (stop is not None and stop.is_set()):
            decision = await asyncio.to_thread(edge.wait_until_eligible, self.last_governor)
            if decision.eligible:
                return True
            if decision.reasons != said:  # once per change, not once per slice
                said = list(decision.reasons)
                log.info("device not eligible, waiting: %s", "; ".join(said))
        return False

    async def do_task(self, t: TaskAssignment) -> TaskReport:
        # Heartbeats from the task's start until its update is sent (the pull, training,
        # encoding and upload): a tier drops a node silent for its node timeout.
        beat = asyncio.create_task(self._heartbeats(t))
        try:
            return await self._do_task(t)
        except (AuthError, asyncio.CancelledError):
            raise
        except UploadRefused as err:
            log.warning("round %d: update refused: %s", t.round, err)
            return TaskReport(t.round, False, str(err))
        except Exception as err:  # the trainer or the data failed: this task fails, the client lives on
            log.error("round %d: task failed: %s: %s", t.round, type(err).__name__, err)
            if _secure(t):
                self._lost_secure.add(t.task_id)
            return TaskReport(t.round, False, f"{type(err).__name__}: {err}")
        finally:
            beat.cancel()

    async def _do_task(self, t: TaskAssignment) -> TaskReport:
        cfg = RunConfig.model_validate_json(t.config_json)
        # With a downlink delta this is the client's reconstruction of the global model:
        # it trains from it and its update is taken against it (see orchard.server.downlink).
        blob = await self.link.pull_model(t.model_hash, apply_delta=apply_downlink_delta)
        global_arrays = wire.blob_to_arrays(blob)
        trainer = self.trainer_for(cfg)
        seed = train_seed(cfg.seed, t.round, self.partition_id)
        train_cfg = round_config(trainer, dataclasses.replace(cfg.train, seed=seed), t.round)
        loop = asyncio.get_running_loop()
        report: GovernorReport | None = None
        secure, upload = self._start_secure(t, cfg, seed)
        try:
            if self.edge is None:
                result: TrainResult = await loop.run_in_executor(None, trainer.train, global_arrays, train_cfg)
            else:
                governed = await loop.run_in_executor(None, self.edge.train, trainer, global_arrays, train_cfg)
                result, report = governed.result, governed.report
                self.last_governor = report
        except BaseException:
            if secure is not None:
                secure.cancel()
            raise
        if result.num_steps == 0 and report is not None:
            if secure is not None:
                secure.cancel()
            # Nothing was trained: an upload would be the global model back, weight 0.
            why = f"{report.stop_reason.value if report.stop_reason else 'stopped'}: {report.detail}"
            log.info("round %d: the governor stopped before the first step (%s); no update", t.round, why)
            return TaskReport(t.round, False, f"no step done ({why})", metrics=dict(result.metrics),
                              governor=report)
        if report is not None and result.stopped_early:
            log.info("round %d: the governor stopped after %d steps (%s); sending the partial update",
                     t.round, result.num_steps, report.stop_reason.value if report.stop_reason else "")
        if cfg.personalization.enabled:
            # The device's own adapter (orchard.client.personal): trained and kept here, never
            # uploaded; only its evaluation travels, as metrics of the global update.
            extra = await loop.run_in_executor(None, self.personal.round, t.run_id, cfg.personalization, trainer,
                                               global_arrays, train_cfg)
            result = dataclasses.replace(result, metrics={**result.metrics, **extra})
        delta = delta_of(t, global_arrays, result)
        header, payload = await loop.run_in_executor(None, self._encode, t, cfg, train_cfg, delta, result, seed)
        if secure is not None and upload is not None:
            upload.set_result((header, payload))  # only its masked form leaves the device
            await secure
        else:
            await self.link.push_update(header, payload)
        self._save_state(t.run_id)
        return TaskReport(t.round, True, num_examples=result.num_examples, bytes_up=len(payload),
                          metrics=dict(result.metrics), num_steps=header.num_steps, weight=header.weight,
                          governor=report)

    def _start_secure(self, t: TaskAssignment, cfg: RunConfig, seed: int):
        """Start this task's SecAgg+ session, if the run uses one: the key stages overlap training."""
        if not cfg.secure_aggregation.enabled:
            return None, None
        from orchard.client.secure import RosterTrust, secure_session

        if self.rosters is None:
            self.rosters = RosterTrust()
        upload: asyncio.Future[tuple[UploadHeader, bytes]] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(secure_session(self.link, t, cfg, build_codec(cfg.codec), upload, seed,
                                                   self.reproducible_rounding, self.rosters))
        return task, upload

    async def _heartbeats(self, t: TaskAssignment) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.link.heartbeat_s / 2))
            await self.link.heartbeat(t.task_id, self.device())

    def _encode(self, t: TaskAssignment, cfg: RunConfig, train_cfg: TrainConfig, delta: NDArrays,
                result: TrainResult, seed: int) -> tuple[UploadHeader, bytes]:
        states = self._codec_state.get(t.run_id) or self._load_state(t.run_id)
        header, payload, new_states = build_upload(t, cfg, train_cfg, build_codec(cfg.codec), self.link.node_id,
                                                   delta, result, seed, states)
        if new_states:
            self._codec_state[t.run_id] = new_states
        return header, payload

    # ------------------------------------------------------------------ device-side codec state

    def _state_path(self, run_id: str) -> Path | None:
        return None if self.state_dir is None else self.state_dir / f"codec-state-{run_id}.bin"

    def _load_state(self, run_id: str) -> dict[str, Any] | None:
        p = self._state_path(run_id)
        if p is None or not p.is_file():
            return None
        return states_from_bytes(p.read_bytes())

    def _save_state(self, run_id: str) -> None:
        p = self._state_path(run_id)
        st = self._codec_state.get(run_id)
        if p is None or not st:
            return
        atomic_write(p, states_to_bytes(st))  # owner-only: the device's own state


__all__ = ["ClientRuntime", "OrchardError", "TaskReport"]
