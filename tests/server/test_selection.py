"""How a tier splits its target among its children (``allocate``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchard.server.selection import _largest_remainder, allocate

names = st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, st.integers(0, 5), max_size=40), st.integers(-3, 120), st.booleans())
def test_allocate_is_the_largest_remainder_split(caps: dict[str, int], target: int, equal: bool) -> None:
    if equal and caps:  # every child the same capacity: the shortcut
        c = next(iter(caps.values()))
        caps = dict.fromkeys(caps, c)
    got = allocate(target, caps)
    assert got == _largest_remainder(target, caps)
    assert list(got) == list(caps)  # the children's order, as given
    assert all(0 <= got[k] <= max(caps[k], 0) for k in caps)
    assert sum(got.values()) == max(0, min(target, sum(max(c, 0) for c in caps.values())))


def test_equal_capacities_hand_the_remainder_out_by_name() -> None:
    caps = dict.fromkeys(["c", "a", "d", "b"], 1)
    assert allocate(2, caps) == {"c": 0, "a": 1, "d": 0, "b": 1}
    assert allocate(9, dict.fromkeys(["b", "a"], 3)) == {"b": 3, "a": 3}
    assert allocate(5, dict.fromkeys(["b", "a"], 3)) == {"b": 2, "a": 3}
    assert allocate(0, caps) == dict.fromkeys(caps, 0)


def test_a_childs_eligibility_follows_its_state_and_the_rules() -> None:
    # A tier asks twice a round (its pool report, then selection); the verdict is kept for
    # the state and rules it was given, and asked again when either changes.
    from orchard.config import EligibilityConfig
    from orchard.server.coordinator import Child
    from orchard.server.selection import device_eligible
    from orchard.typing import DeviceState, Role

    rules = EligibilityConfig(allow_on_battery=True, min_battery_percent=50.0)
    c = Child("device-1", Role.CLIENT, "t", DeviceState(battery_percent=80.0, charging=False))
    assert c.eligible(rules) is True
    c.device = DeviceState(battery_percent=20.0, charging=False)  # a new report
    assert c.eligible(rules) is False
    strict = EligibilityConfig(allow_on_battery=False)
    c.device = DeviceState(battery_percent=80.0, charging=False)
    assert c.eligible(rules) is True and c.eligible(strict) is False
    for state in (DeviceState(), DeviceState(charging=True, temperature_c=50.0)):
        c.device = state
        assert c.eligible(rules) == device_eligible(state, rules)[0]
