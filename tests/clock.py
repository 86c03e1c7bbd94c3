"""A clock a test sets by hand, for code that takes a `clock` callable (pacing, refreezes, tokens, parked usage)."""

from __future__ import annotations


class Clock:
    """Calling it answers the time it was set to; `t` and `now` are the same reading."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    @property
    def now(self) -> float:
        return self.t

    @now.setter
    def now(self, value: float) -> None:
        self.t = value
