"""The ext_proc edge driven with a fake picker and no socket: protocol handling is testable on its own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.request import RequestContext
from epp_extproc.envoy.extproc import ExtProcServicer

Mode = processing_mode_pb2.ProcessingMode


@dataclass
class Routed:
    address: str
    body: bytes | None
    booking_id: str = "b-1"


@dataclass
class FakeExchange:
    log: list[str] = field(default_factory=list)
    buf: bytearray = field(default_factory=bytearray)
    limit: int = 1 << 20

    def add_body(self, data: bytes) -> None:
        if len(self.buf) + len(data) > self.limit:
            raise PickError(Problem.BODY_TOO_LARGE, "too big")
        self.buf += data

    def body(self) -> bytes:
        return bytes(self.buf)

    async def decide(self, request: RequestContext) -> Routed:
        self.log.append(f"decide {request.path}")
        return Routed("10.0.0.1:8000", request.body)

    def reject(self, err: PickError, request: RequestContext) -> None:
        self.log.append(f"reject {err.problem.value}")

    def served_by(self, address: str) -> None:
        self.log.append(f"served {address}")

    def response_headers(self, headers: Mapping[str, list[str]]) -> list[tuple[str, str]]:
        self.log.append("response_headers")
        return []

    def response_chunk(self, data: bytes) -> None:
        self.log.append(f"chunk {len(data)}")

    def close(self) -> None:  # idempotent, like the real exchange
        if "close" not in self.log:
            self.log.append("close")


class FakePicker:
    def __init__(self, full: bool = False) -> None:
        self.exchanges: list[FakeExchange] = []
        self.full = full
        self.refused: list[Problem] = []
        self.signals: list[str] = []

    def open(self) -> FakeExchange:
        if self.full:
            raise PickError(Problem.OVERLOADED, "endpoint picker overloaded")
        self.exchanges.append(FakeExchange())
        return self.exchanges[-1]

    def count_rejection(self, err: PickError) -> None:
        self.refused.append(err.problem)

    def first_chunk(self, booking_id: str) -> None:
        self.signals.append(f"first_chunk {booking_id}")

    def access_logged(self, booking_id: str, usage_tail: bytes | None, flags: list[str]) -> None:
        self.signals.append(f"access_log {booking_id}")


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[object, str] | None = None

    async def abort(self, code: object, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)


def headers(path: str = "/v1/chat/completions", eos: bool = False) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode())]), end_of_stream=eos))
    req.protocol_config.request_body_mode = Mode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
    req.protocol_config.response_body_mode = Mode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
    return req


def body(data: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


async def feed(msgs: list[pb.ProcessingRequest], stall: bool = False) -> AsyncIterator[pb.ProcessingRequest]:
    for m in msgs:
        yield m
    if stall:
        await asyncio.sleep(3600)


async def drive(picker: FakePicker, msgs: list[pb.ProcessingRequest], *, stall: bool = False,
                body_timeout_s: float = 5.0) -> tuple[list[pb.ProcessingResponse], FakeContext]:
    svc = ExtProcServicer(picker, allowed_modes=("FULL_DUPLEX_STREAMED",), body_timeout_s=body_timeout_s)
    ctx = FakeContext()
    out: list[pb.ProcessingResponse] = []
    try:
        async for r in svc.Process(feed(msgs, stall), ctx):  # type: ignore[arg-type]
            out.append(r)
    except Aborted:  # the fake context raises like grpc's abort() does
        pass
    return out, ctx


async def test_body_chunks_reach_the_exchange_and_the_decision_comes_back_as_one_header_response() -> None:
    p = FakePicker()
    out, _ = await drive(p, [headers(), body(b'{"a":', False), body(b"1}")])
    assert p.exchanges[0].log == ["decide /v1/chat/completions", "close"]
    assert out[0].WhichOneof("response") == "request_headers"
    assert out[1].request_body.response.body_mutation.streamed_response.body == b'{"a":1}'


async def test_a_second_request_headers_is_a_protocol_error_and_makes_no_second_decision() -> None:
    p = FakePicker()
    _, ctx = await drive(p, [headers(eos=True), headers(eos=True)])
    assert p.exchanges[0].log == ["decide /v1/chat/completions", "reject protocol_error", "close"]
    assert ctx.aborted is not None and "second request_headers" in ctx.aborted[1]


async def test_a_body_before_headers_is_a_protocol_error() -> None:
    p = FakePicker()
    _, ctx = await drive(p, [body(b"{}")])
    assert p.exchanges[0].log == ["reject protocol_error", "close"]
    assert ctx.aborted is not None


async def test_an_overloaded_picker_answers_the_headers_with_a_json_503() -> None:
    p = FakePicker(full=True)
    out, _ = await drive(p, [headers()])
    ir = out[0].immediate_response
    assert ir.status.code == 503
    assert json.loads(ir.body)["error"]["message"] == "endpoint picker overloaded"
    assert p.refused == [Problem.OVERLOADED]


async def test_an_oversized_body_is_rejected_with_413_and_the_exchange_closed() -> None:
    p = FakePicker()
    out, _ = await drive(p, [headers(), body(b"x" * (2 << 20), False)])
    assert out[0].immediate_response.status.code == 413
    assert p.exchanges[0].log == ["reject body_too_large", "close"]


async def test_a_stalled_body_gets_408_after_the_deadline_and_closes_the_exchange() -> None:
    p = FakePicker()
    out, _ = await drive(p, [headers(), body(b"{", False)], stall=True, body_timeout_s=0.2)
    assert out[0].immediate_response.status.code == 408
    assert p.exchanges[0].log == ["reject body_timeout", "close"]


async def test_a_stream_that_sends_nothing_is_dropped_at_the_deadline() -> None:
    p = FakePicker()
    out, ctx = await drive(p, [], stall=True, body_timeout_s=0.2)
    assert out == [] and ctx.aborted is not None
    assert p.exchanges[0].log == ["reject body_timeout", "close"]


async def test_response_chunks_and_the_served_endpoint_are_reported_to_the_exchange() -> None:
    p = FakePicker()
    served = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    served.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=True))
    out, _ = await drive(p, [headers(eos=True), served, chunk])
    assert p.exchanges[0].log == ["decide /v1/chat/completions", "served 10.0.0.2:8000", "response_headers",
                                  "chunk 9", "close"]
    assert out[-1].response_body.response.body_mutation.streamed_response.body == b"data: x\n\n"


async def test_an_observer_stream_reports_the_first_chunk_of_its_booking_and_holds_no_slot() -> None:
    p = FakePicker()
    first = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n"))
    first.metadata_context.filter_metadata["envoy.lb"].update({"x-epp-booking-id": "epp-7"})
    later = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: y\n\n"))
    out, _ = await drive(p, [first, later])
    assert out == [] and p.signals == ["first_chunk epp-7"]
    assert p.exchanges[0].log == ["close"]  # the slot is given back at once
