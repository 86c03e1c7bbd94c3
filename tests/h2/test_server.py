"""h2grpc, the ext_proc port's own HTTP/2 gRPC server: grpcio's client against it, and raw frames a client should not
send. Every case runs on both loops the picker runs on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.envoy.health import SERVICES, BoundedHealthServicer
from epp_extproc.envoy.tls import CertSource
from h2grpc import H2GrpcServer, Limits
from h2grpc import codec as h2
from h2grpc.connection import Connection
from h2grpc.limits import DEFAULT
from tests.loops import event_loop_policy  # noqa: F401 - both loops


def _same(b: bytes) -> bytes:
    return b


class Service:
    """A bytes-in, bytes-out service with one method of each shape, recording what its handlers saw."""

    def __init__(self) -> None:
        self.finally_ran = asyncio.Event()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def chat(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:  # noqa: ANN001
        try:
            async for r in requests:
                if r == b"abort":
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nicht unterstützt: 100%")
                if r == b"boom":
                    raise RuntimeError("servicer bug")
                if r.startswith(b"big:"):
                    yield b"x" * int(r[4:])
                    continue
                yield r.upper()
        finally:
            self.finally_ran.set()

    async def hang(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:  # noqa: ANN001
        try:
            self.started.set()
            await self.release.wait()
            yield b"released"
        finally:
            self.finally_ran.set()

    async def count(self, requests: AsyncIterator[bytes], context) -> bytes:  # noqa: ANN001
        n = 0
        async for r in requests:
            n += len(r)
        return str(n).encode()

    async def ticks(self, request: bytes, context) -> None:  # noqa: ANN001
        for i in range(int(request)):
            await context.write(str(i).encode())

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        kw = {"request_deserializer": _same, "response_serializer": _same}
        return {"Chat": grpc.stream_stream_rpc_method_handler(self.chat, **kw),
                "Hang": grpc.stream_stream_rpc_method_handler(self.hang, **kw),
                "Count": grpc.stream_unary_rpc_method_handler(self.count, **kw),
                "Ticks": grpc.unary_stream_rpc_method_handler(self.ticks, **kw)}


@pytest.fixture
async def served() -> AsyncIterator[tuple[H2GrpcServer, Service, int]]:
    server = H2GrpcServer(max_concurrent_rpcs=4, max_receive_message_length=4 << 20,
                          max_send_message_length=8 << 20)
    svc = Service()
    server.add_registered_method_handlers("test.Svc", svc.handlers())
    health = BoundedHealthServicer(SERVICES)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    yield server, svc, port
    await server.stop(0)


def _channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def test_a_stream_stream_call_answers_each_message_in_order(served) -> None:  # noqa: ANN001
    _, svc, port = served
    async with _channel(port) as ch:
        call = ch.stream_stream("/test.Svc/Chat")(iter([b"a", b"bc", b"", b"def"]))
        assert [r async for r in call] == [b"A", b"BC", b"", b"DEF"]
        assert await call.code() == grpc.StatusCode.OK
    assert svc.finally_ran.is_set()


async def test_messages_larger_than_a_frame_and_a_window_cross_both_ways(served) -> None:  # noqa: ANN001
    _, _, port = served
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: many 16 KiB frames, past the 1 MiB stream window
    async with _channel(port) as ch:
        out = [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([big, b"big:3000000"]))]
        assert out[0] == big.upper() and out[1] == b"x" * 3_000_000
        assert await ch.stream_unary("/test.Svc/Count")(iter([big] * 4)) == str(4 * len(big)).encode()


async def test_unary_health_check_and_the_grpcio_not_found_status(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with _channel(port) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        r = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_method_the_servicer_leaves_to_its_generated_base_is_unimplemented(served) -> None:  # noqa: ANN001
    """The generated base sets the code on the context, then raises: the code set is the call's status."""
    _, _, port = served
    async with _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_unary_stream_written_through_the_context(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with _channel(port) as ch:
        assert [r async for r in ch.unary_stream("/test.Svc/Ticks")(b"3")] == [b"0", b"1", b"2"]


async def test_abort_ends_the_call_with_its_code_and_percent_encoded_details(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with _channel(port) as ch:
        call = ch.stream_stream("/test.Svc/Chat")(iter([b"ok", b"abort"]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in call]
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.details() == "nicht unterstützt: 100%"


async def test_a_servicer_exception_is_status_unknown_and_the_connection_lives_on(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([b"boom"]))]
        assert e.value.code() == grpc.StatusCode.UNKNOWN and "servicer bug" in e.value.details()
        assert [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([b"again"]))] == [b"AGAIN"]


async def test_an_unknown_method_is_unimplemented(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary("/test.Svc/Nope")(b"")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_client_cancel_cancels_the_handler_and_runs_its_finally(served) -> None:  # noqa: ANN001
    server, svc, port = served
    async with _channel(port) as ch:
        call = ch.stream_stream("/test.Svc/Hang")(iter([b"x"]))
        await asyncio.wait_for(svc.started.wait(), 5)
        call.cancel()
        await asyncio.wait_for(svc.finally_ran.wait(), 5)
        await asyncio.sleep(0.05)
        assert server.active == 0


async def test_a_message_over_the_receive_limit_is_resource_exhausted(served) -> None:  # noqa: ANN001
    _, _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([b"y" * (5 << 20)]))]
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_calls_over_the_server_cap_are_resource_exhausted_and_free_their_slot(served) -> None:  # noqa: ANN001
    server, svc, port = served
    async with _channel(port) as ch:
        hung = [ch.stream_stream("/test.Svc/Hang")(iter([b"x"])) for _ in range(4)]
        for _ in range(250):
            if server.active == 4:
                break
            await asyncio.sleep(0.02)
        assert server.active == 4
        with pytest.raises(grpc.aio.AioRpcError) as e:  # unary: a client still sending its stream races
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        svc.release.set()
        for c in hung:
            assert [r async for r in c] == [b"released"]
        assert [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([b"a"]))] == [b"A"]
        assert server.active == 0


async def test_a_deadline_cancels_the_handler_with_deadline_exceeded(served) -> None:  # noqa: ANN001
    server, svc, port = served
    async with _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [r async for r in ch.stream_stream("/test.Svc/Hang")(iter([b"x"]), timeout=0.3)]
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(svc.finally_ran.wait(), 5)


async def test_stop_gives_open_calls_their_grace_then_cancels_them(served) -> None:  # noqa: ANN001
    server, svc, port = served
    async with _channel(port) as ch:
        call = ch.stream_stream("/test.Svc/Hang")(iter([b"x"]))
        await asyncio.wait_for(svc.started.wait(), 5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await server.stop(0.3)
        assert 0.25 <= loop.time() - t0 < 3
        assert svc.finally_ran.is_set()
        with pytest.raises(grpc.aio.AioRpcError):
            _ = [r async for r in call]


async def test_tls_with_alpn_h2_and_a_reloaded_pair_for_new_connections(tmp_path) -> None:  # noqa: ANN001
    from epp_extproc.envoy import tls

    first = tls.self_signed()
    (tmp_path / "tls.crt").write_bytes(first.cert_pem)
    (tmp_path / "tls.key").write_bytes(first.key_pem)
    source = CertSource(str(tmp_path))
    server = H2GrpcServer(max_concurrent_rpcs=4)
    server.add_registered_method_handlers("test.Svc", Service().handlers())
    port = await server.bind("127.0.0.1", 0, ssl_context=source.ssl_context())
    await server.start()
    try:
        async def ask(ca: bytes) -> list[bytes]:
            creds = grpc.ssl_channel_credentials(ca)
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
                return [r async for r in ch.stream_stream("/test.Svc/Chat")(iter([b"tls"]), timeout=5)]

        assert await ask(first.cert_pem) == [b"TLS"]
        second = tls.self_signed()
        (tmp_path / "tls.key").write_bytes(second.key_pem)
        (tmp_path / "tls.crt").write_bytes(second.cert_pem)
        assert await source.check_once()
        assert await ask(second.cert_pem) == [b"TLS"]
        with pytest.raises(grpc.aio.AioRpcError):
            await ask(first.cert_pem)  # the old pair is no longer served
    finally:
        await server.stop(0)
        source.close()


# --- raw frames -----------------------------------------------------------------------------------------

def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def _request_headers(path: str = "/test.Svc/Chat") -> bytes:
    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])


def _msg(b: bytes) -> bytes:
    return b"\x00" + len(b).to_bytes(4, "big") + b


class Raw:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, port: int, settings: bytes = b"") -> Raw:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(h2.PREFACE + _frame(h2.SETTINGS, 0, 0, settings))
        return cls(r, w)

    async def frame(self) -> tuple[int, int, int, bytes]:
        head = await asyncio.wait_for(self.r.readexactly(9), 5)
        n = int.from_bytes(head[:3], "big")
        payload = await asyncio.wait_for(self.r.readexactly(n), 5)
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    async def until(self, kind: int, sid: int | None = None) -> tuple[int, int, int, bytes]:
        while True:
            f = await self.frame()
            if f[0] == kind and (sid is None or f[2] == sid):
                return f

    def close(self) -> None:
        self.w.close()


async def test_a_ping_is_answered_with_its_payload(served) -> None:  # noqa: ANN001
    raw = await Raw.open(served[2])
    raw.w.write(_frame(h2.PING, 0, 0, b"12345678"))
    kind, flags, _, payload = await raw.until(h2.PING)
    assert flags == h2.ACK and payload == b"12345678"
    raw.close()


async def test_a_connection_that_never_sends_the_preface_is_closed() -> None:
    server = H2GrpcServer(max_concurrent_rpcs=1, limits=Limits(preface_timeout_s=0.3))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(h2.PREFACE[:10])  # a start, then silence
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await asyncio.wait_for(r.read(65536), 5):  # our SETTINGS, then the close
        pass
    assert 0.25 <= loop.time() - t0 < 3
    assert not server.connections
    w.close()
    await server.stop(0)


async def test_not_http2_is_answered_with_goaway_and_closed(served) -> None:  # noqa: ANN001
    r, w = await asyncio.open_connection("127.0.0.1", served[2])
    w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = Raw(r, w)
    kind, _, _, payload = await raw.until(h2.GOAWAY)
    assert struct.unpack(">I", payload[4:8])[0] == h2.PROTOCOL_ERROR
    assert await asyncio.wait_for(r.read(), 5) == b""


async def test_data_past_the_stream_window_closes_the_connection(served, caplog) -> None:  # noqa: ANN001
    """A peer that ignores flow control cannot make a handler that does not read hold more than a window."""
    server, svc, port = served
    raw = await Raw.open(port)
    raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 1, _request_headers("/test.Svc/Hang")))
    await asyncio.wait_for(svc.started.wait(), 5)
    frame = _frame(h2.DATA, 0, 1, _msg(b"z" * 15_995))  # whole messages, never read by the handler
    with caplog.at_level("INFO", logger="h2grpc"):
        with contextlib.suppress(ConnectionError):
            for _ in range(3 * DEFAULT.stream_window // 16_000):  # refills stop once one window waits unread
                raw.w.write(frame)
                await raw.w.drain()
        await asyncio.wait_for(svc.finally_ran.wait(), 5)  # the connection went, and its call with it
    assert "sent past its window" in caplog.text
    assert not server.connections and server.active == 0
    raw.close()


async def test_output_waits_for_a_peer_that_grants_no_window(served) -> None:  # noqa: ANN001
    """The handler's next message waits while the peer's window is shut; nothing piles up without bound."""
    server, svc, port = served
    raw = await Raw.open(port, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 1000))
    raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 1, _request_headers())
                + _frame(h2.DATA, 0, 1, _msg(b"big:3000") + _msg(b"big:3000") + _msg(b"big:3000")))
    got = 0
    while got < 1000:
        kind, _, sid, payload = await raw.frame()
        if kind == h2.DATA:
            got += len(payload)
    await asyncio.sleep(0.2)
    call = next(iter(next(iter(server.connections)).calls.values()))
    assert got == 1000 and len(call.pending) == 3005 - 1000  # one message waits; the handler is parked
    raw.w.write(_frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 100_000)) + _frame(h2.DATA, h2.END_STREAM, 1))
    while True:
        kind, flags, sid, payload = await raw.frame()
        if kind == h2.DATA:
            got += len(payload)
        if kind == h2.HEADERS and flags & h2.END_STREAM:
            break
    assert got == 3 * 3005
    raw.close()


async def test_a_new_initial_window_mid_call_moves_the_open_streams_windows(served) -> None:  # noqa: ANN001
    """RFC 9113 §6.9.2: SETTINGS_INITIAL_WINDOW_SIZE changes every open stream's window by the difference,
    downwards too; the waiting output goes out as the new window allows."""
    server, _, port = served
    raw = await Raw.open(port, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 1000))
    raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 1, _request_headers())
                + _frame(h2.DATA, 0, 1, _msg(b"big:3000")))
    got = 0
    while got < 1000:
        kind, _, _, payload = await raw.frame()
        got += len(payload) if kind == h2.DATA else 0
    # the window is spent (0); shrinking the initial window by 500 leaves it at -500, then +2505 opens 2005
    raw.w.write(_frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 500))
                + _frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 3005)))
    while got < 3005:
        kind, _, _, payload = await raw.frame()
        got += len(payload) if kind == h2.DATA else 0
    assert got == 3005
    conn = next(iter(server.connections))
    assert not conn.waiting  # nothing waits for window any more: a WINDOW_UPDATE flood visits no call
    raw.w.write(_frame(h2.DATA, 0, 1, _msg(b"big:4000")))  # the window is exactly spent: all of it waits
    await asyncio.sleep(0.2)
    assert list(conn.waiting) == [1] and len(conn.calls[1].pending) == 4005  # the one call a WINDOW_UPDATE visits
    raw.w.write(_frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 4005)))
    while got < 3005 + 4005:
        kind, _, _, payload = await raw.frame()
        got += len(payload) if kind == h2.DATA else 0
    assert got == 3005 + 4005 and not conn.waiting
    raw.close()


async def test_data_on_a_finished_stream_is_dropped_and_the_connection_goes_on(served) -> None:  # noqa: ANN001
    _, _, port = served
    raw = await Raw.open(port)
    raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 1, _request_headers()) + _frame(h2.DATA, 0, 1, _msg(b"abort")))
    kind, flags, _, _ = await raw.until(h2.HEADERS, 1)
    assert flags & h2.END_STREAM  # trailers-only
    for _ in range(200):  # in flight before the client saw the reset: dropped, still counted on the connection
        raw.w.write(_frame(h2.DATA, 0, 1, b"q" * 16_000))
    block = b"".join(h2.literal(k.encode(), v.encode()) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/test.Svc/Chat"), (":authority", "x"),
        ("content-type", "application/grpc")))
    raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 3, block) + _frame(h2.DATA, h2.END_STREAM, 3, _msg(b"more")))
    kind, _, _, payload = await raw.until(h2.DATA, 3)
    assert payload == _msg(b"MORE")
    raw.close()


async def test_a_flood_of_empty_continuation_frames_loses_the_connection(served) -> None:  # noqa: ANN001
    """The CONTINUATION flood (CVE-2024-27316 and kin): empty frames add nothing to the byte cap, so the block
    grew without end, and each frame summed the whole list again."""
    server, _, port = served
    raw = await Raw.open(port)
    block = _request_headers()
    raw.w.write(_frame(h2.HEADERS, 0, 1, block[:4]) + _frame(h2.CONTINUATION, 0, 1) * 1_000)  # 9 KB
    kind, _, _, payload = await raw.until(h2.GOAWAY)
    assert struct.unpack(">I", payload[4:8])[0] == h2.ENHANCE_YOUR_CALM and b"frames" in payload[8:]
    assert server.active == 0
    raw.close()


class _Transport:
    """What a connection writes, write by write (a syscall each on a real socket)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def test_the_answers_to_the_frames_of_one_read_leave_in_one_write() -> None:
    """A flood of PINGs or SETTINGS cost a syscall per frame; now a read costs one however many it holds."""
    conn = Connection(H2GrpcServer(max_concurrent_rpcs=1, keepalive_time_s=0))
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    t.writes.clear()
    pings = b"".join(_frame(h2.PING, 0, 0, b"%08d" % i) for i in range(100))
    conn.data_received(h2.PREFACE + _frame(h2.SETTINGS, 0, 0) + pings)
    assert len(t.writes) == 1
    out = t.writes[0]
    assert out.startswith(_frame(h2.SETTINGS, h2.ACK, 0))
    assert out[9:] == b"".join(_frame(h2.PING, h2.ACK, 0, b"%08d" % i) for i in range(100))  # in order
    conn.connection_lost(None)


async def test_streams_past_the_per_connection_limit_are_refused() -> None:
    server = H2GrpcServer(max_concurrent_rpcs=100, max_streams_per_connection=3)
    server.add_registered_method_handlers("test.Svc", Service().handlers())
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        raw = await Raw.open(port)
        block = b"".join(h2.literal(k.encode(), v.encode()) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", "/test.Svc/Hang"), (":authority", "x")))
        for sid in (1, 3, 5, 7):
            raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, sid, block))
        kind, _, sid, payload = await raw.until(h2.RST_STREAM)
        assert sid == 7 and struct.unpack(">I", payload)[0] == h2.REFUSED_STREAM
        assert server.active == 3
        raw.close()
        for _ in range(100):
            if not server.active:
                break
            await asyncio.sleep(0.02)
        assert server.active == 0  # the connection's loss cancelled its calls
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def _keepalive_server(time_s: float, timeout_s: float) -> AsyncIterator[tuple[H2GrpcServer, Service, int]]:
    server = H2GrpcServer(max_concurrent_rpcs=4, keepalive_time_s=time_s, keepalive_timeout_s=timeout_s)
    svc = Service()
    server.add_registered_method_handlers("test.Svc", svc.handlers())
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        yield server, svc, port
    finally:
        await server.stop(0)


async def test_a_peer_that_answers_nothing_after_a_keepalive_ping_is_closed_and_its_calls_cancelled(caplog):  # noqa: ANN001
    """A host that died without a FIN would hold its calls (and their bookings) forever."""
    async with _keepalive_server(0.2, 0.3) as (server, svc, port):
        raw = await Raw.open(port)
        raw.w.write(_frame(h2.SETTINGS, h2.ACK, 0) + _frame(h2.HEADERS, h2.END_HEADERS, 1,
                                                             _request_headers("/test.Svc/Hang")))
        await asyncio.wait_for(svc.started.wait(), 5)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        kind, flags, _, _ = await raw.until(h2.PING)  # then the peer goes silent: no ACK, nothing
        assert not flags & h2.ACK
        await asyncio.wait_for(svc.finally_ran.wait(), 5)
        assert 0.25 <= loop.time() - t0 < 3 and server.active == 0 and not server.connections
        assert "not even the answer to a PING" in caplog.text
        raw.close()


async def test_a_peer_that_answers_keepalive_pings_keeps_a_silent_call_open() -> None:
    """grpcio's client answers PINGs as Envoy does: a call silent for many periods (a lean-mode answer) lives."""
    async with _keepalive_server(0.1, 0.1) as (server, svc, port), _channel(port) as ch:
        call = ch.stream_stream("/test.Svc/Hang")(iter([b"x"]))
        await asyncio.wait_for(svc.started.wait(), 5)
        await asyncio.sleep(1.0)  # ten keepalive periods with nothing but PINGs and their answers
        assert not svc.finally_ran.is_set() and len(server.connections) == 1
        svc.release.set()
        assert [r async for r in call] == [b"released"]
        assert await call.code() == grpc.StatusCode.OK


async def test_an_idle_peer_is_pinged_only_after_keepalive_time_of_silence() -> None:
    async with _keepalive_server(0.4, 5.0) as (_, _, port):
        raw = await Raw.open(port)
        raw.w.write(_frame(h2.SETTINGS, h2.ACK, 0))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await raw.until(h2.PING)
        assert loop.time() - t0 >= 0.35
        raw.close()


async def test_connections_past_the_cap_are_closed_as_they_arrive_and_a_freed_slot_is_served_again(caplog):  # noqa: ANN001
    """Idle connections that answer PINGs are kept: without a cap a client could hold sockets without end."""
    server = H2GrpcServer(max_concurrent_rpcs=4, max_connections=2)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        kept = [await Raw.open(port) for _ in range(2)]
        for raw in kept:
            await raw.until(h2.SETTINGS)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed before a byte of SETTINGS
        w.close()
        assert server.refused_connections == 1 and len(server.connections) == 2
        assert "gRPC connection refused: already 2 open" in caplog.text
        kept.pop().close()
        for _ in range(100):
            if len(server.connections) < 2:
                break
            await asyncio.sleep(0.01)
        again = await Raw.open(port)
        again.w.write(_frame(h2.PING, 0, 0, b"12345678"))
        assert (await again.until(h2.PING))[3] == b"12345678"
        for raw in (*kept, again):
            raw.close()
    finally:
        await server.stop(0)


async def _budget_server(**limits: Any) -> tuple[H2GrpcServer, int]:
    """A started server with a 1 MiB budget for unfinished messages (4 MiB cap each) and the counting service."""
    server = H2GrpcServer(max_concurrent_rpcs=8, max_receive_message_length=4 << 20, max_partial_bytes=1 << 20,
                          **limits)
    server.add_registered_method_handlers("test.Svc", Service().handlers())
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    return server, port


def _announced_part(announced: int, sent: int) -> list[bytes]:
    """The first `sent` bytes of a gRPC message announced at `announced` bytes, cut in 16 KiB DATA payloads."""
    part = b"\x00" + announced.to_bytes(4, "big") + b"x" * (sent - 5)
    return [part[i:i + 16_384] for i in range(0, len(part), 16_384)]


async def test_unfinished_messages_of_all_calls_together_are_held_to_the_servers_budget() -> None:
    """Each call may receive a message of up to the message cap; without a shared budget, many calls that
    never finish theirs held a whole cap each. The call that would pass the budget ends; the others go on."""
    server, port = await _budget_server()
    try:
        raw = await Raw.open(port)
        frames = _announced_part(2 << 20, 600_000)  # a 2 MiB message announced, 600 KB of it sent
        for sid in (1, 3):
            raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, sid, _request_headers("/test.Svc/Count"))
                        + b"".join(_frame(h2.DATA, 0, sid, f) for f in frames))
        kind, flags, sid, payload = await raw.until(h2.HEADERS)
        assert sid == 3 and flags & h2.END_STREAM  # the second passed 1 MiB: trailers-only, ended
        status = dict(hpack.Decoder().decode(payload))
        assert status["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        assert server.partial_bytes == 600_000  # the first one's part only: the ended call's is dropped
        raw.w.write(_frame(h2.DATA, h2.END_STREAM, 1, b"y" * 5))  # not the rest: the first ends unfinished
        kind, flags, sid, payload = await raw.until(h2.HEADERS)
        assert sid == 1
        for _ in range(100):
            if not server.active:
                break
            await asyncio.sleep(0.01)
        assert server.partial_bytes == 0 and server.active == 0
        raw.close()
    finally:
        await server.stop(0)


async def test_bytes_the_application_holds_count_against_the_same_budget() -> None:
    """`held_elsewhere`: what the application holds of messages it was given (the picker's buffered bodies)
    shares the budget of those still arriving; with two budgets a body held half in each made twice the bound."""
    held = [700_000]
    server, port = await _budget_server(held_elsewhere=lambda: held[0])
    try:
        raw = await Raw.open(port)
        frames = _announced_part(2 << 20, 400_000)  # a 2 MiB message announced, 400 KB of it sent
        raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 1, _request_headers("/test.Svc/Count"))
                    + b"".join(_frame(h2.DATA, 0, 1, f) for f in frames))
        kind, flags, sid, payload = await raw.until(h2.HEADERS)
        assert sid == 1 and flags & h2.END_STREAM  # 700 KB held elsewhere + 400 KB passed 1 MiB
        assert dict(hpack.Decoder().decode(payload))["grpc-status"] == \
            str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        assert server.partial_bytes == 0
        held[0] = 0  # the application let its bytes go: the same message now fits
        raw.w.write(_frame(h2.HEADERS, h2.END_HEADERS, 3, _request_headers("/test.Svc/Count"))
                    + b"".join(_frame(h2.DATA, 0, 3, f) for f in frames))
        raw.w.write(_frame(h2.PING, 0, 0, b"12345678"))  # answered once every frame before it is handled
        await raw.until(h2.PING)
        assert server.partial_bytes == 400_000 and server.partial_room() == (1 << 20) - 400_000
        raw.close()
    finally:
        await server.stop(0)


def test_the_port_is_taken_loudly() -> None:
    async def main() -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        try:
            with pytest.raises(RuntimeError, match="cannot listen on 127.0.0.1:"):
                await H2GrpcServer(max_concurrent_rpcs=1).bind("127.0.0.1", s.getsockname()[1])
        finally:
            s.close()

    asyncio.run(main())


async def test_the_huffman_tables_are_built_when_the_server_starts_not_on_a_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The pure-Python decoder's tables (15-30 ms to build): h2grpc's C decoder, where built, needs none."""
    from h2grpc import hpack_decode

    monkeypatch.setattr(hpack_decode, "huffman_decode", hpack_decode.huffman_decode_py)
    monkeypatch.setattr(hpack_decode, "_NEXT", None)
    server = H2GrpcServer(max_concurrent_rpcs=1)
    await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        assert hpack_decode._NEXT is not None
    finally:
        await server.stop(0)


async def test_no_pure_huffman_tables_are_built_when_the_c_decoder_is_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """~1.7 MiB and 15-30 ms a process saved where h2grpc._huffman is built."""
    from h2grpc import hpack_decode, native

    if native.MODULE is None:
        pytest.skip("h2grpc._huffman is not built or EPP_H2GRPC_PURE is set")
    monkeypatch.setattr(hpack_decode, "_NEXT", None)
    server = H2GrpcServer(max_concurrent_rpcs=1)
    await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        assert hpack_decode._NEXT is None
    finally:
        await server.stop(0)


def test_invocation_metadata_is_the_request_headers_but_the_pseudo_headers_in_order() -> None:
    """What a servicer reads with `context.invocation_metadata()` (the picker: Envoy's trace context)."""
    import types

    from h2grpc.call import Call

    conn = types.SimpleNamespace(peer_initial_window=65_535, window_shift=0, stream_window=65_535,
                                 loop=types.SimpleNamespace(time=lambda: 0.0))
    headers = [(":method", "POST"), (":path", "/s/M"), ("te", "trailers"), ("", "empty name"),
               ("traceparent", "00-1-2-01"), ("tracestate", ""), ("x-colon", ":value")]
    call = Call(conn, 1, "/s/M", None, headers)  # type: ignore[arg-type]
    assert call.invocation_metadata() == (("te", "trailers"), ("", "empty name"), ("traceparent", "00-1-2-01"),
                                          ("tracestate", ""), ("x-colon", ":value"))
    # one field without the tuple: the first of that name, as the tuple holds it; never a pseudo-header
    call = Call(conn, 1, "/s/M", None, headers + [("traceparent", "second")])  # type: ignore[arg-type]
    for key in ("te", "", "traceparent", "tracestate", "x-colon", ":path", ":method", "absent"):
        want = next((v for k, v in call.invocation_metadata() if k == key), None)
        assert call.metadata_value(key) == want, key
    assert call.metadata_value("traceparent") == "00-1-2-01" and call.metadata_value(":path") is None
