"""Per-worker cache churn from the worker's own KV events: removal rate and learned capacity.

Why a separate module and not a counter inside the index's event path: the index already counts every
removed block per worker (`WorkerStats.blocks_removed`, incremented once per BlockRemoved event) and knows how
many blocks a worker holds (`KvIndex.blocks_indexed`). A sliding window over those two cumulative figures,
sampled when a decision asks, costs nothing on the ingest path and O(1) per worker per question: no per-event
timestamp, no per-block allocation.

What it answers (see docs/eviction-aware.md):
  * `removal_rate(w)`: blocks the worker's engine removed per second over the last `window_s` (the buckets
    that fell out of the window are forgotten, so a worker whose churn stopped reads 0 again);
  * `capacity(w)`: the most blocks the worker was ever seen holding at once, trusted only once the worker
    has removed a block (an engine removes a reusable block when it needs the room, so the size it held
    when removals started is its cache's size; before that the figure is only a lower bound, and None is
    answered: nothing says the cache is full);
  * `held(w)`: blocks it holds now.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class ChurnSource(Protocol):
    """What the window reads of the index (`kvindex.index.KvIndex` is one): nothing private."""

    def blocks_indexed(self, worker_id: str) -> int: ...

    def stats(self, worker_id: str) -> StatsView: ...


class StatsView(Protocol):
    """The two removal counters of `kvindex.index.WorkerStats` (both are engine removals: `removed_unknown`
    counts BlockRemoved hashes the index never saw stored, e.g. stored before it subscribed)."""

    blocks_removed: int
    removed_unknown: int


@dataclass(slots=True)
class _Window:
    """A ring of `n` buckets of removed-block counts, plus the learned capacity."""

    counts: list[int]
    head: int  # index of the current bucket
    bucket_at: float  # start time of the current bucket
    last_total: int  # the cumulative removal counter when last sampled
    max_held: int = 0
    removed_ever: int = 0


class ChurnWindow:
    """Sliding-window removal rate and learned capacity per worker, sampled lazily from the index's counters."""

    def __init__(self, source: ChurnSource, *, window_s: float = 10.0, buckets: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or buckets < 1:
            raise ValueError("window_s must be > 0 and buckets >= 1")
        self._source = source
        self.window_s = window_s
        self._bucket_s = window_s / buckets
        self._n = buckets
        self._clock = clock
        self._w: dict[str, _Window] = {}

    def _sample(self, worker: str) -> _Window:
        now = self._clock()
        st = self._source.stats(worker)
        total = st.blocks_removed + st.removed_unknown
        held = self._source.blocks_indexed(worker)
        w = self._w.get(worker)
        if w is None or total < w.last_total:  # first sight, or the worker's counters were reset
            # removals before the first look count for the capacity's trust, not for the rate
            w = self._w[worker] = _Window([0] * self._n, 0, now, total, held, total)
            return w
        steps = int((now - w.bucket_at) / self._bucket_s)
        if steps > 0:  # advance the ring, zeroing the buckets that fell out of the window (at most n)
            for _ in range(min(steps, self._n)):
                w.head = (w.head + 1) % self._n
                w.counts[w.head] = 0
            w.bucket_at += steps * self._bucket_s
        delta = total - w.last_total
        if delta:
            w.counts[w.head] += delta
            w.removed_ever += delta
            w.last_total = total
        if held > w.max_held:
            w.max_held = held
        return w

    def removal_rate(self, worker: str) -> float:
        """Blocks removed per second over the window (0 for a worker that never removed one)."""
        return sum(self._sample(worker).counts) / self.window_s

    def removed_in_window(self, worker: str) -> int:
        return sum(self._sample(worker).counts)

    def capacity(self, worker: str) -> int | None:
        """The most blocks the worker held at once, once it has removed blocks (None: not known to be full)."""
        w = self._sample(worker)
        return w.max_held if w.removed_ever > 0 and w.max_held > 0 else None

    def held(self, worker: str) -> int:
        return self._source.blocks_indexed(worker)

    def forget(self, worker: str) -> None:
        """The worker left or restarted: its window and learned capacity go with it."""
        self._w.pop(worker, None)
