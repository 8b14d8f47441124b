"""What a node may send in Join, Poll and Heartbeat: the bounds of every field.

A tier keeps what a node tells it (its id, capabilities and device state in the
registry; the root also in its store), so nothing a node sends is taken unbounded. The
checks are pure functions of the request's values; the servicer calls them before it
authenticates or registers anything, and each refusal is an ``InvalidRequestError``
(INVALID_ARGUMENT on the wire) that says which field, what came and what is expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from orchard.errors import InvalidRequestError
from orchard.messages import DroppedUpload
from orchard.typing import DeviceState

NODE_ID_MAX = 128
# Letters, digits and . _ : @ -, starting with a letter or digit: safe in logs, file
# names, metric labels and URLs alike.
NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
CAPABILITIES_MAX = 32
CAPABILITY_KEY_MAX = 64
CAPABILITY_VALUE_MAX = 512
CAPABILITIES_BYTES_MAX = 8192
DEVICE_EXTRA_MAX = 32
DEVICE_KEY_MAX = 64
TASK_ID_MAX = 256
PUBLIC_KEY_BYTES = 32  # Ed25519 (orchard.identity)
KEY_PROOF_BYTES = 64
POOL_MAX = 1 << 40
DROPPED_MAX = 256  # dropped uploads one Poll may report (an aggregator sends the rest next poll)
RUN_ID_MAX = 128
REASON_MAX = 512
# A device's plausible ranges: a battery is 0-100 %, a temperature in degrees Celsius
# between what a device survives in the cold and what it survives in the heat.
BATTERY_RANGE = (0.0, 100.0)
TEMPERATURE_RANGE = (-100.0, 200.0)
EXTRA_RANGE = (-1e12, 1e12)


def _text(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequestError(f"{field} is {len(value)} characters; at most {limit} are accepted")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise InvalidRequestError(f"{field} holds control characters; send printable text")


def check_node_id(node_id: str, field: str = "node_id") -> None:
    """Empty (the server picks one), or 1-128 of ``[A-Za-z0-9._:@-]`` starting with a
    letter or digit."""
    if not node_id:
        return
    if len(node_id) > NODE_ID_MAX:
        raise InvalidRequestError(f"{field} is {len(node_id)} characters; at most {NODE_ID_MAX} are accepted")
    if NODE_ID_RE.fullmatch(node_id) is None:
        raise InvalidRequestError(f"{field} {node_id[:40]!r} has characters outside [A-Za-z0-9._:@-] or does not "
                                  "start with a letter or digit; pick an id such as 'phone-17'")


def _number(field: str, value: float, lo: float, hi: float) -> None:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InvalidRequestError(f"{field} is {value}; expected a finite number in [{lo:g}, {hi:g}]")


def check_device(d: DeviceState, field: str = "device") -> None:
    """Every number finite and in its range; ``extra`` bounded in entries and key length."""
    if d.battery_percent is not None:
        _number(f"{field}.battery_percent", d.battery_percent, *BATTERY_RANGE)
    if d.temperature_c is not None:
        _number(f"{field}.temperature_c", d.temperature_c, *TEMPERATURE_RANGE)
    if len(d.extra) > DEVICE_EXTRA_MAX:
        raise InvalidRequestError(f"{field}.extra has {len(d.extra)} entries; at most {DEVICE_EXTRA_MAX} are accepted")
    for k, v in d.extra.items():
        _text(f"{field}.extra key", k, DEVICE_KEY_MAX)
        _number(f"{field}.extra[{k[:DEVICE_KEY_MAX]!r}]", v, *EXTRA_RANGE)


def check_capabilities(caps: Mapping[str, str]) -> None:
    if len(caps) > CAPABILITIES_MAX:
        raise InvalidRequestError(f"capabilities has {len(caps)} entries; at most {CAPABILITIES_MAX} are accepted")
    total = 0
    for k, v in caps.items():
        _text("capabilities key", k, CAPABILITY_KEY_MAX)
        _text(f"capabilities[{k!r}]", v, CAPABILITY_VALUE_MAX)
        total += len(k.encode()) + len(v.encode())
    if total > CAPABILITIES_BYTES_MAX:
        raise InvalidRequestError(f"capabilities hold {total} bytes; at most {CAPABILITIES_BYTES_MAX} are accepted")


def check_join(node_id: str, capabilities: Mapping[str, str], device: DeviceState, public_key: bytes,
               key_proof: bytes) -> None:
    """A Join's fields (its role is checked where it is parsed)."""
    check_node_id(node_id)
    check_capabilities(capabilities)
    check_device(device)
    if len(public_key) not in (0, PUBLIC_KEY_BYTES):
        raise InvalidRequestError(f"device_public_key is {len(public_key)} bytes; expected none or a "
                                  f"{PUBLIC_KEY_BYTES}-byte Ed25519 public key")
    if len(key_proof) not in (0, KEY_PROOF_BYTES):
        raise InvalidRequestError(f"key_proof is {len(key_proof)} bytes; expected none or a "
                                  f"{KEY_PROOF_BYTES}-byte Ed25519 signature")


def check_poll(node_id: str, device: DeviceState, pool_size: int, pool_eligible: int, wait_s: float) -> None:
    check_node_id(node_id)
    check_device(device)
    _number("pool_size", pool_size, 0, POOL_MAX)
    _number("pool_eligible", pool_eligible, 0, POOL_MAX)
    _number("wait_s", wait_s, 0.0, 86400.0)


def check_dropped(dropped: Sequence[DroppedUpload]) -> None:
    """The dropped uploads an aggregator reports in a Poll: at most ``DROPPED_MAX``, each
    with ids of bounded printable text, a round and attempt that are not negative and a
    reason."""
    if len(dropped) > DROPPED_MAX:
        raise InvalidRequestError(f"dropped has {len(dropped)} entries; at most {DROPPED_MAX} per poll are "
                                  "accepted (send the rest with the next poll)")
    for i, d in enumerate(dropped):
        _text(f"dropped[{i}].run_id", d.run_id, RUN_ID_MAX)
        check_node_id(d.node_id, f"dropped[{i}].node_id")
        _text(f"dropped[{i}].task_id", d.task_id, TASK_ID_MAX)
        _text(f"dropped[{i}].reason", d.reason, REASON_MAX)
        if not (d.run_id and d.node_id and d.task_id and d.reason):
            raise InvalidRequestError(f"dropped[{i}] lacks a run_id, node_id, task_id or reason; send all four")
        _number(f"dropped[{i}].round", d.round, 0, POOL_MAX)
        _number(f"dropped[{i}].attempt", d.attempt, 0, POOL_MAX)


def check_heartbeat(node_id: str, device: DeviceState, task_id: str, progress: float) -> None:
    check_node_id(node_id)
    check_device(device)
    _text("task_id", task_id, TASK_ID_MAX)
    _number("progress", progress, 0.0, 1.0)
