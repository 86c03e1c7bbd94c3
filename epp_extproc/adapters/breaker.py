"""A circuit breaker for one upstream (the renderer): stop calling it while it keeps failing, probe it back.

Without one, a hung renderer adds the whole render timeout (5 s) to every request. States:

- closed: every call goes through; `failures` consecutive failed calls open the circuit.
- open: no call goes through (the caller routes by load) for `open_s`.
- half-open: exactly one call (a real request) goes through as the probe; the others still skip. Its
  success closes the circuit; its failure re-opens it for twice as long, up to `max_open_s`.

A call's outcome is reported on the `Ticket` `admit()` returned. A ticket released without a verdict (the
request was cancelled mid-call) frees the half-open probe slot, so the next call probes instead.

A timeout is not always the upstream's fault: a client can send prompts built to take longer than the render
timeout, and if each of those counted, a handful of such clients would open the circuit and route everyone
by load. So a call that timed out while the upstream answered another call (`timed_out()`: an answer came
after this call started) is that request's outlier, counted apart; a timeout during which nothing answered
is the upstream's, and counts like any failure. A hung renderer answers nobody, so it still opens the
circuit after `failures` timeouts.
The clock is injectable so the state machine is testable without sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the gauge's encoding


class Ticket:
    """Permission for one call; report `success()` or `failure()` once, or `release()` for neither."""

    __slots__ = ("_breaker", "_probe", "_done", "started")

    def __init__(self, breaker: CircuitBreaker, probe: bool, started: float) -> None:
        self._breaker = breaker
        self._probe = probe
        self._done = False
        self.started = started

    def success(self) -> None:
        if not self._done:
            self._done = True
            self._breaker._success(self._probe)

    def failure(self, why: str) -> None:
        if not self._done:
            self._done = True
            self._breaker._failure(self._probe, why)

    def timed_out(self, why: str) -> bool:
        """No answer in time: the upstream's failure, unless it answered another call meanwhile (then True:
        the request's own outlier)."""
        if self._done:
            return False
        self._done = True
        if self._breaker.answered_since(self.started):
            self._breaker._outlier(self._probe)
            return True
        self._breaker._failure(self._probe, why)
        return False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._breaker._release(self._probe)


class CircuitBreaker:
    def __init__(self, name: str, *, failures: int, open_s: float, max_open_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str], None] | None = None) -> None:
        """`failures` = 0 disables the breaker (every call is admitted and nothing is counted)."""
        self.name = name
        self.threshold = failures
        self.base_open_s = open_s
        self.max_open_s = max(open_s, max_open_s)
        self.clock = clock
        self.on_change = on_change
        self.state = CLOSED
        self.consecutive = 0
        self.open_s = open_s
        self.opened_at = 0.0
        self.opens = 0  # times the circuit opened (re-opens after a failed probe included)
        self.outliers = 0  # timeouts that were the request's own (the upstream answered others meanwhile)
        self.last_answer_at = float("-inf")
        self._probing = False

    def admit(self) -> Ticket | None:
        """A ticket for one call, or None: the circuit is open, do not call."""
        if self.threshold <= 0 or self.state == CLOSED:
            return Ticket(self, False, self.clock())
        if self.state == OPEN:
            if self.clock() - self.opened_at < self.open_s:
                return None
            self._set(HALF_OPEN)
            log.info("%s circuit half-open: probing with the next call", self.name)
        if self._probing:
            return None
        self._probing = True
        return Ticket(self, True, self.clock())

    def retry_in(self) -> float:
        """Seconds until the open circuit lets a probe through (0 when not open)."""
        return max(0.0, self.opened_at + self.open_s - self.clock()) if self.state == OPEN else 0.0

    def answered_since(self, t: float) -> bool:
        """Did the upstream answer any call after `t`?"""
        return self.last_answer_at > t

    def _success(self, probe: bool) -> None:
        if self.threshold <= 0:
            return
        self.last_answer_at = self.clock()
        self.consecutive = 0
        if probe:
            self._probing = False
        if self.state != CLOSED:
            log.warning("%s answered again: circuit closed", self.name)
            self.open_s = self.base_open_s
            self._set(CLOSED)

    def _failure(self, probe: bool, why: str) -> None:
        if self.threshold <= 0:
            return
        if probe:
            self._probing = False
            self.open_s = min(self.open_s * 2, self.max_open_s)
            self._open(f"the probe failed ({why})")
            return
        if self.state != CLOSED:
            return  # a call admitted before the circuit opened, finishing late: already counted as open
        self.consecutive += 1
        if self.consecutive >= self.threshold:
            self._open(f"{self.consecutive} consecutive failures, the last: {why}")

    def _outlier(self, probe: bool) -> None:
        """The request's own timeout: neither a failure of the upstream nor proof that it is well."""
        self.outliers += 1
        if probe:
            self._probing = False

    def _release(self, probe: bool) -> None:
        if probe:
            self._probing = False

    def _open(self, why: str) -> None:
        self.opened_at = self.clock()
        self.opens += 1
        self.consecutive = 0
        log.warning("%s circuit open: %s; not calling it for %.1fs", self.name, why[:300], self.open_s)
        self._set(OPEN)

    def _set(self, state: str) -> None:
        self.state = state
        if self.on_change is not None:
            self.on_change(state)
