"""The picker the edge talks to: a request's slot, body bytes and booking live exactly as long as its exchange."""

from __future__ import annotations

import json

import pytest

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.picker import Picker
from epp_extproc.core.request import RequestContext
from tests.scheduling_fakes import make

USAGE = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
         "prompt_tokens_details": {"cached_tokens": 64}}


def picker(cap: int = 2, arriving: int = 8) -> Picker:
    pipe, _, _ = make()
    return Picker(pipe, gate=InflightGate(cap), arriving=InflightGate(arriving),
                  bodies=BodyBudget(1 << 20, 1 << 24), lean=LeanSignals(pipe.load, pipe.metrics))


def signal(p: Picker, name: str) -> float:
    return p.metrics.lean_signals.labels(name)._value.get()


def chat(body: bytes) -> RequestContext:
    return RequestContext("POST", "/v1/chat/completions", {}, body)


def test_streams_beyond_the_arriving_cap_are_refused_until_one_closes() -> None:
    p = picker(cap=1, arriving=1)
    first = p.open()
    with pytest.raises(PickError) as e:
        p.open()
    assert e.value.problem is Problem.OVERLOADED
    first.close()
    p.open().close()
    assert p.open_requests == 0


async def test_stalled_streams_do_not_take_the_slots_of_whole_requests() -> None:
    p = picker(cap=2, arriving=8)
    stalled = [p.open() for _ in range(7)]  # headers sent, body never finished
    for _ in range(2):
        ex = p.open()
        await ex.decide(chat(b'{"messages":[]}'))  # whole: decided although 7 streams stall
    assert (p.arriving.count, p.gate.count) == (7, 2)
    for ex in stalled:
        ex.close()
    assert p.arriving.count == 0


async def test_a_whole_request_over_the_in_flight_cap_is_refused_and_holds_no_slot() -> None:
    p = picker(cap=1)
    first = p.open()
    await first.decide(chat(b'{"messages":[]}'))
    second = p.open()
    with pytest.raises(PickError) as e:
        await second.decide(chat(b'{"messages":[]}'))
    assert e.value.problem is Problem.OVERLOADED and p.director.load.total_inflight() == 1
    second.close()
    first.close()
    assert p.open_requests == 0 and p.director.load.total_inflight() == 0


async def test_close_frees_the_booking_the_body_bytes_and_the_slot_exactly_once() -> None:
    p = picker()
    ex = p.open()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    ex.add_body(body)
    assert p.bodies.used == len(body)
    d = await ex.decide(chat(ex.body()))
    assert p.bodies.used == 0 and p.director.load.total_inflight() == 1 and p.gate.count == 1
    assert p.arriving.count == 0
    ex.close()
    ex.close()
    assert p.director.load.total_inflight() == 0 and p.open_requests == 0
    assert p.director.load.booking(d.booking_id) is None


async def test_a_second_request_on_one_stream_is_a_protocol_error_and_books_nothing_more() -> None:
    p = picker()
    ex = p.open()
    await ex.decide(chat(b'{"messages":[]}'))
    with pytest.raises(PickError) as e:
        await ex.decide(chat(b'{"messages":[]}'))
    assert e.value.problem is Problem.PROTOCOL and p.director.load.total_inflight() == 1
    ex.close()


async def test_lean_usage_logged_before_the_stream_ends_is_applied_when_it_ends() -> None:
    p = picker()
    ex = p.open()
    d = await ex.decide(chat(b'{"messages":[]}'))
    p.access_logged(d.booking_id, b'"usage":' + json.dumps(USAGE).encode() + b"}", [])
    assert signal(p, "access_log_early") == 1 and signal(p, "access_log_usage") == 0
    ex.close()  # no chunk crossed this stream: lean mode
    assert signal(p, "access_log_usage") == 1 and len(p.lean.late_usage) == 0


async def test_lean_usage_logged_after_the_stream_ended_is_matched_to_its_request() -> None:
    p = picker()
    ex = p.open()
    d = await ex.decide(chat(b'{"messages":[]}'))
    p.first_chunk(d.booking_id)
    assert signal(p, "first_chunk") == 1 and not p.director.load.booking(d.booking_id).prefilling
    ex.close()
    assert len(p.lean.late_usage) == 1
    p.access_logged(d.booking_id, b'"usage":' + json.dumps(USAGE).encode() + b"}", ["UpstreamReset"])
    assert signal(p, "access_log_usage") == 1 and len(p.lean.late_usage) == 0


async def test_an_early_access_log_entry_is_dropped_when_the_stream_carried_the_response() -> None:
    p = picker()
    ex = p.open()
    d = await ex.decide(chat(b'{"messages":[]}'))
    p.access_logged(d.booking_id, None, [])
    ex.response_headers({":status": ["200"], "content-type": ["application/json"]})
    ex.response_chunk(json.dumps({"usage": USAGE}).encode())
    ex.close()
    assert len(p.lean.late_usage) == 0 and signal(p, "access_log_usage") == 0


async def test_the_gauges_read_both_caps_and_the_body_budget_when_scraped() -> None:
    from epp_extproc.metrics import PickerMetrics

    m = PickerMetrics()
    pipe, _, _ = make()
    p = Picker(pipe, gate=InflightGate(2, m.picker_inflight), arriving=InflightGate(8, m.incomplete_requests),
               bodies=BodyBudget(1 << 20, 1 << 24, m.buffered_bytes), lean=LeanSignals(pipe.load, pipe.metrics))

    def sample(name: str) -> float | None:
        return m.registry.get_sample_value(name)

    stalled, whole = p.open(), p.open()
    stalled.add_body(b"x" * 100)
    await whole.decide(chat(b'{"messages":[]}'))
    assert (sample("epp_incomplete_requests"), sample("epp_inflight_requests")) == (1, 1)
    assert sample("epp_buffered_body_bytes") == 100
    stalled.close()
    whole.close()
    assert (sample("epp_incomplete_requests"), sample("epp_inflight_requests"), sample("epp_buffered_body_bytes")) \
        == (0, 0, 0)
