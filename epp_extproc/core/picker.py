"""The picker the edge talks to: one object that admits a request, decides it and follows it to its end.

It owns what lives across requests but is not the decision: two caps, the body budget, and lean mode's
signals. A stream is counted from the moment it opens, first as incomplete (`arriving`: its headers or body
are still coming) and, once its request is whole, as in flight (`gate`). The caps are separate so that clients
that open streams and stall (they may take --request-body-timeout-ms) cannot take the slots of requests that
are ready to be decided: a full `arriving` refuses new streams, a full `gate` refuses whole requests. Each request gets a `PickerExchange` (`open()`),
which drives the Director's three steps through `decide()`: propose -> admit -> commit. Everything is
handed in at construction, so a test builds a picker from the same parts the app does.
"""

from __future__ import annotations

import logging

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.decision import Decision
from epp_extproc.core.director import Director
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.exchange import PickerExchange
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.request import RequestContext

log = logging.getLogger(__name__)


class Picker:
    """Implements `core.api.Picker` for the edge, and `decide()` for callers with a whole request."""

    def __init__(self, director: Director, *, gate: InflightGate, bodies: BodyBudget, lean: LeanSignals,
                 arriving: InflightGate | None = None) -> None:
        self.director = director
        self.gate = gate
        self.arriving = arriving if arriving is not None else InflightGate(4 * gate.limit)
        self.bodies = bodies
        self.lean = lean
        self.metrics = lean.metrics
        sessions = director.sessions  # session affinity: answers name their worker in a sealed token
        self._seal = sessions.seal if sessions is not None else None

    @property
    def open_requests(self) -> int:
        """Requests the picker holds: still arriving, or whole and in flight (what a drain waits for)."""
        return self.arriving.count + self.gate.count

    def open(self) -> PickerExchange:
        """A new request (one ext_proc stream), counted as incomplete from now on, not from its headers."""
        self.arriving.enter()
        return PickerExchange(self.decide, self.bodies, self.arriving, self.gate, self.lean, self.metrics,
                              knows=self.director.registry.__contains__, count_rejection=self.count_rejection,
                              seal=self._seal)

    async def decide(self, request: RequestContext) -> Decision:
        """Propose, wait for admission, commit; the flow ticket is released once the load is booked (or on any
        failure). Raises PickError, and then nothing is booked."""
        d = self.director
        for header in request.slo_malformed:  # ignored as llm-d ignores them, but counted
            self.metrics.slo_headers_malformed.labels(header).inc()
        p, ticket = await d.admit(await d.propose(request), request)
        try:
            return d.commit(p)
        finally:
            if ticket is not None:
                ticket.release()  # booked: the worker's load now counts it

    def count_rejection(self, err: PickError) -> None:
        label = f"render_{err.render.label}" if err.render is not None else err.problem.value
        if err.problem is Problem.SLO_UNMET:
            self.metrics.slo_decisions.labels("rejected").inc()
        self.metrics.requests.labels(label).inc()

    def first_chunk(self, booking_id: str) -> None:
        self.lean.first_chunk(booking_id)

    def access_logged(self, booking_id: str, usage_tail: bytes | None, flags: list[str]) -> None:
        self.lean.access_logged(booking_id, usage_tail, flags)
