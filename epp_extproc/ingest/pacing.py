"""Per-worker ingest budgets and lag samples: what keeps one flooding publisher from costing anyone else.

`Pacer` is a token bucket of CPU seconds per worker: each handled message is charged the time it took, the
bucket refills at `share` seconds per second (a share of one core) up to `burst_s`, and a worker in debt is
not read again until the debt is repaid. Its SUB socket's queue then fills and ZeroMQ drops that worker's
batches (a gap the subscriber recovers by replay, or by clearing the rank), so the flood costs the flooder's
freshness and nobody else's. A worker at 10 batches/s of 32 blocks spends well under 1% of a core; the
default share (10%) is far above any honest publisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# the flag's default (--kv-ingest-worker-cpu-share): one worker's events may use a tenth of a core, in a shard
# or in the picker's own loop, with a burst of 50 ms of CPU before the first pause
DEFAULT_WORKER_CPU_SHARE = 0.1
DEFAULT_BURST_S = 0.05


class _Bucket:
    __slots__ = ("tokens", "stamp", "throttled", "throttled_s")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp
        self.throttled = 0  # times the worker was paused
        self.throttled_s = 0.0  # seconds it was paused, all together


class Pacer:
    """CPU-time token buckets, one per worker (see the module docstring)."""

    def __init__(self, share: float, burst_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if share <= 0 or burst_s <= 0:
            raise ValueError("share and burst must be positive")
        self.share = share
        self.burst_s = burst_s
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def charge(self, worker: str, spent_s: float) -> float:
        """`worker`'s last message took `spent_s`: the pause (seconds) before its next one is read."""
        now = self._clock()
        b = self._buckets.get(worker)
        if b is None:
            b = self._buckets[worker] = _Bucket(self.burst_s, now)
        b.tokens = min(self.burst_s, b.tokens + (now - b.stamp) * self.share) - spent_s
        b.stamp = now
        if b.tokens >= 0:
            return 0.0
        pause = -b.tokens / self.share
        b.throttled += 1
        b.throttled_s += pause
        return pause

    def forget(self, worker: str) -> None:
        self._buckets.pop(worker, None)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {w: {"ingest_throttled": b.throttled, "ingest_throttled_s": round(b.throttled_s, 3)}
                for w, b in self._buckets.items()}


class LagSamples:
    """The last `size` lag samples (seconds), for percentiles in `/debug/kv` and the bench: bounded memory."""

    def __init__(self, size: int = 4096) -> None:
        self._buf: list[float] = []
        self._size = size
        self._next = 0
        self.count = 0

    def add(self, lag_s: float) -> None:
        self.count += 1
        if len(self._buf) < self._size:
            self._buf.append(lag_s)
        else:
            self._buf[self._next] = lag_s
            self._next = (self._next + 1) % self._size

    def summary(self) -> dict[str, float | int]:
        if not self._buf:
            return {"count": self.count}
        s = sorted(self._buf)
        return {"count": self.count, "p50": round(s[len(s) // 2], 6), "p99": round(s[min(len(s) - 1, len(s) * 99 // 100)], 6),
                "max": round(s[-1], 6)}
