"""The simulated clock every coordinator of a simulation reads."""

from __future__ import annotations


class VirtualTime:
    """The simulated clock every coordinator reads (monotonic and wall, in seconds)."""

    def __init__(self, wall_origin: float) -> None:
        self.t = 0.0
        self.origin = wall_origin

    def monotonic(self) -> float:
        return self.t

    def wall(self) -> float:
        return self.origin + self.t

    def advance_to(self, t: float) -> None:
        # Events are handled in time order; an event stamped earlier than now (a
        # partial whose transfer was shorter than the wait) is handled now.
        self.t = max(self.t, t)
