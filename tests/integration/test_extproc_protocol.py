"""The ext_proc conversation itself, driven by a raw gRPC client: what Envoy would see message by message."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp_extproc.app import PickerApp
from epp_extproc.config import Config

pytestmark = pytest.mark.transport  # also run on --extproc-transport grpcio by `make test`

Mode = processing_mode_pb2.ProcessingMode


def headers_msg(path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False,
                extra: dict[str, str] | None = None, mode: str | None = None) -> pb.ProcessingRequest:
    hs = [(":method", method), (":path", path), ("content-type", "application/json")]
    hs += list((extra or {}).items())
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=eos))
    if mode:
        req.protocol_config.request_body_mode = Mode.BodySendMode.Value(mode)
        req.protocol_config.response_body_mode = Mode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
    return req


def body_msg(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


@pytest.fixture
async def picker():
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                 endpoints="a=127.0.0.1:9,b=127.0.0.1:10", max_inflight_requests=1, max_incomplete_requests=1,
                 allowed_body_modes="FULL_DUPLEX_STREAMED", secure_serving=False)  # protocol, not TLS
    app = PickerApp(cfg)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    yield app, pb_grpc.ExternalProcessorStub(ch)
    await ch.close()
    await app.stop()


async def test_the_picker_serves_the_transport_the_suite_asked_for(picker) -> None:
    from tests.conftest import TRANSPORT

    app, _ = picker
    assert isinstance(app._grpc, grpc.aio.Server) is (TRANSPORT == "grpcio")


def dest_of(resp: pb.ProcessingResponse) -> str:
    common = resp.request_headers.response
    vals = [h.header.raw_value.decode() for h in common.header_mutation.set_headers
            if h.header.key == "x-gateway-destination-endpoint"]
    assert len(vals) == 1
    return vals[0]


async def test_decision_is_one_headers_response_then_the_body_in_chunks(picker) -> None:
    _, stub = picker
    call = stub.Process()
    body = b'{"model":"m","pad":"' + b"x" * 150_000 + b'"}'
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(body[:100_000], False))
    await call.write(body_msg(body[100_000:], True))
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers"
    dest = dest_of(first)
    assert dest in ("127.0.0.1:9", "127.0.0.1:10")
    assert first.request_headers.response.clear_route_cache
    assert first.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == dest
    header = [h for h in first.request_headers.response.header_mutation.set_headers][0].header
    assert header.value == ""  # raw_value only: Envoy answers 500 when both are set
    got = b""
    while True:
        r = await call.read()
        sr = r.request_body.response.body_mutation.streamed_response
        assert len(sr.body) <= 62_000
        got += sr.body
        if sr.end_of_stream:
            break
    assert got == body
    await call.done_writing()


async def test_body_chunks_after_end_of_stream_are_ignored(picker) -> None:
    _, stub = picker
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b'{"a":1}', True))
    await call.write(body_msg(b'{"a":1}', True))  # Envoy 1.35-1.37 repeat the last chunk on large bodies
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    kinds = []
    for _ in range(3):
        r = await call.read()
        kinds.append(r.WhichOneof("response"))
    assert kinds == ["request_headers", "request_body", "response_headers"]
    await call.done_writing()


async def test_trailers_are_answered_in_order_after_the_body(picker) -> None:
    _, stub = picker
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b'{"a":1}', False))
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    kinds = [(await call.read()).WhichOneof("response") for _ in range(3)]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    await call.done_writing()


async def test_unsupported_body_mode_fails_the_stream_naming_the_mode(picker) -> None:
    _, stub = picker
    call = stub.Process()
    await call.write(headers_msg(mode="BUFFERED"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "BUFFERED" in e.value.details()


async def test_streams_above_the_incomplete_cap_get_503_overloaded(picker) -> None:
    app, stub = picker
    held = stub.Process()
    await held.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))  # body still to come: occupies the one slot
    for _ in range(50):
        if app.picker.arriving.count == 1:
            break
        await asyncio.sleep(0.01)
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    r = await call.read()
    assert r.immediate_response.status.code == 503
    assert json.loads(r.immediate_response.body)["error"]["message"] == "endpoint picker overloaded"
    held.cancel()


async def test_whole_requests_above_the_inflight_cap_get_503_overloaded(picker) -> None:
    app, stub = picker
    held = stub.Process()
    await held.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await held.write(body_msg(b'{"a":1}', True))
    await held.read()  # routed: it holds the one in-flight slot until its stream ends
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b'{"a":2}', True))
    r = await call.read()
    assert r.immediate_response.status.code == 503
    assert json.loads(r.immediate_response.body)["error"]["message"] == "endpoint picker overloaded"
    held.cancel()


async def test_a_stalled_stream_does_not_take_the_slot_of_a_whole_request() -> None:
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                 endpoints="a=127.0.0.1:9", max_inflight_requests=1, max_incomplete_requests=8,
                 allowed_body_modes="FULL_DUPLEX_STREAMED", secure_serving=False)
    app = PickerApp(cfg)
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        stalled = [stub.Process() for _ in range(5)]
        for s in stalled:
            await s.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))  # and never a body
        call = stub.Process()
        await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
        await call.write(body_msg(b'{"a":1}', True))
        r = await call.read()
        assert dest_of(r) == "127.0.0.1:9"
        assert (app.picker.arriving.count, app.picker.gate.count) == (5, 1)
        for s in stalled:
            s.cancel()
        call.cancel()
    await app.stop()


async def test_bodyless_request_is_picked_on_headers(picker) -> None:
    _, stub = picker
    call = stub.Process()
    await call.write(headers_msg("/v1/models", "GET", eos=True, mode="FULL_DUPLEX_STREAMED"))
    r = await call.read()
    assert dest_of(r) in ("127.0.0.1:9", "127.0.0.1:10")
    await call.done_writing()


async def test_client_disconnect_mid_pick_frees_everything(picker) -> None:
    app, stub = picker
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b'{"a":1}', True))
    await call.read()  # picked and booked
    assert app.load.total_inflight() == 1
    call.cancel()
    for _ in range(100):
        if app.load.total_inflight() == 0 and app.picker.open_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert app.load.total_inflight() == 0 and app.picker.open_requests == 0


async def test_spoofed_destination_headers_are_removed(picker) -> None:
    _, stub = picker
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED", extra={
        "x-gateway-destination-endpoint": "6.6.6.6:1", "x-gateway-destination-endpoint-subset": "6.6.6.6:1"}))
    await call.write(body_msg(b"{}", True))
    r = await call.read()
    mut = r.request_headers.response.header_mutation
    assert "x-gateway-destination-endpoint-subset" in mut.remove_headers
    assert dest_of(r) != "6.6.6.6:1"
    await call.done_writing()




async def routed_then_served(stub, served_for) -> tuple[str, object]:  # noqa: ANN001
    """Route one request, then answer its response headers reporting `served_for(picked)` as served."""
    from google.protobuf import struct_pb2

    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b"{}", True))
    picked = dest_of(await call.read())
    await call.read()  # the body
    resp = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    meta = struct_pb2.Struct()
    meta.update({"x-gateway-destination-endpoint-served": served_for(picked)})
    resp.metadata_context.filter_metadata["envoy.lb"].CopyFrom(meta)
    await call.write(resp)
    await call.read()
    return picked, call


def the_other(address: str) -> str:
    return "127.0.0.1:10" if address == "127.0.0.1:9" else "127.0.0.1:9"


async def test_booking_follows_the_endpoint_the_gateway_reports_it_served(picker) -> None:
    app, stub = picker
    picked, call = await routed_then_served(stub, the_other)
    assert app.load.load(the_other(picked)).inflight == 1 and app.load.load(picked).inflight == 0
    await call.done_writing()


async def test_served_endpoint_the_picker_never_discovered_is_ignored(picker) -> None:
    app, stub = picker
    picked, call = await routed_then_served(stub, lambda _: "6.6.6.6:1")
    assert app.load.load(picked).inflight == 1 and app.load.load("6.6.6.6:1").inflight == 0
    await call.done_writing()


# ------------------------------------------------------------------ one request per stream, bounded streams
@pytest.fixture
async def roomy():
    """A picker with room for several streams, a short body deadline and a small body budget."""
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                 endpoints="a=127.0.0.1:9,b=127.0.0.1:10", max_inflight_requests=8, max_body_bytes=100_000,
                 max_buffered_body_bytes=150_000, request_body_timeout_ms=300, secure_serving=False,
                 allowed_body_modes="FULL_DUPLEX_STREAMED")
    app = PickerApp(cfg)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}")
    yield app, pb_grpc.ExternalProcessorStub(ch)
    await ch.close()
    await app.stop()


async def settled(app: PickerApp) -> bool:
    for _ in range(200):
        if app.load.total_inflight() == 0 and app.picker.open_requests == 0 and app.picker.bodies.used == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_second_request_on_one_stream_is_refused_and_leaves_one_booking_only(roomy) -> None:
    app, stub = roomy
    call = stub.Process()
    await call.write(headers_msg(eos=True, mode="FULL_DUPLEX_STREAMED"))
    await call.read()
    assert app.load.total_inflight() == 1
    await call.write(headers_msg(eos=True, mode="FULL_DUPLEX_STREAMED"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sum(app.load.load(a).inflight for a in ("127.0.0.1:9", "127.0.0.1:10")) <= 1
    assert await settled(app)


async def test_a_stalled_body_gets_408_and_frees_its_slot(roomy) -> None:
    app, stub = roomy
    call = stub.Process()
    await call.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b'{"model":', False))
    r = await asyncio.wait_for(call.read(), 5)
    assert r.immediate_response.status.code == 408
    assert "not complete within 0.3s" in json.loads(r.immediate_response.body)["error"]["message"]
    assert await settled(app)


async def test_a_stream_that_never_sends_anything_is_closed_at_the_deadline(roomy) -> None:
    app, stub = roomy
    calls = [stub.Process() for _ in range(5)]
    for c in calls:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(c.read(), 5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await settled(app)


async def test_unfinished_bodies_share_one_budget_and_the_one_past_it_gets_503(roomy) -> None:
    app, stub = roomy
    first, second = stub.Process(), stub.Process()
    for c in (first, second):
        await c.write(headers_msg(mode="FULL_DUPLEX_STREAMED"))
    await first.write(body_msg(b"x" * 90_000, False))
    for _ in range(100):
        if app.picker.bodies.used == 90_000:
            break
        await asyncio.sleep(0.01)
    await second.write(body_msg(b"y" * 90_000, False))  # 180 kB together > the 150 kB budget
    r = await asyncio.wait_for(second.read(), 5)
    assert r.immediate_response.status.code == 503
    assert json.loads(r.immediate_response.body)["error"]["code"] == "body_budget"
    first.cancel()
    assert await settled(app)


async def test_a_rejected_request_with_a_huge_path_logs_a_bounded_line(roomy, caplog) -> None:
    app, stub = roomy
    caplog.set_level(logging.INFO)
    call = stub.Process()
    await call.write(headers_msg(path="/v1/chat/completions?" + "p" * 100_000, mode="FULL_DUPLEX_STREAMED"))
    await call.write(body_msg(b"[1]", True))
    r = await call.read()
    assert r.immediate_response.status.code == 400
    lines = [rec.getMessage() for rec in caplog.records if "rejected" in rec.getMessage()]
    assert lines and max(len(x) for x in lines) < 1000
    assert await settled(app)
