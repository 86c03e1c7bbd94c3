"""Lean mode's two signals, matched to the requests they name: the first chunk and the access-log usage.

In lean mode no response chunk crosses the picker's stream: Envoy's observer stream reports the first chunk
and its gRPC access log reports how the request ended, each naming the booking id the picker handed out. The
two arrive on other streams than the request's own, in no guaranteed order, so what must be compared with
the usage waits in `LateUsage` (bounded in count and time) until its other half arrives.
"""

from __future__ import annotations

from epp_extproc.core.contract import Bookings
from epp_extproc.core.late_usage import LateUsage
from epp_extproc.core.usage import record_usage, usage_from_tail
from epp_extproc.metrics import PickerMetrics


class LeanSignals:
    def __init__(self, bookings: Bookings, metrics: PickerMetrics, late_usage: LateUsage | None = None) -> None:
        self.bookings = bookings
        self.metrics = metrics
        self.late_usage = late_usage or LateUsage()

    def first_chunk(self, booking_id: str) -> None:
        """The observer stream saw the first non-empty response chunk of this booking: prefill is over."""
        b = self.bookings.booking(booking_id)
        if b is not None:
            b.prefill_done()
            self.metrics.lean_signals.labels("first_chunk").inc()
        elif self.bookings.first_chunk_elsewhere(booking_id):  # another replica's request: handed to it
            self.metrics.lean_signals.labels("first_chunk_forwarded").inc()
        else:
            self.metrics.lean_signals.labels("first_chunk_unknown").inc()

    def access_logged(self, booking_id: str, usage_tail: bytes | None, flags: list[str]) -> None:
        """Envoy's access log reports how a request ended and, when it had one, its usage."""
        for f in flags:
            self.metrics.response_flags.labels(f).inc()
        pending = self.late_usage.take(booking_id)
        if pending is None:
            if self.bookings.booking(booking_id) is not None:  # its stream has not ended yet: wait for it
                self.late_usage.hold_early(booking_id, usage_tail)
                self.metrics.lean_signals.labels("access_log_early").inc()
            else:
                self.metrics.lean_signals.labels("access_log_unmatched").inc()
            return
        self._logged_usage(pending.model, pending.predicted_cached_tokens, usage_tail)

    def stream_ended(self, booking_id: str, model: str, predicted: int | None) -> None:
        """The request's stream ended without its response crossing it: the usage comes by the access log,
        or came already."""
        found, usage_tail = self.late_usage.take_early(booking_id)
        if found:
            self._logged_usage(model, predicted, usage_tail)
        else:
            self.late_usage.park(booking_id, model, predicted)

    def response_seen(self, booking_id: str) -> None:
        """The request's stream carried its response: an access-log entry that came early is moot."""
        self.late_usage.take_early(booking_id)

    def _logged_usage(self, model: str, predicted: int | None, usage_tail: bytes | None) -> None:
        usage = usage_from_tail(usage_tail) if usage_tail else None
        if usage is None:
            self.metrics.lean_signals.labels("access_log_no_usage").inc()
            return
        self.metrics.lean_signals.labels("access_log_usage").inc()
        record_usage(self.metrics, model, predicted, usage, "access_log")
