"""The one retry schedule of the house: exponential, half-jittered, capped, reset by a success.

Every loop that retries something a peer or the machine refused (a Kubernetes watch, a replica link, a replay
that failed, a worker that does not answer its scrape, a child process that crashed) waits by this rule, so a
newcomer reads one definition and every loop backs off the same way. It lives in `kvindex/` because it is the
lowest layer of the house (the KV subscriber uses it, and `kvindex` imports nothing from `epp_extproc`).

Half-jitter rather than full jitter: replicas restarted together spread out, yet a retry never comes sooner
than half the nominal delay, so a sick peer is not hammered by near-zero draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable


def backoff_delay(attempt: int, initial: float, cap: float, rng: Callable[[], float] = random.random) -> float:
    """The wait before retry number `attempt` (0-based): uniform in [d/2, d], d = min(cap, initial * 2**attempt)."""
    nominal = min(cap, initial * (2 ** min(max(attempt, 0), 62)))
    return nominal / 2 + rng() * nominal / 2


class Backoff:
    """Consecutive failures of one thing, and how long to wait before the next try.

    `failed()` counts a failure and returns the wait; `succeeded()` starts over. `failures` says how many came
    in a row, which a caller can hold against a limit (a crash loop that should stop rather than spin).
    """

    __slots__ = ("initial_s", "max_s", "failures", "_rng")

    def __init__(self, initial_s: float, max_s: float, rng: Callable[[], float] = random.random) -> None:
        if initial_s <= 0 or max_s < initial_s:
            raise ValueError(f"backoff needs 0 < initial ({initial_s}) <= max ({max_s})")
        self.initial_s = initial_s
        self.max_s = max_s
        self.failures = 0
        self._rng = rng

    def failed(self) -> float:
        """One more failure: the seconds to wait before trying again."""
        delay = backoff_delay(self.failures, self.initial_s, self.max_s, self._rng)
        self.failures += 1
        return delay

    def succeeded(self) -> None:
        self.failures = 0
