"""A monotonic clock the test moves by hand (``clock.t += 2.0``), for code that takes a
``monotonic`` callable."""

from __future__ import annotations


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
