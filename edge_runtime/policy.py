"""Budget policy: when a device may train, and how much one round may cost it.

Pure functions of a :class:`~orchard.typing.DeviceState` and a time; no sensors, no
clocks, no sleeping (those are in ``device.py`` and ``governor.py``).

Eligibility (:func:`check_eligibility`) is the device-side twin of the server's
``orchard.config.EligibilityConfig`` check: on external power or above a battery
floor, under a temperature ceiling, on an unmetered network, idle, and optionally
inside a daily window (e.g. 01:00-06:00, when phones charge overnight). It returns
*every* reason a device is not eligible, not just the first, so a client can report
them all at check-in.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchard.config import EligibilityConfig
from orchard.typing import DeviceState


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Reason(str):
    """A human-readable reason with a stable machine ``code``.

    It is a ``str``, so ``reasons`` print and serialise as plain text; ``code`` (one of
    ``power``, ``battery``, ``thermal``, ``network``, ``idle``, ``window``) lets the
    client runtime decide what to wait for without parsing messages.
    """

    code: str

    def __new__(cls, code: str, message: str) -> Reason:
        obj = super().__new__(cls, f"{code}: {message}")
        obj.code = code
        return obj


class EligibilityDecision(NamedTuple):
    eligible: bool
    reasons: list[Reason]


def _parse_hhmm(text: str) -> int:
    hh, sep, mm = text.partition(":")
    if not sep or not (hh.isdigit() and mm.isdigit()):
        raise ValueError(f"expected HH:MM, got {text!r}")
    h, m = int(hh), int(mm)
    if not (0 <= h <= 23 and 0 <= m <= 59):
        raise ValueError(f"expected HH:MM with HH in 00..23 and MM in 00..59, got {text!r}")
    return 60 * h + m


class DailyWindow(_Strict):
    """A daily time-of-day window ``[start, end)``, in ``tz`` (None: the host's local
    zone). ``end`` before ``start`` wraps past midnight (``"23:00"``-``"06:00"``);
    ``start == end`` means all day."""

    start: str = "00:00"
    end: str = "00:00"
    tz: str | None = None

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        _parse_hhmm(v)
        return v

    @field_validator("tz")
    @classmethod
    def _zone(cls, v: str | None) -> str | None:
        if v is not None:
            _zone(v)
        return v

    def _tzinfo(self) -> tzinfo | None:
        return None if self.tz is None else _zone(self.tz)

    def _local(self, wall_s: float) -> datetime:
        tz = self._tzinfo()
        if tz is None:
            return datetime.fromtimestamp(wall_s).astimezone()
        return datetime.fromtimestamp(wall_s, tz)

    def contains(self, wall_s: float) -> bool:
        start, end = _parse_hhmm(self.start), _parse_hhmm(self.end)
        if start == end:
            return True
        local = self._local(wall_s)
        minute = local.hour * 60 + local.minute
        if start < end:
            return start <= minute < end
        return minute >= start or minute < end

    def next_start(self, wall_s: float) -> float:
        """The earliest time >= ``wall_s`` inside the window (``wall_s`` itself if inside)."""
        if self.contains(wall_s):
            return wall_s
        local = self._local(wall_s)
        start = _parse_hhmm(self.start)
        candidate = local.replace(hour=start // 60, minute=start % 60, second=0, microsecond=0)
        if candidate.timestamp() <= wall_s:
            candidate = candidate + timedelta(days=1)
        return candidate.timestamp()


def _zone(name: str) -> tzinfo:
    if name.upper() == "UTC":
        return UTC
    if name.startswith(("+", "-")):  # "+05:30": a fixed offset, no tz database needed
        sign = -1 if name[0] == "-" else 1
        return timezone(sign * timedelta(minutes=_parse_hhmm(name[1:])))
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as err:
        raise ValueError(
            f"unknown time zone {name!r}: use an IANA name, 'UTC' or an offset like '+05:30'"
        ) from err


class RoundBudget(_Strict):
    """What one round may cost the device. None means unbounded.

    ``energy_j`` counts everything the device draws while the governor runs (steps and
    throttling pauses), in joules; ``time_s`` is wall time from the first step,
    including pauses.
    """

    energy_j: float | None = Field(default=None, gt=0.0)
    time_s: float | None = Field(default=None, gt=0.0)
    max_steps: int | None = Field(default=None, ge=1)


class PacingConfig(_Strict):
    """How the governor paces training near its thermal ceiling.

    ``hard_ceiling_c`` None uses the eligibility ceiling. Below
    ``hard_ceiling_c - throttle_band_c`` the duty cycle is 1 (no pauses); across the
    band it falls linearly to ``min_duty``. ``prior_rise_c`` and
    ``prior_drop_percent`` are the assumed cost of the first step before any has been
    measured; after that, the governor predicts each step from the ones it observed,
    times ``safety_factor``.
    """

    hard_ceiling_c: float | None = None
    throttle_band_c: float = Field(default=5.0, gt=0.0)
    min_duty: float = Field(default=0.1, gt=0.0, le=1.0)
    cooldown_quantum_s: float = Field(default=1.0, gt=0.0)
    max_cooldown_s: float = Field(default=300.0, ge=0.0)
    prior_rise_c: float = Field(default=1.0, ge=0.0)
    prior_drop_percent: float = Field(default=1.0, ge=0.0)
    safety_factor: float = Field(default=1.25, ge=1.0)
    history: int = Field(default=16, ge=1)  # steps the per-step estimates look back over
    joules_per_unit: float | None = Field(default=None, gt=0.0)  # energy estimate without a counter
    # The temperature sensor as its maker states it: the reading is the hot spot as it
    # was up to ``sensor_lag_s`` ago, within ``sensor_noise_c`` either way. The governor
    # keeps the margin these leave (pacing.sensor_margin).
    sensor_lag_s: float = Field(default=0.0, ge=0.0, le=600.0)
    sensor_noise_c: float = Field(default=0.0, ge=0.0, le=10.0)


class ReplayPolicy(_Strict):
    """The device's replay buffer: at most ``budget_bytes`` on disk and in memory
    together, ``hot_samples`` of them waiting in memory (orchard.client.replay)."""

    budget_bytes: int = Field(gt=0)
    hot_samples: int = Field(4, ge=1)


class DevicePolicy(_Strict):
    """Everything a device decides on its own: eligibility, window, budget, pacing, and
    the storage its replay buffer may take (None: no buffer)."""

    eligibility: EligibilityConfig = Field(default_factory=EligibilityConfig)
    window: DailyWindow | None = None
    budget: RoundBudget = Field(default_factory=RoundBudget)
    pacing: PacingConfig = Field(default_factory=PacingConfig)
    replay: ReplayPolicy | None = None

    @property
    def hard_ceiling_c(self) -> float:
        h = self.pacing.hard_ceiling_c
        return self.eligibility.max_temperature_c if h is None else h

    @property
    def battery_floor_percent(self) -> float:
        return self.eligibility.min_battery_percent


def check_eligibility(
    state: DeviceState,
    eligibility: EligibilityConfig,
    wall_s: float | None = None,
    window: DailyWindow | None = None,
) -> EligibilityDecision:
    """Is the device eligible to train now? Returns every failed rule.

    Unknowns: no battery reading means a mains-powered device (eligible on power); no
    temperature reading passes (there is no sensor to respect); an unknown network or
    idleness fails a rule that requires it (we cannot promise what we cannot see).
    """
    reasons: list[Reason] = []
    e = eligibility
    on_power = state.charging is True
    if state.battery_percent is not None and not on_power:
        if not e.allow_on_battery:
            reasons.append(Reason("power", "not on external power and allow_on_battery is false"))
        elif state.battery_percent < e.min_battery_percent:
            reasons.append(
                Reason(
                    "battery",
                    f"battery {state.battery_percent:.1f}% is below the floor "
                    f"{e.min_battery_percent:.1f}% and the device is not charging",
                )
            )
    if state.temperature_c is not None and state.temperature_c >= e.max_temperature_c:
        reasons.append(
            Reason(
                "thermal",
                f"temperature {state.temperature_c:.1f} °C is at or above the ceiling "
                f"{e.max_temperature_c:.1f} °C",
            )
        )
    if e.require_unmetered and state.unmetered_network is not True:
        what = "unknown" if state.unmetered_network is None else "metered"
        reasons.append(Reason("network", f"network is {what} and an unmetered one is required"))
    if e.require_idle and state.idle is not True:
        what = "unknown" if state.idle is None else "in use"
        reasons.append(Reason("idle", f"device is {what} and idleness is required"))
    if window is not None:
        if wall_s is None:
            raise ValueError("a daily window needs the current wall time (wall_s)")
        if not window.contains(wall_s):
            reasons.append(
                Reason("window", f"outside the daily window {window.start}-{window.end}")
            )
    return EligibilityDecision(not reasons, reasons)


def evaluate(state: DeviceState, policy: DevicePolicy, wall_s: float) -> EligibilityDecision:
    """:func:`check_eligibility` with a whole :class:`DevicePolicy`."""
    return check_eligibility(state, policy.eligibility, wall_s, policy.window)


def next_eligible_time(state: DeviceState, policy: DevicePolicy, wall_s: float) -> float | None:
    """When this device may next train, if that can be known from the clock alone.

    ``wall_s`` when it is eligible now; the start of the next daily window when the
    window is the only thing in the way; None when it waits on the device (charge,
    cooling, network, the user), which the client runtime must poll for.
    """
    decision = evaluate(state, policy, wall_s)
    if decision.eligible:
        return wall_s
    if policy.window is not None and all(r.code == "window" for r in decision.reasons):
        return policy.window.next_start(wall_s)
    return None
