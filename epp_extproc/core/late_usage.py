"""Usage that arrives after the request ended (lean mode: Envoy's gRPC access log, batched).

When a request's stream ends without the picker having seen its usage, what the usage must be compared with
(model, predicted cached tokens) waits here under the booking id for a bounded time and count, so a gateway
that never sends access logs costs a fixed amount of memory, and a late or duplicated entry is ignored.

The two arrive on different gRPC streams, so their order is not guaranteed: Envoy writes the access log
before it closes the filters' streams, and a full buffer (or a flush timer due at that instant) ships the
entry at once.  An entry for a request still in flight waits here too (``early``), under the same bounds,
until its stream ends.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_PENDING = 16_384
PENDING_TTL_S = 60.0


@dataclass(slots=True, frozen=True)
class Pending:
    model: str
    predicted_cached_tokens: int | None
    since: float


@dataclass(slots=True, frozen=True)
class _Early:
    usage_tail: bytes | None
    since: float


class LateUsage:
    def __init__(self, limit: int = MAX_PENDING, ttl_s: float = PENDING_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.ttl_s = ttl_s
        self.clock = clock
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._early: OrderedDict[str, _Early] = OrderedDict()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._pending) + len(self._early)

    def park(self, booking_id: str, model: str, predicted: int | None) -> None:
        now = self.clock()
        self._put(self._pending, booking_id, Pending(model, predicted, now), now)

    def take(self, booking_id: str) -> Pending | None:
        self._expire(self.clock())
        return self._pending.pop(booking_id, None)

    def hold_early(self, booking_id: str, usage_tail: bytes | None) -> None:
        """The access-log entry of a request whose stream has not ended yet."""
        now = self.clock()
        self._put(self._early, booking_id, _Early(usage_tail, now), now)

    def take_early(self, booking_id: str) -> tuple[bool, bytes | None]:
        """(found, usage tail) of an entry that came before its stream ended."""
        if not self._early:
            return False, None
        self._expire(self.clock())
        got = self._early.pop(booking_id, None)
        return (False, None) if got is None else (True, got.usage_tail)

    def _put(self, waiting: OrderedDict[str, Any], booking_id: str, value: Any, now: float) -> None:
        self._expire(now)
        if len(waiting) >= self.limit:
            waiting.popitem(last=False)
            self.expired += 1
        waiting[booking_id] = value

    def _expire(self, now: float) -> None:
        for waiting in (self._pending, self._early):
            while waiting and now - next(iter(waiting.values())).since >= self.ttl_s:
                waiting.popitem(last=False)
                self.expired += 1
