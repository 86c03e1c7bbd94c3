"""The flow-control queue: hold requests in the picker while every worker is saturated, release them in
order (priority bands, round robin between fairness ids inside a band, FIFO inside one fairness id), and
answer the ones it drops with GAIE's `x-llm-d-request-dropped-reason`.

A request waits at most `ttl_s` (then 429, or 503 when the pool has no endpoint at all); a sheddable request
(priority < 0) is never queued: 429 at once while saturated. A client that goes away while queued (its task
is cancelled) leaves nothing behind. Saturation is judged by core/saturation.py, the flow key by
core/flow_objectives.py.

Why queue in the picker at all: without it, every request goes straight to a worker even when all of them are
full, and the queue builds inside the engines, where nothing can reorder it by priority or share it fairly
between tenants. The semantics follow the Gateway API Inference Extension (GAIE) / llm-d flow control.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.flow_objectives import FlowKey
from epp_extproc.core.saturation import SaturationDetector

log = logging.getLogger(__name__)

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
MAX_SERVED_FLOWS = 1024

# why a request was not dispatched (the header value is GAIE's; the key is our metric label)
REASON_SATURATED = "rejected-saturated"  # sheddable while saturated, or queue full
REASON_TTL = "rejected-ttl-expired"
REASON_NO_ENDPOINTS = "rejected-no-endpoints"
REASON_SHUTDOWN = "rejected-shutting-down"


_PROBLEM = {REASON_SATURATED: Problem.FLOW_SATURATED, REASON_TTL: Problem.FLOW_TTL_EXPIRED,
            REASON_NO_ENDPOINTS: Problem.NO_ENDPOINT, REASON_SHUTDOWN: Problem.FLOW_SHUTDOWN}


def FlowRejection(reason: str, message: str) -> PickError:  # noqa: N802 - reads like the exception it builds
    """A flow-control answer: the fact (envoy/errors.py maps it: 429 saturated / TTL, 503 no endpoint or
    shutdown) plus the headers saying why, as llm-d sends them."""
    return PickError(_PROBLEM[reason], message,
                     headers=((DROPPED_REASON_HEADER, reason), ("retry-after", "1")))


def reason_of(err: PickError) -> str | None:
    """The dropped-reason a flow-control PickError carries (None for any other error)."""
    return next((v for k, v in err.headers if k == DROPPED_REASON_HEADER), None)




@dataclass(eq=False, slots=True)
class _Item:
    key: FlowKey
    subset: frozenset[str] | None
    enqueued: float
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Band:
    """One priority: a FIFO per fairness id, served round robin (one request per turn)."""

    __slots__ = ("priority", "flows", "turns", "size")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, deque[_Item]] = {}
        self.turns: deque[str] = deque()  # flows with items, next turn first
        self.size = 0

    def push(self, item: _Item) -> None:
        q = self.flows.get(item.key.fairness_id)
        if q is None:
            q = self.flows[item.key.fairness_id] = deque()
            self.turns.append(item.key.fairness_id)
        q.append(item)
        self.size += 1

    def remove(self, item: _Item) -> bool:
        q = self.flows.get(item.key.fairness_id)
        if q is None:
            return False
        try:
            q.remove(item)
        except ValueError:
            return False
        self.size -= 1
        if not q:
            del self.flows[item.key.fairness_id]
            self.turns.remove(item.key.fairness_id)
        return True

    def pop_next(self, can_go: Callable[[_Item], bool]) -> _Item | None:
        """The head of the next flow in turn whose head may go; that flow moves to the back of the turn."""
        for _ in range(len(self.turns)):
            fid = self.turns[0]
            q = self.flows[fid]
            if can_go(q[0]):
                item = q.popleft()
                self.size -= 1
                self.turns.popleft()
                if q:
                    self.turns.append(fid)
                else:
                    del self.flows[fid]
                return item
            self.turns.rotate(-1)  # its head cannot go anywhere now: let the next flow try
        return None

    def newest(self) -> _Item | None:
        """The most recently queued item of the band: the one displaced when the queue is full."""
        best: _Item | None = None
        for q in self.flows.values():
            if best is None or q[-1].enqueued > best.enqueued:
                best = q[-1]
        return best


class Ticket:
    """An admission: hold it while the request is scored and booked, then `release()` (idempotent).

    Until released it counts against the pool's headroom, so requests admitted together (before any of
    them has booked) cannot overshoot it.
    """

    __slots__ = ("_fc", "_live", "waited_s")

    def __init__(self, fc: FlowController | None, waited_s: float = 0.0) -> None:
        self._fc = fc
        self._live = fc is not None
        self.waited_s = waited_s

    def release(self) -> None:
        if self._live:
            self._live = False
            assert self._fc is not None
            self._fc._ticket_done()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class FlowMetrics:
    """The counters the controller feeds; a no-op default keeps the core free of prometheus wiring."""

    def queued(self, priority: int, size: int) -> None: ...
    def dispatched(self, priority: int, waited_s: float) -> None: ...
    def rejected(self, priority: int, reason: str, waited_s: float) -> None: ...
    def saturated(self, saturated: bool) -> None: ...


class FlowController:
    """Admission between propose and commit. `admit()` returns a Ticket or raises a flow-control PickError."""

    def __init__(self, detector: SaturationDetector, addresses: Callable[[], Sequence[str]], *,
                 ttl_s: float = 30.0, max_queued: int = 512, metrics: FlowMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.detector = detector
        self._addresses = addresses  # the routable endpoints now
        self.ttl_s = ttl_s
        self.max_queued = max_queued
        self.metrics = metrics or FlowMetrics()
        self.clock = clock
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # band priorities, highest first
        self.size = 0
        self.pending = 0  # admitted, not yet released (scoring / booking in progress)
        # dispatches per (band, fairness id), for /debug/flow and the fairness benchmark; bounded: the
        # oldest entry goes when a new flow would exceed the cap (ids are client-chosen)
        self.served: dict[tuple[int, str], int] = {}
        self.closed = False
        self._saturated = False

    # ------------------------------------------------------------------ admission
    async def admit(self, key: FlowKey, subset: Sequence[str] | None = None) -> Ticket:
        subset_set = frozenset(subset) if subset is not None else None
        if not self._eligible(subset_set):
            self._reject_count(key.priority, REASON_NO_ENDPOINTS, 0.0)
            raise FlowRejection(REASON_NO_ENDPOINTS, "no endpoint available")
        if self.closed:
            self._reject_count(key.priority, REASON_SHUTDOWN, 0.0)
            raise FlowRejection(REASON_SHUTDOWN, "endpoint picker shutting down")
        item = _Item(key, subset_set, self.clock())
        if self.size >= self.max_queued and not self._displace_for(key.priority):
            self._reject_count(key.priority, REASON_SATURATED, 0.0)
            raise FlowRejection(REASON_SATURATED, "inference pool saturated: flow-control queue full")
        self._push(item)
        self.dispatch()
        if not item.future.done() and key.priority < 0:  # sheddable: never waits
            self._remove(item)
            self._reject_count(key.priority, REASON_SATURATED, 0.0)
            raise FlowRejection(REASON_SATURATED, "inference pool saturated: sheddable request rejected")
        return await self._wait(item)

    async def _wait(self, item: _Item) -> Ticket:
        try:
            if not item.future.done():
                await asyncio.wait((item.future,), timeout=max(0.0, item.enqueued + self.ttl_s - self.clock()))
        except asyncio.CancelledError:  # the client went away while queued
            if item.future.done() and not item.future.cancelled() and item.future.exception() is None:
                self._ticket_done()  # granted at the same instant: give the headroom back
            else:
                self._remove(item)
                item.future.cancel()
            self._reject_count(item.key.priority, "client_cancelled", self.clock() - item.enqueued)
            raise
        waited = self.clock() - item.enqueued
        if item.future.done():
            exc = item.future.exception()
            if exc is not None:  # evicted (displaced by a higher band, or shutdown)
                raise exc
            return Ticket(self, waited)
        self._remove(item)
        item.future.cancel()
        if not self._eligible(item.subset):
            self._reject_count(item.key.priority, REASON_NO_ENDPOINTS, waited)
            raise FlowRejection(REASON_NO_ENDPOINTS,
                                "request timed out in queue and no endpoint is available")
        self._reject_count(item.key.priority, REASON_TTL, waited)
        raise FlowRejection(REASON_TTL, f"inference pool saturated: request waited {waited:.1f}s in the queue")

    def _displace_for(self, priority: int) -> bool:
        """Queue full: a request may take the place of the newest request of a strictly lower band."""
        for p in reversed(self._order):
            if p >= priority:
                return False
            victim = self._bands[p].newest()
            if victim is not None:
                self._remove(victim)
                waited = self.clock() - victim.enqueued
                self._reject_count(p, REASON_SATURATED, waited)
                victim.future.set_exception(FlowRejection(
                    REASON_SATURATED, "inference pool saturated: displaced by a higher-priority request"))
                return True
        return False

    # ------------------------------------------------------------------ dispatch
    def dispatch(self) -> int:
        """Grant queued requests while the pool has headroom, highest band first. Call whenever headroom
        may have grown: a new scrape, a booking freed or past prefill, an endpoint added, a ticket released.
        """
        granted = 0
        if self.size == 0:
            self._set_saturated(self._room(None) <= 0)
            return 0
        rooms: dict[frozenset[str] | None, int] = {}

        def can_go(item: _Item) -> bool:
            if item.subset not in rooms:
                rooms[item.subset] = self._room(item.subset)
            return rooms[item.subset] > 0

        while self.size:
            item = None
            for p in self._order:
                item = self._bands[p].pop_next(can_go)
                if item is not None:
                    break
            if item is None:
                break
            self._popped(item)
            if item.future.done():  # cancelled between its last check and now
                continue
            self.pending += 1
            item.future.set_result(None)
            granted += 1
            self.metrics.dispatched(item.key.priority, self.clock() - item.enqueued)
            self._count_served(item.key)
            rooms = {k: v - 1 for k, v in rooms.items()}  # headroom is shared; recompute lazily per subset
        self._set_saturated(self.size > 0)
        return granted

    def _room(self, subset: frozenset[str] | None) -> int:
        addrs = self._addrs(subset)
        return self.detector.headroom(addrs) - self.pending

    def _addrs(self, subset: frozenset[str] | None) -> list[str]:
        addrs = list(self._addresses())
        return addrs if subset is None else [a for a in addrs if a in subset]

    def _eligible(self, subset: frozenset[str] | None) -> bool:
        return bool(self._addrs(subset))

    def _count_served(self, key: FlowKey) -> None:
        k = (key.priority, key.fairness_id)
        n = self.served.pop(k, 0) + 1
        if len(self.served) >= MAX_SERVED_FLOWS:
            del self.served[next(iter(self.served))]
        self.served[k] = n  # re-inserted: the dict stays ordered by last dispatch

    def _ticket_done(self) -> None:
        self.pending = max(0, self.pending - 1)
        self.dispatch()

    # ------------------------------------------------------------------ bookkeeping
    def _push(self, item: _Item) -> None:
        p = item.key.priority
        band = self._bands.get(p)
        if band is None:
            band = self._bands[p] = _Band(p)
            self._order = sorted(self._bands, reverse=True)
        band.push(item)
        self.size += 1
        self.metrics.queued(p, band.size)

    def _popped(self, item: _Item) -> None:
        self.size -= 1
        self._gc_band(item.key.priority)

    def _remove(self, item: _Item) -> None:
        band = self._bands.get(item.key.priority)
        if band is not None and band.remove(item):
            self.size -= 1
            self._gc_band(item.key.priority)

    def _gc_band(self, p: int) -> None:
        band = self._bands.get(p)
        if band is None:
            return
        self.metrics.queued(p, band.size)
        if band.size == 0:  # empty bands go, so client-chosen objectives cannot grow the map
            del self._bands[p]
            self._order = sorted(self._bands, reverse=True)

    def _reject_count(self, priority: int, reason: str, waited_s: float) -> None:
        self.metrics.rejected(priority, reason, waited_s)

    def _set_saturated(self, saturated: bool) -> None:
        if saturated != self._saturated:
            self._saturated = saturated
            self.metrics.saturated(saturated)

    def close(self) -> None:
        """Shutdown: every queued request gets 503 (rejected-shutting-down) instead of hanging."""
        self.closed = True
        for band in list(self._bands.values()):
            for q in list(band.flows.values()):
                for item in list(q):
                    self._remove(item)
                    if not item.future.done():
                        self._reject_count(item.key.priority, REASON_SHUTDOWN, self.clock() - item.enqueued)
                        item.future.set_exception(FlowRejection(REASON_SHUTDOWN,
                                                                "endpoint picker shutting down"))

    def snapshot(self) -> dict[str, object]:
        bands = {str(p): {"queued": b.size, "flows": {f: len(q) for f, q in b.flows.items()}}
                 for p, b in self._bands.items()}
        served = [{"priority": p, "flow": f, "dispatched": n} for (p, f), n in self.served.items()]
        return {"queued": self.size, "pending": self.pending, "saturated": self._saturated, "bands": bands,
                "dispatched": served}
