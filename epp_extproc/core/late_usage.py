"""Usage that arrives after the request ended (lean mode: Envoy's gRPC access log, batched).

When a request's stream ends without the picker having seen its usage, what the usage must be compared with
(model, predicted cached tokens) waits here under the booking id for a bounded time and count, so a gateway
that never sends access logs costs a fixed amount of memory, and a late or duplicated entry is ignored.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_PENDING = 16_384
PENDING_TTL_S = 60.0


@dataclass(slots=True, frozen=True)
class Pending:
    model: str
    predicted_cached_tokens: int | None
    since: float


class LateUsage:
    def __init__(self, limit: int = MAX_PENDING, ttl_s: float = PENDING_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self.clock = clock
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._pending)

    def park(self, booking_id: str, model: str, predicted: int | None) -> None:
        now = self.clock()
        self._expire(now)
        if len(self._pending) >= self.limit:
            self._pending.popitem(last=False)
            self.expired += 1
        self._pending[booking_id] = Pending(model, predicted, now)

    def take(self, booking_id: str) -> Pending | None:
        self._expire(self.clock())
        return self._pending.pop(booking_id, None)

    def _expire(self, now: float) -> None:
        while self._pending:
            first = next(iter(self._pending.values()))
            if now - first.since < self.ttl_s:
                return
            self._pending.popitem(last=False)
            self.expired += 1
