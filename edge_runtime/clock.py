"""Clocks the edge runtime paces itself on.

Everything that waits (the governor's throttling sleeps, eligibility polling) takes a
:class:`Clock` instead of calling ``time.sleep``: on a device it is :class:`RealClock`;
in tests and in the simulator it is a :class:`VirtualClock`, whose ``sleep`` advances
time instantly, so an hour of thermal throttling runs in microseconds.

Two readings, because they answer different questions:

- ``monotonic()`` (seconds, arbitrary origin) measures durations: budgets, step times.
- ``wall()`` (seconds since the Unix epoch) places a moment in the day: charging
  windows such as "01:00-06:00 local time".
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

from orchard.errors import OrchardError


class ClockError(OrchardError):
    """A clock was asked to go backwards (a negative sleep or advance)."""


@runtime_checkable
class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """The host's clocks; ``sleep`` really sleeps."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ClockError(f"cannot sleep a negative time ({seconds} s)")
        time.sleep(seconds)


class VirtualClock:
    """A clock that only moves when told to.

    ``sleep`` and ``advance`` move time forward by exactly the amount asked and return
    at once. ``wall_origin`` is the epoch time that monotonic 0 corresponds to, so
    time-of-day rules can be tested at chosen hours.
    """

    def __init__(self, start: float = 0.0, wall_origin: float = 0.0) -> None:
        self._t = float(start)
        self._wall_origin = float(wall_origin)
        self.slept_s = 0.0  # total time spent in sleep(): the throttling a run paid

    def monotonic(self) -> float:
        return self._t

    def wall(self) -> float:
        return self._wall_origin + self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ClockError(f"a virtual clock cannot go backwards (advance by {seconds} s)")
        self._t += seconds

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ClockError(f"cannot sleep a negative time ({seconds} s)")
        self.slept_s += seconds
        self._t += seconds

    def snapshot(self) -> tuple[float, float, float]:
        """(now, wall origin, seconds slept): what :meth:`restore` takes to be this clock."""
        return self._t, self._wall_origin, self.slept_s

    def restore(self, snap: tuple[float, float, float]) -> None:
        """Become the clock :meth:`snapshot` described (exactly: no arithmetic on the values)."""
        t, wall_origin, slept = snap
        self._t, self._wall_origin, self.slept_s = float(t), float(wall_origin), float(slept)
