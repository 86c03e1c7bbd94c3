"""Load booked on each endpoint: by the requests this picker routed, plus what its peer replicas report.

A booking is made at pick time under a picker-minted id. Its prefill part is released when the first
non-empty response chunk arrives (prefill is over), the rest when the response ends or the client goes
away. Bookings are idempotent to release, so every exit path can simply call `free()`.

Replicas: every local change is also handed to the listeners (`add_listener`) as a `BookingChange`, which is
how the replica-sync adapter streams it to the peers. What a peer streams back is held per peer
(`peer_snapshot` / `peer_change` / `drop_peer`) and added into the same per-endpoint totals, so the cost sees
one load: its own bookings plus every peer's. Nothing here knows about the network: when a peer is gone and
for how long its bookings are kept is the adapter's decision; `drop_peer` is the one call that ends them.

Two ways to listen, on purpose: `add_listener` streams this replica's own booking changes (replica sync, held
predictions, the time model key on our booking ids; a peer's ids are minted by the peer and may equal ours),
while `on_release` wakes flow control whenever any load goes down, a peer's included and in bulk
(`drop_peer`), where no change of ours exists. Folding them into one stream would make every local listener
filter out peers' changes to stay correct.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from prometheus_client import Gauge

log = logging.getLogger(__name__)

ChangeKind = Literal["book", "prefill_done", "move", "free"]


@dataclass(slots=True)
class EndpointLoad:
    inflight: int = 0
    prefill_blocks: float = 0.0  # blocks of prompts still being prefilled
    decode_blocks: float = 0.0  # blocks held by every request in flight
    # load on the worker that this picker did not book (other gateways, replicas, direct clients), from
    # its scraped metrics (adapters/worker_metrics.py); priced like decode blocks in core/cost.py
    unbooked_blocks: float = 0.0


@dataclass(frozen=True, slots=True)
class BookingChange:
    """One step in a booking's life, as streamed to peers (`address` is the new one for a move)."""

    kind: ChangeKind
    id: str
    address: str
    prefill_blocks: float = 0.0
    decode_blocks: float = 0.0


@dataclass(slots=True)
class HeldBooking:
    """A booking as a snapshot carries it: enough to rebuild its share of the load elsewhere."""

    id: str
    address: str
    prefill_blocks: float
    decode_blocks: float
    prefilling: bool


BookingListener = Callable[[BookingChange], None]


class Booking:
    """One request's load on one worker. A disaggregated request's booking (on its decode worker) carries
    its prefill leg (`leg`, on the prefill worker): the leg ends when the context phase ends (`prefill_done`)
    or with the request (`free`), whichever comes first, so no path can leave it behind."""

    __slots__ = ("id", "address", "prefill_blocks", "decode_blocks", "_tracker", "_prefilling", "_live", "leg")

    def __init__(self, tracker: LoadTracker, booking_id: str, address: str, prefill_blocks: float,
                 decode_blocks: float) -> None:
        self.id = booking_id
        self.address = address
        self.prefill_blocks = prefill_blocks
        self.decode_blocks = decode_blocks
        self._tracker = tracker
        self._prefilling = True
        self._live = True
        self.leg: Booking | None = None  # the prefill worker's booking of a disaggregated request

    @property
    def prefilling(self) -> bool:
        return self._prefilling

    @property
    def live(self) -> bool:
        return self._live

    def prefill_done(self) -> None:
        """The context phase is over: prefill load ends here, and the prefill worker's leg ends whole."""
        if self.leg is not None:
            self.leg.free()
        if self._prefilling and self._live:
            self._prefilling = False
            self._tracker._release_prefill(self.address, self.prefill_blocks)
            self._tracker._notify(BookingChange("prefill_done", self.id, self.address))

    def move(self, address: str) -> None:
        """The gateway served the request elsewhere (a fallback): carry the load over to where it runs."""
        if not self._live or address == self.address:
            return
        t = self._tracker
        t._sub(self.address, self.prefill_blocks, self.decode_blocks, self._prefilling)
        self.address = address
        t._add(self.address, self.prefill_blocks, self.decode_blocks, self._prefilling)
        t._notify(BookingChange("move", self.id, address))

    def free(self) -> None:
        if self.leg is not None:
            self.leg.free()
        if self._live:
            self._live = False
            t = self._tracker
            t._legs.pop(self.id, None)
            t._bookings.pop(self.id, None)
            t._sub(self.address, self.prefill_blocks, self.decode_blocks, self._prefilling)
            self._prefilling = False
            t._notify(BookingChange("free", self.id, self.address))


class LoadTracker:
    def __init__(self, gauge: Gauge | None = None, *, max_bookings_per_peer: int = 100_000) -> None:
        self._loads: dict[str, EndpointLoad] = {}
        self._bookings: dict[str, Booking] = {}
        self._ids = itertools.count(1)
        self._gauge = gauge
        self._release_listeners: list[Callable[[], None]] = []
        self._listeners: list[BookingListener] = []
        self._remote: dict[str, dict[str, HeldBooking]] = {}
        self._legs: dict[str, Booking] = {}  # live prefill legs (also in `_bookings`: peers must see them)
        self.max_bookings_per_peer = max_bookings_per_peer
        self.peer_bookings_refused = 0  # over the per-peer cap: a peer cannot grow our memory unbounded

    def on_release(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever load goes down (prefill done or a booking freed): flow control
        dispatches queued requests then."""
        self._release_listeners.append(listener)

    def _released(self) -> None:
        for listener in self._release_listeners:
            try:
                listener()
            except Exception:  # a broken listener must not leak a booking
                log.exception("load listener failed")

    # ------------------------------------------------------------------ the view the cost uses

    def load(self, address: str) -> EndpointLoad:
        return self._loads.get(address) or EndpointLoad()

    def booking(self, booking_id: str) -> Booking | None:
        """A live booking by id (lean mode's first-chunk signal names it), None once freed."""
        return self._bookings.get(booking_id)

    def loads(self) -> dict[str, EndpointLoad]:
        """Per endpoint: this replica's bookings plus every peer's."""
        return self._loads

    # ------------------------------------------------------------------ local bookings

    def book(self, address: str, prompt_blocks: float) -> Booking:
        """Book a request; `prompt_blocks` <= 0 (prompt unknown) counts the request as one block."""
        weight = prompt_blocks if prompt_blocks > 0 else 1.0
        return self._book(address, weight, weight)

    def book_pair(self, decode: str, decode_blocks: float, prefill: str, prefill_blocks: float) -> Booking:
        """Book a disaggregated request, one booking per leg (core/contract.py, Roles): the prefill worker
        holds only prefill blocks until the context phase ends; the decode worker holds only decode blocks
        (it computes no prompt) until the request ends. Returns the decode booking, which owns the leg:
        its id is the one handed to Envoy, so lean mode's first-chunk signal ends the leg too."""
        leg = self._book(prefill, prefill_blocks if prefill_blocks > 0 else 1.0, 0.0)
        self._legs[leg.id] = leg
        b = self._book(decode, 0.0, decode_blocks if decode_blocks > 0 else 1.0)
        b._prefilling = False  # nothing of its own to prefill: `prefill_done` only ends the leg
        b.leg = leg
        return b

    def _book(self, address: str, prefill: float, decode: float) -> Booking:
        b = Booking(self, f"epp-{next(self._ids)}", address, prefill, decode)
        self._bookings[b.id] = b
        self._add(address, prefill, decode, True)
        self._notify(BookingChange("book", b.id, address, prefill, decode))
        return b

    def total_inflight(self) -> int:
        """Requests this replica booked (the picker's own overload limit counts these only); a prefill leg
        is part of its request, not one more."""
        return len(self._bookings) - len(self._legs)

    def bookings(self) -> list[HeldBooking]:
        """This replica's live bookings, for a snapshot to a peer that (re)connects."""
        return [HeldBooking(b.id, b.address, b.prefill_blocks, b.decode_blocks, b.prefilling)
                for b in self._bookings.values()]

    def add_listener(self, fn: BookingListener) -> None:
        """`fn` sees every local booking change, synchronously and in order; it must not raise or block."""
        self._listeners.append(fn)

    def _notify(self, change: BookingChange) -> None:
        for fn in self._listeners:
            try:
                fn(change)
            except Exception:  # a broken listener must not break routing
                log.exception("booking listener failed on %s", change)

    # ------------------------------------------------------------------ peers' bookings

    def peer_snapshot(self, peer: str, bookings: Iterable[HeldBooking]) -> None:
        """Everything `peer` holds now: replaces whatever we had from it."""
        self.drop_peer(peer)
        held = self._remote.setdefault(peer, {})
        for hb in bookings:
            self._hold(peer, held, hb)

    def peer_change(self, peer: str, ch: BookingChange) -> None:
        held = self._remote.setdefault(peer, {})
        if ch.kind == "book":
            if ch.id not in held:
                self._hold(peer, held, HeldBooking(ch.id, ch.address, max(ch.prefill_blocks, 0.0),
                                                   max(ch.decode_blocks, 0.0), True))
            return
        hb = held.get(ch.id)
        if hb is None:  # unknown id (e.g. booked before a refused snapshot entry): nothing to undo
            return
        if ch.kind == "prefill_done":
            if hb.prefilling:
                hb.prefilling = False
                self._release_prefill(hb.address, hb.prefill_blocks)
        elif ch.kind == "move":
            if ch.address and ch.address != hb.address:
                self._sub(hb.address, hb.prefill_blocks, hb.decode_blocks, hb.prefilling)
                hb.address = ch.address
                self._add(hb.address, hb.prefill_blocks, hb.decode_blocks, hb.prefilling)
        elif ch.kind == "free":
            del held[ch.id]
            self._sub(hb.address, hb.prefill_blocks, hb.decode_blocks, hb.prefilling)

    def _hold(self, peer: str, held: dict[str, HeldBooking], hb: HeldBooking) -> None:
        if len(held) >= self.max_bookings_per_peer:
            self.peer_bookings_refused += 1
            if self.peer_bookings_refused == 1 or self.peer_bookings_refused % 10_000 == 0:
                log.warning("peer %s holds more than %d bookings: extra ones are ignored (%d so far)", peer,
                            self.max_bookings_per_peer, self.peer_bookings_refused)
            return
        held[hb.id] = hb
        self._add(hb.address, hb.prefill_blocks, hb.decode_blocks, hb.prefilling)

    def drop_peer(self, peer: str) -> int:
        """Forget every booking `peer` reported (it is gone, or a snapshot replaces them); returns how many."""
        held = self._remote.pop(peer, None)
        if not held:
            return 0
        for hb in held.values():
            self._sub(hb.address, hb.prefill_blocks, hb.decode_blocks, hb.prefilling)
        return len(held)

    def peer_inflight(self, peer: str | None = None) -> int:
        """Bookings held for `peer` (all peers when None)."""
        if peer is not None:
            return len(self._remote.get(peer, ()))
        return sum(len(h) for h in self._remote.values())

    def peers(self) -> list[str]:
        return [p for p, h in self._remote.items() if h]

    # ------------------------------------------------------------------ totals

    def _add(self, address: str, prefill: float, decode: float, prefilling: bool) -> None:
        ld = self._loads.setdefault(address, EndpointLoad())
        ld.inflight += 1
        if prefilling:
            ld.prefill_blocks += prefill
        ld.decode_blocks += decode
        if self._gauge is not None:
            self._gauge.labels(address).set(ld.inflight)

    def _release_prefill(self, address: str, prefill: float) -> None:
        ld = self._loads.get(address)
        if ld is not None:
            ld.prefill_blocks = max(0.0, ld.prefill_blocks - prefill)
        self._released()

    def _sub(self, address: str, prefill: float, decode: float, prefilling: bool) -> None:
        ld = self._loads.get(address)
        if ld is None:
            self._released()
            return
        ld.inflight -= 1
        if prefilling:
            ld.prefill_blocks = max(0.0, ld.prefill_blocks - prefill)
        ld.decode_blocks = max(0.0, ld.decode_blocks - decode)
        if ld.inflight <= 0:  # no rounding residue once the endpoint is idle
            ld.inflight, ld.prefill_blocks, ld.decode_blocks = 0, 0.0, 0.0
        if self._gauge is not None:
            self._gauge.labels(address).set(ld.inflight)
        self._released()

    def forget(self, address: str) -> None:
        """An endpoint left: its live bookings still free cleanly, but it no longer shows up."""
        self._loads.pop(address, None)
        if self._gauge is not None:
            try:
                self._gauge.remove(address)
            except KeyError:
                pass
