"""Load booked on each endpoint by the requests this picker routed.

A booking is made at pick time under a picker-minted id. Its prefill part is released when the first
non-empty response chunk arrives (prefill is over), the rest when the response ends or the client goes
away. Bookings are idempotent to release, so every exit path can simply call `free()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from prometheus_client import Gauge


@dataclass(slots=True)
class EndpointLoad:
    inflight: int = 0
    prefill_blocks: float = 0.0  # blocks of prompts still being prefilled
    decode_blocks: float = 0.0  # blocks held by every request in flight


class Booking:
    __slots__ = ("id", "address", "prefill_blocks", "decode_blocks", "_tracker", "_prefilling", "_live")

    def __init__(self, tracker: LoadTracker, booking_id: str, address: str, prefill_blocks: float,
                 decode_blocks: float) -> None:
        self.id = booking_id
        self.address = address
        self.prefill_blocks = prefill_blocks
        self.decode_blocks = decode_blocks
        self._tracker = tracker
        self._prefilling = True
        self._live = True

    def prefill_done(self) -> None:
        if self._prefilling and self._live:
            self._prefilling = False
            self._tracker._release_prefill(self)

    def move(self, address: str) -> None:
        """The gateway served the request elsewhere (a fallback): carry the load over to where it runs."""
        if not self._live or address == self.address:
            return
        prefilling = self._prefilling
        self._tracker._release(self, prefilling)
        self.address = address
        self._tracker._add(self, prefilling)

    def free(self) -> None:
        if self._live:
            self._live = False
            self._tracker._release(self, self._prefilling)
            self._prefilling = False


class LoadTracker:
    def __init__(self, gauge: Gauge | None = None) -> None:
        self._loads: dict[str, EndpointLoad] = {}
        self._bookings: dict[str, Booking] = {}
        self._ids = itertools.count(1)
        self._gauge = gauge

    def load(self, address: str) -> EndpointLoad:
        return self._loads.get(address) or EndpointLoad()

    def booking(self, booking_id: str) -> Booking | None:
        """A live booking by id (lean mode's first-chunk signal names it), None once freed."""
        return self._bookings.get(booking_id)

    def loads(self) -> dict[str, EndpointLoad]:
        return self._loads

    def book(self, address: str, prompt_blocks: float) -> Booking:
        """Book a request; `prompt_blocks` <= 0 (prompt unknown) counts the request as one block."""
        weight = prompt_blocks if prompt_blocks > 0 else 1.0
        b = Booking(self, f"epp-{next(self._ids)}", address, weight, weight)
        self._add(b, True)
        return b

    def _add(self, b: Booking, prefilling: bool) -> None:
        ld = self._loads.setdefault(b.address, EndpointLoad())
        ld.inflight += 1
        if prefilling:
            ld.prefill_blocks += b.prefill_blocks
        ld.decode_blocks += b.decode_blocks
        self._bookings[b.id] = b
        if self._gauge is not None:
            self._gauge.labels(b.address).set(ld.inflight)

    def _release_prefill(self, b: Booking) -> None:
        ld = self._loads.get(b.address)
        if ld is not None:
            ld.prefill_blocks = max(0.0, ld.prefill_blocks - b.prefill_blocks)

    def _release(self, b: Booking, prefilling: bool) -> None:
        self._bookings.pop(b.id, None)
        ld = self._loads.get(b.address)
        if ld is None:
            return
        ld.inflight -= 1
        if prefilling:
            ld.prefill_blocks = max(0.0, ld.prefill_blocks - b.prefill_blocks)
        ld.decode_blocks = max(0.0, ld.decode_blocks - b.decode_blocks)
        if ld.inflight <= 0:  # no rounding residue once the endpoint is idle
            ld.inflight, ld.prefill_blocks, ld.decode_blocks = 0, 0.0, 0.0
        if self._gauge is not None:
            self._gauge.labels(b.address).set(ld.inflight)

    def total_inflight(self) -> int:
        return len(self._bookings)

    def forget(self, address: str) -> None:
        """An endpoint left: its live bookings still free cleanly, but it no longer shows up."""
        self._loads.pop(address, None)
        if self._gauge is not None:
            try:
                self._gauge.remove(address)
            except KeyError:
                pass
