"""Warnings that repeat per request must not repeat per request in the log.

A renderer that is down makes every request log "routed by load only"; at 1,000 req/s that is 1,000 lines a
second about one fact. `Throttled` logs the first occurrence of a key at once, then at most one line per
interval carrying how many were suppressed in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

MAX_KEYS = 256  # distinct keys remembered; beyond that the oldest is forgotten (bounded memory)


class Throttled:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last logged at, suppressed since)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log `msg` unless `key` was logged less than the interval ago; True when a line was written."""
        now = self.clock()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return False
        suppressed = seen[1] if seen is not None else 0
        if len(self._last) >= MAX_KEYS and key not in self._last:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        if suppressed:
            msg += " (%d similar messages suppressed in the last %.0fs)"
            args = (*args, suppressed, self.interval_s)
        self.logger.warning(msg, *args)
        return True
