"""A committed pick, as everything after the decision sees it (the exchange, the usage observer, the edge).

A leaf module: the decision's result must be importable by whoever reads it without importing whoever makes
it (the pipeline), which is what kept `exchange` <-> `pipeline` <-> `usage` in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from epp_extproc.core.contract import BookingHandle


class Stopwatch(Protocol):
    """What the exchange reports of a response's timing (core/time_cost.Observation learns from it)."""

    def first_chunk(self) -> None: ...

    def finished(self, completion_tokens: int | None) -> None: ...


@dataclass(slots=True)
class Decision:
    """Where the request goes, what is forwarded, and the load it holds there until it ends."""

    address: str
    body: bytes | None  # the body to forward (None: the request has none)
    booking: BookingHandle
    model: str | None = None
    predicted_cached_tokens: int | None = None
    session: bool = False  # the client opted in to session affinity: its answer carries a new token
    prefill: str | None = None  # disaggregated: the prefill worker's `ip:port` (x-prefiller-host-port)
    timing: Stopwatch | None = None  # --cost-model time: the first chunk and the end teach the worker's model

    @property
    def booking_id(self) -> str:
        return self.booking.id
