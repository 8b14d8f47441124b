"""Every field a node sends in Join, Poll and Heartbeat is bounded; a refusal names the
field, what came and what is expected."""

from __future__ import annotations

import math

import pytest

from orchard.errors import InvalidRequestError
from orchard.server import bounds
from orchard.typing import DeviceState

OK_DEVICE = DeviceState(battery_percent=80.0, charging=True, temperature_c=31.5, extra={"soc": 0.5})


def test_reasonable_requests_pass() -> None:
    bounds.check_join("phone-17", {"task": "digits"}, OK_DEVICE, b"k" * 32, b"s" * 64)
    bounds.check_join("", {}, DeviceState(), b"", b"")  # the server picks the id
    bounds.check_poll("agg.eu-1:a@b", OK_DEVICE, 10_000, 9_000, 20.0)
    bounds.check_heartbeat("c0", OK_DEVICE, "run.3.0.17", 0.5)


@pytest.mark.parametrize("node_id, match", [
    ("x" * (1 << 20), "at most 128"), ("a b", "outside"), ("-lead", "start with"), ("a\x00b", "outside"),
    ("é", "outside"), ("../etc", "start with"),
])
def test_node_ids_are_bounded_in_length_and_charset(node_id: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        bounds.check_join(node_id, {}, DeviceState(), b"", b"")


@pytest.mark.parametrize("caps, match", [
    ({f"k{i}": "v" for i in range(33)}, "33 entries"),
    ({"k": "v" * 513}, "at most 512"),
    ({"k" * 65: "v"}, "at most 64"),
    ({f"k{i}": "v" * 400 for i in range(30)}, "bytes; at most 8192"),
    ({"k": "line\nbreak"}, "control characters"),
])
def test_capabilities_are_bounded(caps: dict[str, str], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        bounds.check_join("n", caps, DeviceState(), b"", b"")


@pytest.mark.parametrize("device, match", [
    (DeviceState(battery_percent=math.nan), "battery_percent is nan"),
    (DeviceState(battery_percent=101.0), "battery_percent"),
    (DeviceState(temperature_c=math.inf), "temperature_c is inf"),
    (DeviceState(temperature_c=-1e9), "temperature_c"),
    (DeviceState(extra={"x": math.nan}), "extra"),
    (DeviceState(extra={f"k{i}": 1.0 for i in range(33)}), "33 entries"),
])
def test_device_state_numbers_are_finite_and_in_range(device: DeviceState, match: str) -> None:
    for check in (lambda: bounds.check_join("n", {}, device, b"", b""),
                  lambda: bounds.check_poll("n", device, 0, 0, 1.0),
                  lambda: bounds.check_heartbeat("n", device, "t", 0.0)):
        with pytest.raises(InvalidRequestError, match=match):
            check()


@pytest.mark.parametrize("progress", [math.nan, -0.1, 1.5, math.inf])
def test_heartbeat_progress_is_a_fraction(progress: float) -> None:
    with pytest.raises(InvalidRequestError, match="progress"):
        bounds.check_heartbeat("n", DeviceState(), "t", progress)


def test_heartbeat_task_id_and_poll_numbers_are_bounded() -> None:
    with pytest.raises(InvalidRequestError, match="task_id"):
        bounds.check_heartbeat("n", DeviceState(), "t" * 257, 0.0)
    for args in ((-1, 0, 1.0), (0, 1 << 41, 1.0), (0, 0, math.nan), (0, 0, -1.0)):
        with pytest.raises(InvalidRequestError):
            bounds.check_poll("n", DeviceState(), *args)


def test_key_fields_have_their_sizes() -> None:
    with pytest.raises(InvalidRequestError, match="device_public_key"):
        bounds.check_join("n", {}, DeviceState(), b"k" * 33, b"")
    with pytest.raises(InvalidRequestError, match="key_proof"):
        bounds.check_join("n", {}, DeviceState(), b"", b"s" * 10)
