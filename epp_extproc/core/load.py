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
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from prometheus_client import Gauge

log = logging.getLogger(__name__)

ChangeKind = Literal["book", "prefill_done", "move", "free"]
# (peer replica that holds the booking or None when no peer is known to, booking id): lean mode's first-chunk
# signal for a booking this replica did not make, to be handed to the replica that made it (`first_chunk_elsewhere`)
FirstChunkForwarder = Callable[[str | None, str], None]


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


class LoadColumns:
    """The per-endpoint totals of `EndpointLoad` as arrays, one row per endpoint, kept current by the tracker.

    Why: a decision over a thousand workers gathers its candidates' load with one fancy index per column
    (`prefill[rows]`) instead of reading a thousand objects in Python (issue 45). Row 0 is every endpoint
    that holds no load (all zeros, never written); a row freed by `forget` is zeroed and reused. `generation`
    changes whenever an address gains or loses its row, so a cached address -> row mapping knows when it is
    stale (the arrays themselves may be replaced when they grow: read them through this object).
    """

    __slots__ = ("rows", "inflight", "prefill", "decode", "unbooked", "generation", "_free", "_next")

    def __init__(self, capacity: int = 64) -> None:
        self.rows: dict[str, int] = {}
        self.inflight = np.zeros(capacity, np.float64)
        self.prefill = np.zeros(capacity, np.float64)
        self.decode = np.zeros(capacity, np.float64)
        self.unbooked = np.zeros(capacity, np.float64)
        self.generation = 0
        self._free: list[int] = []
        self._next = 1

    def row(self, address: str) -> int:
        """The address's row, given one if it has none."""
        r = self.rows.get(address)
        if r is None:
            if self._free:
                r = self._free.pop()
            else:
                r = self._next
                self._next += 1
                if r >= len(self.prefill):
                    self._grow(2 * len(self.prefill))
            self.rows[address] = r
            self.generation += 1
        return r

    def _grow(self, n: int) -> None:
        for name in ("inflight", "prefill", "decode", "unbooked"):
            old = getattr(self, name)
            new = np.zeros(n, np.float64)
            new[:len(old)] = old
            setattr(self, name, new)

    def write(self, address: str, ld: EndpointLoad) -> None:
        """Copy one endpoint's totals into its row (after every change the tracker makes to them)."""
        r = self.row(address)
        self.inflight[r] = ld.inflight
        self.prefill[r] = ld.prefill_blocks
        self.decode[r] = ld.decode_blocks
        self.unbooked[r] = ld.unbooked_blocks

    def drop(self, address: str) -> None:
        r = self.rows.pop(address, None)
        if r is not None:
            self.inflight[r] = self.prefill[r] = self.decode[r] = self.unbooked[r] = 0.0
            self._free.append(r)
            self.generation += 1

    def rows_of(self, addresses: Sequence[str]) -> np.ndarray:
        """The rows of `addresses`, in order (0, all zeros, for an address that holds no load)."""
        get = self.rows.get
        return np.fromiter((get(a, 0) for a in addresses), np.intp, len(addresses))


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
    def __init__(self, gauge: Gauge | None = None, *, max_bookings_per_peer: int = 100_000,
                 id_prefix: str | None = None) -> None:
        self._loads: dict[str, EndpointLoad] = {}
        self._bookings: dict[str, Booking] = {}
        self._ids = itertools.count(1)
        # Booking ids are unique across replicas (random per process unless given): lean mode's first-chunk
        # signal names a booking on a stream Envoy may open to ANOTHER replica, which must never take it for
        # one of its own (with a bare counter, replicas' "epp-57" collided and the wrong booking lost its prefill)
        self.id_prefix = id_prefix if id_prefix is not None else f"{random.getrandbits(32):08x}"
        self._forwarders: list[FirstChunkForwarder] = []
        self._gauge = gauge
        self._release_listeners: list[Callable[[], None]] = []
        self._listeners: list[BookingListener] = []
        self._remote: dict[str, dict[str, HeldBooking]] = {}
        self._legs: dict[str, Booking] = {}  # live prefill legs (also in `_bookings`: peers must see them)
        self.max_bookings_per_peer = max_bookings_per_peer
        self.peer_bookings_refused = 0  # over the per-peer cap: a peer cannot grow our memory unbounded
        # the same totals as arrays (a large pool's decision reads these); every change below writes both
        self.columns = LoadColumns()

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

    def set_unbooked(self, address: str, blocks: float) -> None:
        """Load on the worker this picker did not book (adapters/worker_metrics.py): the one figure set from
        outside the bookings. Set it here, never on the `EndpointLoad` itself, so the columns follow."""
        ld = self._loads.get(address)
        if ld is None:
            if blocks <= 0:
                return
            ld = self._loads[address] = EndpointLoad()
        ld.unbooked_blocks = blocks
        self.columns.write(address, ld)

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
        b = Booking(self, f"epp-{self.id_prefix}-{next(self._ids)}", address, prefill, decode)
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

    def add_first_chunk_forwarder(self, fn: FirstChunkForwarder) -> None:
        """`fn` is handed the first-chunk signals of bookings this replica did not make (replica sync sends
        them to the replica that did); it must not raise or block."""
        self._forwarders.append(fn)

    def first_chunk_elsewhere(self, booking_id: str) -> bool:
        """Lean mode's first-chunk signal named a booking that is not ours: Envoy round-robins each ext_proc
        stream on its own, so the observer stream of a request lands on another replica than its main stream
        (with 3 replicas and one Envoy, every time). A peer's booking we hold loses its prefill here at once,
        and the signal goes to the forwarders (replica sync), so the replica that made the booking ends its
        prefill too, and with it its TTFT sample and held prediction. Without that, the booking kept its
        prefill blocks (weighted `prefillLoadScale`, 8 by default) until the request ended. False when there is
        nothing to do: no peer holds it and no forwarder is there to ask."""
        if booking_id.startswith(f"epp-{self.id_prefix}-"):
            return False  # ours, already freed (its stream ended first): nothing is left to end
        owner: str | None = None
        for peer, held in self._remote.items():
            hb = held.get(booking_id)
            if hb is not None:
                owner = peer
                if hb.prefilling:
                    hb.prefilling = False
                    self._release_prefill(hb.address, hb.prefill_blocks)
                break
        if not self._forwarders:
            return owner is not None
        for fn in self._forwarders:  # not held (its booking not seen yet): every peer is asked, its owner acts
            try:
                fn(owner, booking_id)
            except Exception:
                log.exception("first-chunk forwarder failed on %s", booking_id)
        return True

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
        self.columns.write(address, ld)
        if self._gauge is not None:
            self._gauge.labels(address).set(ld.inflight)

    def _release_prefill(self, address: str, prefill: float) -> None:
        ld = self._loads.get(address)
        if ld is not None:
            ld.prefill_blocks = max(0.0, ld.prefill_blocks - prefill)
            self.columns.write(address, ld)
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
        self.columns.write(address, ld)
        if self._gauge is not None:
            self._gauge.labels(address).set(ld.inflight)
        self._released()

    def forget(self, address: str) -> None:
        """An endpoint left: its live bookings still free cleanly, but it no longer shows up."""
        self._loads.pop(address, None)
        self.columns.drop(address)
        if self._gauge is not None:
            try:
                self._gauge.remove(address)
            except KeyError:
                pass
