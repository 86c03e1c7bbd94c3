"""The picker's own capacity: how many requests it holds at once and how many body bytes it buffers.

Both are counted in one place each, from the moment an ext_proc stream opens, so that streams that never send
anything, stall after their headers or trickle a body in tiny chunks are bounded like any other request.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Gauge

from epp_extproc.core.errors import PickError, Problem


class InflightGate:
    """Requests inside the picker (stream open -> stream closed); above the cap a new one is refused."""

    def __init__(self, limit: int, gauge: Gauge | None = None) -> None:
        self.limit = limit
        self.count = 0
        if gauge is not None:  # read when scraped: no metric call on the request path
            gauge.set_function(lambda: self.count)

    def enter(self) -> None:
        if self.count >= self.limit:
            raise PickError(Problem.OVERLOADED, "endpoint picker overloaded")
        self.count += 1

    def leave(self) -> None:
        self.count = max(0, self.count - 1)


class BodyBudget:
    """Bytes of request bodies buffered across all streams, against a global budget.

    A body that would push the total over the budget is refused (503: retryable, the picker is busy), one
    that is larger than the per-request limit is refused for good (413).

    `in_transit` (set by the transport that feeds the exchanges) says how many body bytes it holds in messages
    still arriving: they are the same bodies, so they count against the same total. With two budgets of the
    total each, a body held half as whole messages and half as an unfinished one made resident memory twice
    the documented bound (issue 43: +540 MB against 256 MiB).
    """

    def __init__(self, per_request: int, total: int, gauge: Gauge | None = None) -> None:
        self.per_request = per_request
        self.total = total
        self.used = 0
        self.in_transit: Callable[[], int] | None = None
        if gauge is not None:  # read when scraped: no metric call on the request path
            gauge.set_function(lambda: self.used)

    def take(self, held: int, more: int) -> None:
        """Account `more` bytes for a request already holding `held`; raise without taking anything."""
        if held + more > self.per_request:
            raise PickError(Problem.BODY_TOO_LARGE, f"request body larger than {self.per_request} bytes")
        transit = self.in_transit
        if self.used + more + (0 if transit is None else transit()) > self.total:
            raise PickError(Problem.BODY_BUDGET, "endpoint picker is buffering too many request bodies; retry")
        self.used += more

    def give_back(self, n: int) -> None:
        self.used = max(0, self.used - n)
