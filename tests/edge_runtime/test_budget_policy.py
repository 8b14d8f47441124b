"""Eligibility rules, daily windows and when a device may next train."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from orchard.config import EligibilityConfig
from orchard.edge_runtime.policy import (
    DailyWindow,
    DevicePolicy,
    check_eligibility,
    evaluate,
    next_eligible_time,
)
from orchard.typing import DeviceState

GOOD = DeviceState(
    battery_percent=80.0, charging=False, temperature_c=30.0, unmetered_network=True, idle=True
)


def _at(hour: int, minute: int = 0) -> float:
    return datetime(2026, 3, 10, hour, minute, tzinfo=UTC).timestamp()


def test_good_device_is_eligible() -> None:
    eligible, reasons = check_eligibility(
        GOOD, EligibilityConfig(require_unmetered=True, require_idle=True)
    )
    assert eligible and reasons == []


def test_every_failed_rule_is_reported() -> None:
    bad = DeviceState(
        battery_percent=10.0, charging=False, temperature_c=50.0, unmetered_network=False, idle=None
    )
    cfg = EligibilityConfig(
        min_battery_percent=20, max_temperature_c=45, require_unmetered=True, require_idle=True
    )
    eligible, reasons = check_eligibility(bad, cfg)
    assert not eligible
    assert [r.code for r in reasons] == ["battery", "thermal", "network", "idle"]
    assert "10.0%" in reasons[0] and "metered" in reasons[2] and "unknown" in reasons[3]


def test_charging_beats_the_battery_floor_and_unknown_battery_is_mains() -> None:
    cfg = EligibilityConfig(min_battery_percent=20)
    assert check_eligibility(DeviceState(battery_percent=5.0, charging=True), cfg).eligible
    assert check_eligibility(DeviceState(battery_percent=None), cfg).eligible
    on_battery = check_eligibility(GOOD, EligibilityConfig(allow_on_battery=False))
    assert [r.code for r in on_battery.reasons] == ["power"]


def test_daily_window_wraps_midnight() -> None:
    w = DailyWindow(start="23:00", end="06:00", tz="UTC")
    assert (
        w.contains(_at(23, 30))
        and w.contains(_at(2))
        and not w.contains(_at(6))
        and not w.contains(_at(12))
    )
    assert w.next_start(_at(12)) == _at(23)
    assert w.next_start(_at(2)) == _at(2)
    day = DailyWindow(start="01:00", end="05:00", tz="+02:00")  # 01:00 at UTC+2 is 23:00 UTC
    assert day.contains(_at(23, 30)) and not day.contains(_at(3))
    assert DailyWindow().contains(_at(13))  # start == end: all day


def test_window_validation() -> None:
    with pytest.raises(ValidationError):
        DailyWindow(start="25:00")
    with pytest.raises(ValidationError):
        DailyWindow(tz="Mars/Olympus_Mons")


def test_next_eligible_time() -> None:
    policy = DevicePolicy(window=DailyWindow(start="01:00", end="06:00", tz="UTC"))
    # Only the window blocks: the answer is the next window start, tomorrow 01:00.
    assert next_eligible_time(GOOD, policy, _at(12)) == _at(1) + 86400
    assert next_eligible_time(GOOD, policy, _at(3)) == _at(3)
    # The battery blocks too: only polling can tell.
    low = DeviceState(battery_percent=5.0, charging=False)
    assert next_eligible_time(low, policy, _at(12)) is None
    assert not evaluate(GOOD, policy, _at(12)).eligible


def test_policy_roundtrips_through_json() -> None:
    policy = DevicePolicy(
        eligibility=EligibilityConfig(min_battery_percent=30),
        window=DailyWindow(start="01:00", end="06:00", tz="UTC"),
    )
    assert DevicePolicy.model_validate_json(policy.model_dump_json()) == policy
    assert policy.hard_ceiling_c == 45.0 and policy.battery_floor_percent == 30.0
