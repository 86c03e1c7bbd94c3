"""One booking per leg: the prefill worker's ends with the context phase, the decode worker's with the request."""

from __future__ import annotations

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.decision import Decision
from epp_extproc.core.exchange import PickerExchange
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import BookingChange, LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.metrics import PickerMetrics

P, D = "10.0.0.1:8000", "10.0.1.1:8000"


def loads(t: LoadTracker) -> dict[str, tuple[int, float, float]]:
    return {a: (ld.inflight, ld.prefill_blocks, ld.decode_blocks) for a, ld in t.loads().items()
            if ld.inflight or ld.prefill_blocks or ld.decode_blocks}


def test_the_prefill_worker_holds_prefill_blocks_and_the_decode_worker_decode_blocks() -> None:
    t = LoadTracker()
    t.book_pair(D, 10.0, P, 6.0)
    assert loads(t) == {P: (1, 6.0, 0.0), D: (1, 0.0, 10.0)}


def test_a_pair_counts_as_one_request_in_flight() -> None:
    t = LoadTracker()
    t.book_pair(D, 10.0, P, 6.0)
    assert t.total_inflight() == 1


def test_the_end_of_the_context_phase_ends_the_prefill_leg_whole() -> None:
    t = LoadTracker()
    b = t.book_pair(D, 10.0, P, 6.0)
    b.prefill_done()
    assert loads(t) == {D: (1, 0.0, 10.0)}


def test_the_end_of_the_request_ends_both_legs() -> None:
    t = LoadTracker()
    t.book_pair(D, 10.0, P, 6.0).free()
    assert loads(t) == {} and t.total_inflight() == 0 and t.bookings() == []


def test_ending_twice_in_any_order_leaves_nothing_and_breaks_nothing() -> None:
    t = LoadTracker()
    b = t.book_pair(D, 10.0, P, 6.0)
    b.free()
    b.prefill_done()
    b.free()
    assert loads(t) == {} and t.total_inflight() == 0


def test_a_gateway_fallback_moves_the_decode_leg_only() -> None:
    t = LoadTracker()
    b = t.book_pair(D, 10.0, P, 6.0)
    b.move("10.0.1.2:8000")
    assert loads(t) == {P: (1, 6.0, 0.0), "10.0.1.2:8000": (1, 0.0, 10.0)}


def test_peers_see_both_legs_booked_and_freed() -> None:
    t = LoadTracker()
    seen: list[BookingChange] = []
    t.add_listener(seen.append)
    b = t.book_pair(D, 10.0, P, 6.0)
    b.prefill_done()
    b.free()
    assert [(c.kind, c.address) for c in seen] == [("book", P), ("book", D), ("free", P), ("free", D)]
    peer = LoadTracker()
    for c in seen[:2]:
        peer.peer_change("a", c)
    assert loads(peer) == {P: (1, 6.0, 0.0), D: (1, 0.0, 10.0)}
    for c in seen[2:]:
        peer.peer_change("a", c)
    assert loads(peer) == {}


def test_lean_mode_s_first_chunk_signal_ends_the_prefill_leg() -> None:
    t = LoadTracker()
    b = t.book_pair(D, 10.0, P, 6.0)
    LeanSignals(t, PickerMetrics()).first_chunk(b.id)
    assert loads(t) == {D: (1, 0.0, 10.0)}


def exchange_with(t: LoadTracker) -> PickerExchange:
    booking = t.book_pair(D, 10.0, P, 6.0)

    async def decide(_: RequestContext) -> Decision:
        return Decision(D, b"{}", booking, prefill=P)

    m = PickerMetrics()
    arriving = InflightGate(8)
    arriving.enter()  # what Picker.open() does before it makes the exchange
    return PickerExchange(decide, BodyBudget(1 << 20, 1 << 24), arriving, InflightGate(8),
                          LeanSignals(t, m), m, knows=lambda a: True, count_rejection=lambda e: None)


async def test_the_first_response_chunk_the_picker_sees_ends_the_prefill_leg() -> None:
    t = LoadTracker()
    ex = exchange_with(t)
    await ex.decide(RequestContext("POST", "/v1/chat/completions", {}, b"{}"))
    ex.response_chunk(b'data: {"choices":[]}\n\n')
    assert loads(t) == {D: (1, 0.0, 10.0)}
    ex.close()
    assert loads(t) == {} and t.total_inflight() == 0


async def test_a_stream_that_ends_before_any_chunk_frees_both_legs() -> None:
    t = LoadTracker()
    ex = exchange_with(t)
    await ex.decide(RequestContext("POST", "/v1/chat/completions", {}, b"{}"))
    ex.close()  # client reset, upstream 503, anything: close() is the single exit
    assert loads(t) == {} and t.total_inflight() == 0
