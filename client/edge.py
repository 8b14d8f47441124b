"""What makes a client an edge client: its device, its budget policy and its clock
(ARCHITECTURE section 4).

:class:`EdgeGovernance` is handed to :class:`~orchard.client.runtime.ClientRuntime`. The
runtime then reports the device's state at check-in, waits until the device is
eligible before it polls for work, trains every task under a fresh
:class:`~orchard.edge_runtime.governor.Governor` holding the policy's per-round budget,
and sends what was done when the governor stops early. A device that stopped at its
thermal ceiling or battery floor waits for a margin past it before polling again, so
it resumes in its next eligible window instead of stopping again at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchard.edge_runtime.clock import Clock, RealClock
from orchard.edge_runtime.device import DeviceStateProvider
from orchard.edge_runtime.governed import GovernedResult, SerializedDevice, governed_train
from orchard.edge_runtime.governor import Governor, GovernorReport, StopReason, wait_until_eligible
from orchard.edge_runtime.policy import DevicePolicy, EligibilityDecision
from orchard.errors import ConfigError
from orchard.trainer import TrainConfig, Trainer
from orchard.typing import DeviceState, NDArrays


@dataclass
class EdgeGovernance:
    """A client's device, budget policy and clock.

    ``simulated`` charges each training step's work to the provider (a
    :class:`~orchard.edge_runtime.device.SimulatedDevice`): a real trainer then drains a
    simulated battery. ``wait_slice_s`` bounds one blocking eligibility wait, so the
    runtime notices a stop request at least that often (any value on a virtual clock).
    ``resume_margin_c`` (default: the pacing throttle band) and
    ``resume_battery_margin_percent`` are how far past the ceiling or the floor a device
    that stopped there must get before it polls again.
    """

    provider: DeviceStateProvider
    policy: DevicePolicy = field(default_factory=DevicePolicy)
    clock: Clock = field(default_factory=RealClock)
    simulated: bool = False
    poll_s: float = 60.0
    wait_slice_s: float = 1.0
    resume_margin_c: float | None = None
    resume_battery_margin_percent: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if self.poll_s <= 0 or self.wait_slice_s <= 0:
            problems.append(f"poll_s and wait_slice_s must be > 0, got {self.poll_s}, {self.wait_slice_s}")
        if self.simulated and not hasattr(self.provider, "work"):
            problems.append(f"simulated=True needs a provider that takes work; {type(self.provider).__name__} does not")
        if problems:
            raise ConfigError(problems)
        # Heartbeats read the device on the event loop while training reads it in an
        # executor thread; a simulated device integrates its state on every read.
        self.device = SerializedDevice(self.provider)

    def state(self) -> DeviceState:
        return self.device.read()

    def resume_policy(self, last: GovernorReport | None) -> DevicePolicy:
        """The policy to wait on after ``last``: stricter by a margin past whatever stopped it."""
        if last is None or last.stop_reason not in (StopReason.THERMAL_CEILING, StopReason.BATTERY_FLOOR):
            return self.policy
        e = self.policy.eligibility
        if last.stop_reason is StopReason.THERMAL_CEILING:
            margin = self.policy.pacing.throttle_band_c if self.resume_margin_c is None else self.resume_margin_c
            e = e.model_copy(update={"max_temperature_c": min(e.max_temperature_c, self.policy.hard_ceiling_c) - margin})
        else:
            floor = min(e.min_battery_percent + self.resume_battery_margin_percent, 100.0)
            e = e.model_copy(update={"min_battery_percent": floor})
        return self.policy.model_copy(update={"eligibility": e})

    def wait_until_eligible(self, last: GovernorReport | None) -> EligibilityDecision:
        """Block on the clock for at most ``wait_slice_s``; eligible or not, say which."""
        return wait_until_eligible(self.device, self.resume_policy(last), self.clock, poll_s=self.poll_s,
                                   timeout_s=self.wait_slice_s)

    def governor(self) -> Governor:
        """A fresh governor for one task: the policy's per-round budget starts full."""
        return Governor(self.device, self.policy, self.clock)

    def train(self, trainer: Trainer, arrays: NDArrays, config: TrainConfig) -> GovernedResult:
        return governed_train(trainer, arrays, config, self.governor(),
                              load=self.device if self.simulated else None)
