"""One request's life inside the picker, as the edge sees it: body in, decision out, response observed.

The edge (`envoy/extproc.py`) drives an exchange through the `Exchange` protocol (`core/api.py`) and never
touches bookings, observers or counters itself. `close()` is the single exit: whatever happened on the
stream (routed, rejected, client gone, Envoy gone), it frees the booking, the body bytes and the in-flight
slot exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.decision import Decision
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.request import RequestContext, clip
from epp_extproc.core.session import SESSION_HEADER
from epp_extproc.core.usage import ModelLabels, UsageObserver
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)

Decide = Callable[[RequestContext], Awaitable[Decision]]


class PickerExchange:
    """Made by `Picker.open()` with the collaborators it may use, and nothing else of the picker's."""

    __slots__ = ("_decide", "_bodies", "_arriving", "_gate", "_slot", "_lean", "_metrics", "_knows",
                 "_count_rejection", "_seal", "_served", "_buf", "_held", "_deciding", "decision", "observer", "_closed", "_chunks")

    labels = ModelLabels()  # bounded model label values, shared by every exchange of the process

    def __init__(self, decide: Decide, bodies: BodyBudget, arriving: InflightGate, gate: InflightGate,
                 lean: LeanSignals, metrics: PickerMetrics, *, knows: Callable[[str], bool],
                 count_rejection: Callable[[PickError], None],
                 seal: Callable[[str], str] | None = None) -> None:
        self._decide = decide  # propose -> admit -> commit (Picker.decide)
        self._bodies = bodies
        self._arriving = arriving  # entered by Picker.open(), left when the request is whole
        self._gate = gate  # entered when the request is whole, left by close()
        self._slot: InflightGate | None = arriving  # the cap that counts this request now
        self._lean = lean
        self._metrics = metrics
        self._knows = knows  # is an address one of the pool's endpoints?
        self._count_rejection = count_rejection
        self._seal = seal  # session affinity: a token naming the worker that served
        self._served: str | None = None  # the gateway's report of the endpoint it really served
        self._buf = bytearray()  # grows in place: tiny chunks cost their bytes, not an object each
        self._held = 0  # body bytes accounted in the picker's BodyBudget
        self._deciding = False
        self.decision: Decision | None = None
        self.observer: UsageObserver | None = None
        self._closed = False
        self._chunks = 0  # response body chunks seen on this stream (none in lean mode)

    # ------------------------------------------------------------ request
    def add_body(self, data: bytes) -> None:
        self._bodies.take(self._held, len(data))
        self._held += len(data)
        self._buf += data

    def body(self) -> bytes:
        """The whole buffered body; the buffer is released (the budget is held until the decision is made)."""
        out = bytes(self._buf)
        self._buf = bytearray()
        return out

    async def decide(self, request: RequestContext) -> Decision:
        if self._deciding or self.decision is not None:
            raise PickError(Problem.PROTOCOL, "one HTTP request per ext_proc stream: a second request_headers")
        self._deciding = True
        try:
            self._move_to_gate()
            self.decision = await self._decide(request)
        finally:
            self._release_body()
        self.observer = UsageObserver(self.decision, self._metrics, self.labels)
        return self.decision

    def _move_to_gate(self) -> None:
        """The request is whole: it stops counting as arriving and must find room among those in flight."""
        if self._slot is self._arriving:
            self._arriving.leave()
            self._slot = None
            self._gate.enter()  # raises PickError(OVERLOADED): 503, nothing booked
            self._slot = self._gate

    def reject(self, err: PickError, request: RequestContext) -> None:
        """The edge answers this request itself: count it and say why, once, with a bounded line. Its body is
        dropped now, not at close(): the answer may wait for the client's window, and meanwhile the bytes of a
        body refused for the budget would keep refusing the others."""
        self._buf = bytearray()
        self._release_body()
        self._count_rejection(err)
        log.info("rejected %s %s: %s", clip(request.method, 16), clip(request.path), clip(str(err), 300))

    # ------------------------------------------------------------ response
    def served_by(self, address: str) -> None:
        """The gateway reports it served another endpoint (a fallback): move the booking if we know it."""
        d = self.decision
        if d is not None and address and address != d.address and self._knows(address):
            self._served = address
            log.info("gateway served %s instead of %s; moving the booking", clip(address, 64), d.address)
            d.booking.move(address)

    def response_headers(self, headers: Mapping[str, list[str]]) -> list[tuple[str, str]]:
        if self.observer is not None:
            self.observer.on_headers(headers)
        d = self.decision
        if d is None or not d.session or self._seal is None:
            return []
        return [(SESSION_HEADER, self._seal(self._served or d.address))]

    def response_chunk(self, data: bytes) -> None:
        if self.decision is None or not data:
            return
        self.decision.booking.prefill_done()  # the first non-empty chunk: prefill is over
        self._chunks += 1
        if self.observer is not None:
            self.observer.on_chunk(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buf = bytearray()
        self._release_body()
        if self.decision is not None:
            d = self.decision
            seen = False
            if self.observer is not None:
                try:
                    seen = self.observer.finish()
                except Exception:
                    log.exception("response observer failed")
            if d.timing is not None and self.observer is not None and self.observer.usage is not None:
                tokens = self.observer.usage.get("completion_tokens")
                d.timing.finished(tokens if type(tokens) is int else None)
            if not seen and self._chunks == 0:  # lean mode: the usage comes by the access log
                self._lean.stream_ended(d.booking.id, self.labels(d.model), d.predicted_cached_tokens)
            else:
                self._lean.response_seen(d.booking.id)
            d.booking.free()
        if self._slot is not None:
            self._slot.leave()
            self._slot = None

    def _release_body(self) -> None:
        if self._held:
            self._bodies.give_back(self._held)
            self._held = 0
