"""The `h2` library as the client (a second HTTP/2 implementation besides grpcio's and Envoy's): requests,
flow control over a message larger than the windows, many concurrent streams, a reset, a ping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import h2.config
import h2.connection
import h2.events
import pytest

from h2grpc import H2GrpcServer, Limits
from tests.h2.wire import Handlers, msg


class Client:
    """An h2 client connection on an asyncio stream pair: send, then pump events until a condition holds."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.data: dict[int, bytearray] = {}
        self.headers: dict[int, list] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.pongs: list[bytes] = []
        self.flush()

    def flush(self) -> None:
        self.w.write(self.conn.data_to_send())

    def request(self, path: str, body: bytes = b"", end: bool = True) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                     (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
        if body:
            self.send(sid, body, end)
        elif end:
            self.conn.end_stream(sid)
        self.flush()
        return sid

    def send(self, sid: int, body: bytes, end: bool) -> None:
        """As much as the windows allow now; the rest when WINDOW_UPDATEs arrive (see pump)."""
        self._pending = getattr(self, "_pending", {})
        self._pending[sid] = (bytearray(body), end)
        self._push()

    def _push(self) -> None:
        for sid, (rest, end) in list(self._pending.items()):
            while rest:
                n = min(len(rest), self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
                if n <= 0:
                    break
                self.conn.send_data(sid, bytes(rest[:n]))
                del rest[:n]
            if not rest:
                if end:
                    self.conn.end_stream(sid)
                del self._pending[sid]
        self.flush()

    async def until(self, done) -> None:  # noqa: ANN001
        while not done():
            chunk = await asyncio.wait_for(self.r.read(65_536), 10)
            assert chunk, "the server closed the connection"
            for ev in self.conn.receive_data(chunk):
                if isinstance(ev, h2.events.DataReceived):
                    self.data.setdefault(ev.stream_id, bytearray()).extend(ev.data)
                    self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    self.headers.setdefault(ev.stream_id, []).extend(ev.headers)
                elif isinstance(ev, h2.events.StreamEnded):
                    self.ended.add(ev.stream_id)
                elif isinstance(ev, h2.events.StreamReset):
                    self.resets[ev.stream_id] = ev.error_code
                elif isinstance(ev, h2.events.PingAckReceived):
                    self.pongs.append(ev.ping_data)
                elif isinstance(ev, h2.events.WindowUpdated):
                    if getattr(self, "_pending", None):
                        self._push()
            self.flush()

    def status(self, sid: int) -> str | None:
        return dict(self.headers.get(sid, [])).get("grpc-status")


@pytest.fixture
async def client() -> AsyncIterator[tuple[Client, Handlers, H2GrpcServer]]:
    server = H2GrpcServer(max_concurrent_rpcs=256, max_receive_message_length=8 << 20,
                          limits=Limits(keepalive_time_s=0))
    handlers = Handlers()
    handlers.register(server)
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    yield Client(r, w), handlers, server
    w.close()
    await server.stop(0)


async def test_an_h2_client_gets_its_message_echoed_with_grpc_status_ok(client) -> None:  # noqa: ANN001
    cl, _, _ = client
    sid = cl.request("/test.Svc/Echo", msg(b"hello"))
    await cl.until(lambda: sid in cl.ended)
    assert bytes(cl.data[sid]) == msg(b"hello") and cl.status(sid) == "0"
    assert dict(cl.headers[sid])[":status"] == "200"


async def test_a_message_larger_than_every_window_crosses_both_ways(client) -> None:  # noqa: ANN001
    cl, _, _ = client
    body = msg(bytes(range(256)) * 12_000)  # 3 MB: past the h2 client's 64 KiB windows and ours of 1 MiB
    sid = cl.request("/test.Svc/Echo", body)
    await cl.until(lambda: sid in cl.ended)
    assert bytes(cl.data[sid]) == body and cl.status(sid) == "0"


async def test_a_hundred_concurrent_streams_each_get_their_own_answer(client) -> None:  # noqa: ANN001
    cl, _, _ = client
    sids = [cl.request("/test.Svc/Echo", msg(b"%d" % i)) for i in range(100)]
    await cl.until(lambda: all(s in cl.ended for s in sids))
    assert [bytes(cl.data[s]) for s in sids] == [msg(b"%d" % i) for i in range(100)]
    assert {cl.status(s) for s in sids} == {"0"}


async def test_an_h2_client_reset_cancels_the_handler_and_the_connection_serves_on(client) -> None:  # noqa: ANN001
    cl, handlers, server = client
    sid = cl.request("/test.Svc/Hang", end=False)
    for _ in range(200):
        if handlers.started:
            break
        await asyncio.sleep(0.01)
    cl.conn.reset_stream(sid)
    cl.conn.ping(b"afterrst")
    cl.flush()
    await cl.until(lambda: cl.pongs)
    for _ in range(200):
        if handlers.finished:
            break
        await asyncio.sleep(0.01)
    assert handlers.finished == 1 and server.active == 0 and cl.pongs == [b"afterrst"]
    sid2 = cl.request("/test.Svc/Echo", msg(b"again"))
    await cl.until(lambda: sid2 in cl.ended)
    assert bytes(cl.data[sid2]) == msg(b"again")


async def test_an_unknown_method_is_unimplemented_for_an_h2_client(client) -> None:  # noqa: ANN001
    cl, _, _ = client
    sid = cl.request("/test.Svc/Nope", msg(b"x"))
    await cl.until(lambda: sid in cl.ended)
    assert cl.status(sid) == "12"
