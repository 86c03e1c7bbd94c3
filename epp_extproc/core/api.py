"""The seam between the protocol edge and the decision: what the ext_proc servicer may call.

The edge depends on these protocols only, so it can be driven by a fake picker in a test with no socket, and
the decision core never sees protobuf. Data flows one way: stream -> request -> propose -> commit -> mutations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from epp_extproc.core.errors import PickError
from epp_extproc.core.request import RequestContext


class Routed(Protocol):
    address: str  # `ip:port` the gateway must send the request to
    body: bytes | None  # the body to forward (None: the request has none)
    # and, optionally, `prefill: str | None`: disaggregated pools' prefill worker `ip:port` (x-prefiller-host-port);
    # absent or None: the destination prefills itself (read with getattr by the edge)

    @property
    def booking_id(self) -> str:
        """Names the request in later signals (lean mode's first chunk and access log)."""
        ...


class Exchange(Protocol):
    """One HTTP request. Every method may be called at most in this order; `close()` always, once."""

    def add_body(self, data: bytes) -> None:
        """Buffer a request-body chunk; raises PickError (too large, budget exhausted)."""

    def body(self) -> bytes:
        """The buffered body, once it is complete."""

    async def decide(self, request: RequestContext) -> Routed:
        """Propose and commit; raises PickError (nothing is booked then)."""

    def reject(self, err: PickError, request: RequestContext) -> None:
        """The edge answers the request itself (counted and logged by the picker)."""

    def served_by(self, address: str) -> None:
        """The gateway reports the endpoint it really served."""

    def response_headers(self, headers: Mapping[str, list[str]]) -> list[tuple[str, str]]:
        """The worker's answer headers went by; returns headers to set on the answer (a session token)."""
        ...

    def response_chunk(self, data: bytes) -> None:
        """A response body chunk went by (the first non-empty one ends prefill)."""

    def close(self) -> None:
        """The stream ended, however it ended: free everything the request held."""


class Picker(Protocol):
    def open(self) -> Exchange:
        """Admit a new request (stream start); raises PickError(OVERLOADED) above the in-flight cap."""

    def count_rejection(self, err: PickError) -> None:
        """A request refused before it had an exchange (admission)."""

    def first_chunk(self, booking_id: str) -> None:
        """Lean mode: the first non-empty response chunk of that request went by."""

    def access_logged(self, booking_id: str, usage_tail: bytes | None, flags: list[str]) -> None:
        """Lean mode: the request ended; its usage (the answer's tail from `"usage"` on) and Envoy's flags."""
