"""One request's life inside the picker, as the edge sees it: body in, decision out, response observed.

The edge (`envoy/extproc.py`) drives an exchange through the `Exchange` protocol (`core/api.py`) and never
touches bookings, observers or counters itself. `close()` is the single exit: whatever happened on the
stream (routed, rejected, client gone, Envoy gone), it frees the booking, the body bytes and the in-flight
slot exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.pipeline import Decision
from epp_extproc.core.request import RequestContext, clip
from epp_extproc.core.usage import ModelLabels, UsageObserver

if TYPE_CHECKING:
    from epp_extproc.core.pipeline import Pipeline

log = logging.getLogger(__name__)


class PickerExchange:
    __slots__ = ("_pipe", "_buf", "_held", "_deciding", "decision", "observer", "_closed", "_chunks")

    labels = ModelLabels()  # bounded model label values, shared by every exchange of the process

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._buf = bytearray()  # grows in place: tiny chunks cost their bytes, not an object each
        self._held = 0  # body bytes accounted in the pipeline's BodyBudget
        self._deciding = False
        self.decision: Decision | None = None
        self.observer: UsageObserver | None = None
        self._closed = False
        self._chunks = 0  # response body chunks seen on this stream (none in lean mode)

    # ------------------------------------------------------------ request
    def add_body(self, data: bytes) -> None:
        self._pipe.bodies.take(self._held, len(data))
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
            p, ticket = await self._pipe.admit(await self._pipe.propose(request), request)  # flow control
            self.decision = self._pipe.commit(p)
            if ticket is not None:
                ticket.release()  # booked: the worker's load now counts it
        finally:
            self._release_body()
        self.observer = UsageObserver(self.decision, self._pipe.metrics, self.labels)
        return self.decision

    def reject(self, err: PickError, request: RequestContext) -> None:
        """The edge answers this request itself: count it and say why, once, with a bounded line."""
        self._pipe.count_rejection(err)
        log.info("rejected %s %s: %s", clip(request.method, 16), clip(request.path), clip(str(err), 300))

    # ------------------------------------------------------------ response
    def served_by(self, address: str) -> None:
        """The gateway reports it served another endpoint (a fallback): move the booking if we know it."""
        d = self.decision
        if d is not None and address and address != d.address and address in self._pipe.registry:
            log.info("gateway served %s instead of %s; moving the booking", clip(address, 64), d.address)
            d.booking.move(address)

    def response_headers(self, headers: Mapping[str, list[str]]) -> None:
        if self.observer is not None:
            self.observer.on_headers(headers)

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
            if not seen and self._chunks == 0:  # lean mode: the usage comes by the access log
                self._pipe.stream_ended_without_usage(d.booking.id, self.labels(d.model), d.predicted_cached_tokens)
            else:
                self._pipe.late_usage.take_early(d.booking.id)  # an entry the stream's own usage made moot
            d.booking.free()
        self._pipe.gate.leave()

    def _release_body(self) -> None:
        if self._held:
            self._pipe.bodies.give_back(self._held)
            self._held = 0
