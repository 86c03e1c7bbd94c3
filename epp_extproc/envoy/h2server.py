"""A small gRPC server on HTTP/2 for the ext_proc port: the same servicers, a third of grpcio's cost a message.

Why not grpcio here: in GAIE's echo mode every response chunk is one ext_proc message in and one out, and in
lean mode each request is a short stream of four. grpcio's asyncio server pays a fixed toll per message
(its poller thread, a completion-queue event, a loop wake-up and Cython call wrappers each way) that no
servicer can go under: ~80 µs per echoed chunk and ~380 µs per lean stream for a servicer that does nothing
(`bench/echo_floor.py`, `bench/request_floor.py`). grpclib (asyncio on hyper-h2) measured the same. Envoy is
the only client of this port and speaks plain gRPC over HTTP/2, so this module reads and writes the frames
itself, on the event loop, as asyncio protocol callbacks: ~30 µs per echoed chunk in the same benchmark.

What it implements (RFC 9113, gRPC over HTTP/2): the connection preface and SETTINGS, HEADERS/CONTINUATION
with HPACK (`hpack`, the decoder of hyper-h2: Envoy uses Huffman and the dynamic table; responses use only
literal fields, so no encoder state), DATA with padding, per-stream and connection flow control both ways,
PING, RST_STREAM, GOAWAY, WINDOW_UPDATE, the 5-byte gRPC message framing, trailers and trailers-only
answers, `grpc-timeout`, and the four call shapes of grpcio's method handlers: the generated
`add_*Servicer_to_server` functions register the servicers here unchanged (`add_registered_method_handlers`),
and a servicer sees a context with grpcio's `abort`, `write`, `set_code`, `set_details`, `cancelled`,
`invocation_metadata`, `peer` and `time_remaining`. A peer RST_STREAM or a lost connection cancels the
handler task, as grpcio does, so the servicer's `finally` frees what it holds.

Bounds, whatever a peer sends: at most `max_connections` open connections (more are closed as they arrive);
`PREFACE_TIMEOUT_S` to send the HTTP/2 preface; a peer silent for
`keepalive_time_s` (0 = never) is sent a PING and closed if it sends nothing within `keepalive_timeout_s`
(a host that died without a FIN or RST would otherwise hold its calls, and their bookings, forever: a
lean-mode call is silent for the whole answer); a header block of at most `MAX_HEADER_LIST_BYTES` in at
most `MAX_HEADER_FRAMES` frames (a flood of empty CONTINUATIONs adds frames, not bytes); at most
`max_streams_per_connection` open streams a connection (more: REFUSED_STREAM) and `max_concurrent_rpcs` in
the server (more: RESOURCE_EXHAUSTED); a message of at most `max_receive_message_length`, and at most
`max_partial_bytes` in messages still arriving on all calls together (the call that would pass it ends with
RESOURCE_EXHAUSTED: without it, each open call could hold a whole message cap of a message never finished);
per stream at most one window (`STREAM_WINDOW`) of received but unread messages before its window stops being refilled (so
at most two windows wait unread; a peer sending past its window loses the connection); outbound,
a handler waits while the peer's window is shut or the socket's write buffer is full, and a connection whose
unread output passes `MAX_OUTPUT_BUFFER` (a peer that sends PINGs and SETTINGS but never reads) is closed.
Control floods cost O(1) a frame: the answers to one read's frames leave in one write, a WINDOW_UPDATE
visits only the calls waiting for window, and a new SETTINGS_INITIAL_WINDOW_SIZE is one shift, not a loop
over the open streams.
Not implemented, because no gRPC client needs them here: server push, priorities (ignored), message
compression (a compressed message is refused with UNIMPLEMENTED: we never advertise an encoding).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any
from urllib.parse import quote

import grpc
import hpack

from epp_extproc.core.logs import Throttled

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, \
    S_MAX_HEADER_LIST_SIZE = 1, 2, 3, 4, 5, 6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, _, STREAM_CLOSED, FRAME_SIZE_ERROR, \
    REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, _, ENHANCE_YOUR_CALM = range(12)

MAX_FRAME = 16_384  # what we accept (the protocol's default, and Envoy's frame size)
MAX_HEADER_LIST_BYTES = 65_536
MAX_HEADER_FRAMES = 64  # HEADERS + CONTINUATIONs of one block (64 KiB is 4 full frames; Envoy sends 1-2)
STREAM_WINDOW = 1 << 20  # per stream: a 16 MiB BUFFERED body needs ~32 refills, localhost round trips
CONNECTION_WINDOW = 1 << 26
MAX_OUTPUT_BUFFER = 8 << 20
MAX_WINDOW = (1 << 31) - 1
DEFAULT_MAX_STREAMS_PER_CONNECTION = 1024
DEFAULT_MAX_CONNECTIONS = 4096  # Envoy opens one per worker thread: 50 gateway pods x 16 threads is 800
PREFACE_TIMEOUT_S = 10.0  # a connection that has not sent the HTTP/2 preface by then is closed
KEEPALIVE_TIME_S = 60.0  # a peer this long silent is sent a PING (grpcio's server waits 2 h by default)
KEEPALIVE_TIMEOUT_S = 20.0  # and closed if nothing at all arrives this long after it (grpcio's default)
_KEEPALIVE_PING = b"epp-kpal"

_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")
_CREDIT_STEP = STREAM_WINDOW // 4  # stream window is given back in steps this big: no frame per small message


def _head(length: int, kind: int, flags: int, sid: int) -> bytes:
    return (length << 8 | kind).to_bytes(4, "big") + bytes((flags,)) + sid.to_bytes(4, "big")


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return _head(len(payload), kind, flags, sid) + payload


def _int(n: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK integer (RFC 7541 §5.1)."""
    cap = (1 << prefix_bits) - 1
    if n < cap:
        return bytes((first | n,))
    out = bytearray((first | cap,))
    n -= cap
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman: no encoder state on either side."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


RESPONSE_HEADERS = b"\x88" + _literal(b"content-type", b"application/grpc")  # 0x88: :status 200 (static 8)
_TRAILERS_OK = _literal(b"grpc-status", b"0")


def _trailers(code: grpc.StatusCode, details: str | None) -> bytes:
    if code is grpc.StatusCode.OK and not details:
        return _TRAILERS_OK
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' as is, everything else %XX of its UTF-8
        block += _literal(b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


def _timeout(value: str) -> float | None:
    """grpc-timeout: up to 8 digits and a unit (H M S m u n)."""
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    if len(value) < 2 or len(value) > 9 or value[-1] not in units or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * units[value[-1]]


class _Aborted(Exception):
    """`context.abort`: ends the call with its status (grpcio's AbortError, an Exception too)."""


class _ConnectionError(Exception):
    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class _Call:
    """One gRPC call: a stream's received messages, its outbound flow control, and the servicer's context."""

    __slots__ = ("sid", "conn", "method", "handler", "headers", "msgs", "unread", "partial", "ended", "waiter",
                 "task", "headers_sent", "closed", "reset", "send_window", "pending", "drained", "credit",
                 "status", "code_set", "details", "deadline", "timer", "recv_window", "partial_held")

    def __init__(self, conn: _Connection, sid: int, method: str, handler: Any,
                 headers: list[tuple[str, str]]) -> None:
        self.sid = sid
        self.conn = conn
        self.method = method
        self.handler = handler
        self.headers = headers
        self.msgs: collections.deque[bytes] = collections.deque()
        self.unread = 0  # bytes of complete messages not yet taken by the handler
        self.partial = bytearray()
        self.partial_held = 0  # what `partial` adds to the server's count of bytes in unfinished messages
        self.ended = False  # the client half-closed
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.headers_sent = False
        self.closed = False  # trailers sent (or reset): nothing more goes out
        self.reset = False
        self.send_window = conn.peer_initial_window - conn.window_shift  # its window is this + the shift
        self.pending = bytearray()  # framed output waiting for window
        self.drained: asyncio.Future[None] | None = None
        self.credit = 0  # stream window not yet given back (held while `unread` is over a window)
        self.recv_window = STREAM_WINDOW  # what the peer may still send on this stream
        self.status: grpc.StatusCode | None = None  # set: the call is ending (trailers follow pending data)
        self.code_set: grpc.StatusCode | None = None  # the servicer's context.set_code()
        self.details: str | None = None
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None

    # --- inbound -------------------------------------------------------------------------------------
    def on_data(self, data: bytes, end: bool, flow_len: int) -> None:
        self.recv_window -= flow_len
        if self.recv_window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, f"stream {self.sid} sent past its window")
        if self.closed:
            return
        p = self.partial
        if not p and len(data) >= 5 and data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5 \
                and len(data) - 5 <= self.conn.server.max_receive_message_length:
            self.msgs.append(data[5:])  # the usual case: one whole message in one frame, no copy to a buffer
            self.unread += len(data)
        else:
            self._reassemble(data)
            if self.closed:
                return
        if end:
            self.ended = True
        self.credit += flow_len
        if self.credit >= _CREDIT_STEP:
            self.give_credit()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _reassemble(self, data: bytes) -> None:
        p = self.partial
        p += data
        limit = self.conn.server.max_receive_message_length
        while len(p) >= 5:
            if p[0] & 1:  # compressed: we advertise no grpc-accept-encoding, so this is not ours to read
                self.finish_now(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
                return
            size = int.from_bytes(p[1:5], "big")
            if size > limit:
                self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"Received message larger than max ({size} vs. {limit})")
                return
            if len(p) < 5 + size:
                break
            self.msgs.append(bytes(p[5:5 + size]))
            self.unread += 5 + size
            del p[:5 + size]
        grown = len(p) - self.partial_held
        if grown:
            server = self.conn.server
            server.partial_bytes += grown
            self.partial_held = len(p)
            if grown > 0 and server.partial_bytes > server.max_partial_bytes:
                self.finish_now(grpc.StatusCode.RESOURCE_EXHAUSTED, "messages still arriving hold over "
                                f"{server.max_partial_bytes} bytes in this server")

    def on_end(self) -> None:
        self.ended = True
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _messages(self, deserialize: Callable[[bytes], Any]) -> AsyncIterator[Any]:
        msgs = self.msgs
        while True:
            while msgs:
                raw = msgs.popleft()
                self.unread -= 5 + len(raw)
                if self.credit >= _CREDIT_STEP:
                    self.give_credit()
                yield deserialize(raw)
            if self.ended:
                if self.partial:
                    raise _Aborted(grpc.StatusCode.INTERNAL, "stream ended inside a message")
                return
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def give_credit(self) -> None:
        """Refill the stream window, unless a window's worth of messages already waits for the handler."""
        if self.unread <= STREAM_WINDOW and not self.ended and not self.closed:
            self.conn.write(_frame(WINDOW_UPDATE, 0, self.sid, _U32.pack(self.credit)))
            self.recv_window += self.credit
            self.credit = 0

    async def _one(self, deserialize: Callable[[bytes], Any]) -> Any:
        got = None
        async for m in self._messages(deserialize):
            if got is not None:
                raise _Aborted(grpc.StatusCode.UNIMPLEMENTED, "more than one request message on a unary call")
            got = m
        if got is None:
            raise _Aborted(grpc.StatusCode.UNIMPLEMENTED, "no request message on a unary call")
        return got

    # --- outbound ------------------------------------------------------------------------------------
    def _send_message(self, msg: Any) -> bool:
        """Frame and send one message; False when part of it waits for window or the socket (await drain)."""
        if self.closed:
            raise asyncio.CancelledError()  # the peer reset the stream: the handler is being cancelled
        data = self.handler.response_serializer(msg)
        limit = self.conn.server.max_send_message_length
        if len(data) > limit:
            raise _Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(data)} vs. "
                                                               f"{limit})")
        prefix = b"\x00" + len(data).to_bytes(4, "big")
        conn = self.conn
        head = b""
        if not self.headers_sent:
            self.headers_sent = True
            head = _frame(HEADERS, END_HEADERS, self.sid, RESPONSE_HEADERS)
        n = 5 + len(data)
        if not self.pending and n <= conn.peer_max_frame and n <= self.send_window + conn.window_shift \
                and n <= conn.send_window:
            self.send_window -= n
            conn.send_window -= n
            conn.write(b"".join((head, _head(n, DATA, 0, self.sid), prefix, data)))  # the message copied once
            return not conn.paused
        if head:
            conn.write(head)
        self.pending += prefix
        self.pending += data
        self.flush()
        return not self.pending and not conn.paused

    def flush(self) -> None:
        """Send what the windows now allow of `pending`; wake a writer waiting for it."""
        conn = self.conn
        p = self.pending
        out = []
        while p:
            n = min(len(p), conn.peer_max_frame, self.send_window + conn.window_shift, conn.send_window)
            if n <= 0:
                break
            out.append(_head(n, DATA, 0, self.sid) + bytes(p[:n]))
            del p[:n]
            self.send_window -= n
            conn.send_window -= n
        if out:
            conn.write(b"".join(out))
        if p:
            conn.waiting[self.sid] = self
            return
        conn.waiting.pop(self.sid, None)
        if self.status is not None and not self.closed:
            self._send_trailers()
        self.wake_writer()

    def wake_writer(self) -> None:
        d = self.drained
        if d is not None and not d.done() and not self.pending and not self.conn.paused:
            d.set_result(None)

    async def _drain(self) -> None:
        while (self.pending or self.conn.paused) and not self.closed:
            self.drained = self.conn.loop.create_future()
            try:
                await self.drained
            finally:
                self.drained = None
        if self.closed and self.reset:
            raise asyncio.CancelledError()

    def finish(self, code: grpc.StatusCode, details: str | None) -> None:
        """End the call: trailers, after any pending data. A client still sending is not reset (grpcio's
        client then reports INTERNAL instead of our status; Envoy resets the stream itself when it reads the
        trailers): what it sends afterwards is dropped, counted only on the connection's window."""
        if self.closed or self.status is not None:
            return
        self.status, self.details = code, details
        if not self.pending:
            self._send_trailers()

    def _send_trailers(self) -> None:
        assert self.status is not None
        block = _trailers(self.status, self.details)
        if not self.headers_sent:  # trailers-only
            self.headers_sent = True
            block = RESPONSE_HEADERS + block
        self.closed = True
        self.conn.write(_frame(HEADERS, END_HEADERS | END_STREAM, self.sid, block))
        self.conn.release(self)

    def finish_now(self, code: grpc.StatusCode, details: str) -> None:
        """A fault in what the client sent (or its deadline): drop what waits to go out, end the call with
        `code` and cancel its handler."""
        self.pending.clear()
        self.finish(code, details)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def on_reset(self) -> None:
        self.reset = True
        self.closed = True
        self.pending.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        d = self.drained
        if d is not None and not d.done():
            d.set_result(None)
        self.conn.release(self)

    # --- the handler ---------------------------------------------------------------------------------
    async def run(self) -> None:
        h = self.handler
        arg: Any = None
        result: Any = None
        try:
            deserialize = h.request_deserializer
            if h.request_streaming:
                arg = self._messages(deserialize)
            else:
                arg = await self._one(deserialize)
            if h.response_streaming:
                result = (h.stream_stream if h.request_streaming else h.unary_stream)(arg, self)
                if hasattr(result, "__aiter__"):
                    async for r in result:
                        if not self._send_message(r):
                            await self._drain()
                else:
                    await result
            else:
                r = await (h.stream_unary if h.request_streaming else h.unary_unary)(arg, self)
                if r is not None and self.code_set is None:
                    if not self._send_message(r):
                        await self._drain()
            self.finish(self.code_set or grpc.StatusCode.OK, self.details)
        except _Aborted as e:
            code, details = e.args
            self.finish(code, details)
        except asyncio.CancelledError:
            if not self.closed:  # cancelled by our own shutdown or a deadline, not by the peer
                self.finish(self.code_set or grpc.StatusCode.CANCELLED, self.details or "call cancelled")
        except Exception as e:  # noqa: BLE001 - the servicer's bug becomes the call's status, as in grpcio
            if self.code_set is None:
                log.exception("gRPC handler %s failed", self.method)
                self.finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")
            else:  # e.g. the generated base class: set_code(UNIMPLEMENTED), then raise
                self.finish(self.code_set, self.details)
        finally:
            if self.timer is not None:
                self.timer.cancel()
            # generators left suspended would be finalized later by the loop, one task each: close them now
            # (the servicer's first, so its `finally` runs while the call is still this task's)
            for gen in (result, arg):
                if hasattr(gen, "aclose"):
                    with contextlib.suppress(BaseException):
                        await gen.aclose()
            # the call leaves the connection with its trailers (or the peer's reset), not here: trailers
            # may still wait behind data the peer's window does not take yet

    def expire(self) -> None:
        """The client's grpc-timeout passed: DEADLINE_EXCEEDED replaces whatever was still to be sent."""
        self.status, self.details = None, None  # even trailers already waiting behind unsent data
        if not self.closed:
            self.finish_now(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # --- grpc.aio.ServicerContext, the parts servicers use -------------------------------------------
    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort with OK")
        raise _Aborted(code, details)

    async def write(self, message: Any) -> None:
        if not self._send_message(message):
            await self._drain()

    async def read(self) -> Any:
        raise NotImplementedError("read() is not supported by this server; iterate the requests")

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code_set = code

    def set_details(self, details: str) -> None:
        self.details = details

    def code(self) -> grpc.StatusCode | None:
        return self.code_set

    def cancelled(self) -> bool:
        return self.reset

    def done(self) -> bool:
        return self.closed

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in self.headers if not k.startswith(":"))

    def peer(self) -> str:
        return self.conn.peer_name

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self.conn.loop.time())



class _Connection(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer_name = "unknown"
        self.buf = b""
        self.preface = False
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST_BYTES)
        self.calls: dict[int, _Call] = {}
        self.last_sid = 0
        self.peer_initial_window = 65_535
        self.peer_max_frame = MAX_FRAME
        self.send_window = 65_535
        # SETTINGS_INITIAL_WINDOW_SIZE moves every stream's window: one shift here, not a loop over the streams
        self.window_shift = 0
        self.waiting: dict[int, _Call] = {}  # calls whose output waits for window: what a WINDOW_UPDATE wakes
        self.corked: list[bytes] | None = None  # while a read's frames are handled, writes gather here
        self.recv_window = CONNECTION_WINDOW  # raised from 65,535 by our first WINDOW_UPDATE
        self.paused = False
        self.header_sid = 0  # a header block in progress (HEADERS without END_HEADERS), and its parts
        self.header_flags = 0
        self.header_parts: list[bytes] = []
        self.header_bytes = 0
        self.goaway_sent = False
        self.last_rx = self.loop.time()  # when the peer last sent anything: its silence starts a PING
        self.heard = True  # anything received since our last PING (uvloop's clock is per loop turn, in ms)
        self.ping_sent: float | None = None
        self.keepalive: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self.server
        if len(server.connections) >= server.max_connections:  # idle h2 connections that answer PINGs stay
            server.refused_connections += 1
            server.refusal_log.warning("connections", "gRPC connection refused: already %d open (the cap)",
                                       len(server.connections))
            transport.abort()
            return
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio's classes
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer_name = f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"ipv4:{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=1 << 20)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, self.server.max_streams_per_connection),
            (S_INITIAL_WINDOW_SIZE, STREAM_WINDOW), (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_BYTES),
            (S_ENABLE_PUSH, 0)))
        transport.write(_frame(SETTINGS, 0, 0, settings)
                        + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - 65_535)))
        self.server.connections.add(self)
        self.loop.call_later(PREFACE_TIMEOUT_S, self._check_preface)
        if self.server.keepalive_time_s > 0:
            self.keepalive = self.loop.call_later(self.server.keepalive_time_s, self._check_alive)

    def _check_preface(self) -> None:
        """A client that connects and says nothing holds a socket for nothing (and would block a drain)."""
        if not self.preface and self.transport is not None and not self.transport.is_closing():
            log.info("gRPC connection from %s closed: no HTTP/2 preface within %.0fs", self.peer_name,
                     PREFACE_TIMEOUT_S)
            self.transport.close()

    def _check_alive(self) -> None:
        """Silence past `keepalive_time_s` sends a PING; any frame at all after it proves the peer alive."""
        t = self.transport
        if t is None or t.is_closing():
            return
        now = self.loop.time()
        server = self.server
        if self.ping_sent is not None and not self.heard:
            if now - self.ping_sent < server.keepalive_timeout_s:
                self.keepalive = self.loop.call_at(self.ping_sent + server.keepalive_timeout_s, self._check_alive)
                return
            log.warning("gRPC connection from %s closed: nothing received for %.0fs, not even the answer to a "
                        "PING; %d open calls end as cancelled", self.peer_name, now - self.last_rx, len(self.calls))
            t.abort()
            return
        self.ping_sent = None
        if now - self.last_rx >= server.keepalive_time_s:
            self.write(_frame(PING, 0, 0, _KEEPALIVE_PING))
            self.ping_sent, self.heard = now, False
            self.keepalive = self.loop.call_at(now + server.keepalive_timeout_s, self._check_alive)
        else:
            self.keepalive = self.loop.call_at(self.last_rx + server.keepalive_time_s, self._check_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.keepalive is not None:
            self.keepalive.cancel()
        for call in list(self.calls.values()):
            call.on_reset()
        self.calls.clear()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for call in list(self.calls.values()):
            call.wake_writer()

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.loop.time()
        self.heard = True
        self.corked = []  # what the frames of this read answer (ACKs, WINDOW_UPDATEs, data): one write
        try:
            self._frames(self.buf + data if self.buf else data)
        except _ConnectionError as e:
            self.close(e.code, str(e))
        except hpack.HPACKError as e:
            self.close(COMPRESSION_ERROR, f"header block: {e}")
        finally:
            self._uncork()

    def _uncork(self) -> None:
        out, self.corked = self.corked, None
        if out:
            self.write(b"".join(out))

    # --- frames --------------------------------------------------------------------------------------
    def _frames(self, buf: bytes) -> None:
        pos = 0
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf = buf
                return
            if not buf.startswith(PREFACE):
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self.preface = True
        n = len(buf)
        while n - pos >= 9:
            word = int.from_bytes(buf[pos:pos + 4], "big")
            length = word >> 8
            if length > MAX_FRAME:
                raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes over {MAX_FRAME}")
            end = pos + 9 + length
            if end > n:
                break
            kind = word & 0xFF
            flags = buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = buf[pos + 9:end]
            pos = end
            if self.header_sid and kind != CONTINUATION:
                raise _ConnectionError(PROTOCOL_ERROR, "a header block interrupted by another frame")
            if kind == DATA:
                self._data(sid, flags, payload)
            elif kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload)
            elif kind == PING:
                if len(payload) != 8 or sid:
                    raise _ConnectionError(FRAME_SIZE_ERROR, "bad PING")
                if not flags & ACK:
                    self.write(_frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM:
                if len(payload) != 4 or not sid:
                    raise _ConnectionError(PROTOCOL_ERROR, "bad RST_STREAM")
                call = self.calls.get(sid)
                if call is not None:
                    call.on_reset()
            elif kind == PUSH_PROMISE:
                raise _ConnectionError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # ignored: PRIORITY (§5.3.2), unknown types (§4.1), GOAWAY (the peer opens no more streams;
            # the open ones run to their end)
        self.buf = buf[pos:]

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1:len(payload) - payload[0]]
        return payload

    def _data(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        flow_len = len(payload)
        self.recv_window -= flow_len  # counts on the connection whatever becomes of the stream
        if self.recv_window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection sent past its window")
        if self.recv_window <= CONNECTION_WINDOW // 2:
            # the stream windows bound what waits unread; the connection's only paces the peer
            self.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - self.recv_window)))
            self.recv_window = CONNECTION_WINDOW
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we closed: what was in flight is dropped (its window is ours to forget)
        data = self._strip_padding(flags, payload)
        call.on_data(data, bool(flags & END_STREAM), flow_len)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block)
        else:
            self.header_sid, self.header_flags, self.header_parts, self.header_bytes = sid, flags, [block], len(block)

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != self.header_sid or not sid:
            raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self.header_parts.append(payload)
        self.header_bytes += len(payload)
        if self.header_bytes > MAX_HEADER_LIST_BYTES:
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"header block over {MAX_HEADER_LIST_BYTES} bytes")
        if len(self.header_parts) > MAX_HEADER_FRAMES:  # empty CONTINUATIONs add no bytes, only frames
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"header block in over {MAX_HEADER_FRAMES} frames")
        if flags & END_HEADERS:
            block = b"".join(self.header_parts)
            self.header_sid, self.header_parts = 0, []
            self._header_block(sid, self.header_flags, block)

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        headers = self.decoder.decode(block, raw=False)  # the decoder's table must see every block
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client end its half of the stream
            if not flags & END_STREAM:
                raise _ConnectionError(PROTOCOL_ERROR, "second HEADERS without END_STREAM")
            call.on_end()
            return
        if sid % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on server stream {sid}")
        if sid <= self.last_sid:
            return  # trailers of a stream we already closed
        self.last_sid = sid
        if self.goaway_sent:
            return  # opened after our GOAWAY: not processed (RFC 9113 §6.8), the peer retries elsewhere
        self._open(sid, flags, headers)

    def _open(self, sid: int, flags: int, headers: list[tuple[str, str]]) -> None:
        server = self.server
        if len(self.calls) >= server.max_streams_per_connection:
            self.write(_frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        path = method = ""
        timeout = None
        for k, v in headers:
            if k == ":path":
                path = v
            elif k == ":method":
                method = v
            elif k == "grpc-timeout":
                timeout = _timeout(v)
        handler = server.methods.get(path)
        call = _Call(self, sid, path, handler, headers)
        self.calls[sid] = call
        if flags & END_STREAM:
            call.ended = True
        if method != "POST":
            call.finish(grpc.StatusCode.INTERNAL, f"method {method!r} is not POST")
        elif handler is None:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
        elif server.active >= server.max_concurrent_rpcs:
            call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
        else:
            server.active += 1
            if timeout is not None:
                call.deadline = self.loop.time() + timeout
                call.timer = self.loop.call_at(call.deadline, call.expire)
            call.task = self.loop.create_task(call.run())

    def release(self, call: _Call) -> None:
        self.waiting.pop(call.sid, None)
        if call.partial_held:  # what the client was still sending is dropped with the call
            self.server.partial_bytes -= call.partial_held
            call.partial_held = 0
            call.partial = bytearray()
        if self.calls.pop(call.sid, None) is not None and call.task is not None:
            self.server.active -= 1
            if not self.calls and self.goaway_sent and self.transport is not None:
                self._uncork()
                self.transport.close()

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                self.window_shift += value - self.peer_initial_window
                self.peer_initial_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == S_HEADER_TABLE_SIZE:
                pass  # we never index, so the peer's table size does not constrain us
        self.write(_frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_all()
            return
        call = self.calls.get(sid)
        if call is None:
            return
        call.send_window += inc
        if call.send_window + self.window_shift > MAX_WINDOW:
            self.write(_frame(RST_STREAM, 0, sid, _U32.pack(FLOW_CONTROL_ERROR)))
            call.on_reset()
            return
        if call.pending:
            call.flush()

    def _flush_all(self) -> None:
        """Only the calls waiting for window: a flood of WINDOW_UPDATEs or SETTINGS costs O(1) a frame, not
        O(open streams)."""
        if self.waiting:
            for call in list(self.waiting.values()):
                call.flush()

    # --- output --------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.corked is not None:
            self.corked.append(data)
            return
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(data)
        if t.get_write_buffer_size() > MAX_OUTPUT_BUFFER:
            log.warning("closing the gRPC connection from %s: %d bytes it does not read", self.peer_name,
                        t.get_write_buffer_size())
            t.abort()

    def close(self, code: int, why: str) -> None:
        log.info("gRPC connection from %s closed: %s", self.peer_name, why)
        self.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(code) + why.encode()[:256]))
        self._uncork()
        if self.transport is not None:
            self.transport.close()

    def start_goaway(self) -> None:
        """Graceful: no new streams, the open ones finish, then the connection closes."""
        if self.goaway_sent:
            return
        self.goaway_sent = True
        self.write(_frame(GOAWAY, 0, 0, _U32.pack(self.last_sid) + _U32.pack(NO_ERROR)))
        if not self.calls and self.transport is not None:
            self._uncork()
            self.transport.close()


class H2GrpcServer:
    """grpc.aio.Server's shape where the picker uses it: register servicers, listen, start, stop(grace)."""

    def __init__(self, *, max_concurrent_rpcs: int, max_receive_message_length: int = 4 << 20,
                 max_send_message_length: int = 4 << 20,
                 max_streams_per_connection: int = DEFAULT_MAX_STREAMS_PER_CONNECTION,
                 keepalive_time_s: float = KEEPALIVE_TIME_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_partial_bytes: int | None = None) -> None:
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_receive_message_length = max_receive_message_length
        self.max_send_message_length = max_send_message_length
        self.max_streams_per_connection = max_streams_per_connection  # the server cap answers beyond it
        self.keepalive_time_s = keepalive_time_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.max_connections = max_connections  # more are closed as they arrive
        # bytes of messages still arriving, all calls together: past it the call that grows them ends
        self.max_partial_bytes = max_receive_message_length if max_partial_bytes is None else max_partial_bytes
        self.partial_bytes = 0
        self.refused_connections = 0
        self.refusal_log = Throttled(log)
        self.methods: dict[str, Any] = {}
        self.connections: set[_Connection] = set()
        self.active = 0
        self._servers: list[asyncio.AbstractServer] = []

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        """The generated code registers each service twice; the registered form below is the one used."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, h in handlers.items():
            self.methods[f"/{service}/{name}"] = h

    async def bind(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                   reuse_port: bool = False) -> int:
        """Bind now (a taken port fails here, as grpcio's add_*_port does); serve from `start()`."""
        loop = asyncio.get_running_loop()
        h: str | None = host.strip("[]") or None
        if h in ("0.0.0.0", "::"):
            h = None  # every address of both families, as grpcio binds them
        try:
            srv = await loop.create_server(lambda: _Connection(self), h, port, ssl=ssl_context,
                                           reuse_port=reuse_port or None, start_serving=False)
        except OSError as e:  # grpcio raises RuntimeError for this too
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        self._servers.append(srv)
        return int(srv.sockets[0].getsockname()[1])

    async def start(self) -> None:
        for srv in self._servers:
            await srv.start_serving()

    async def stop(self, grace: float | None) -> None:
        """No new connections or streams; open calls get `grace` seconds, then they are cancelled."""
        for srv in self._servers:
            srv.close()
        for c in list(self.connections):
            c.start_goaway()
        deadline = time.monotonic() + (grace or 0)
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = [call.task for c in list(self.connections) for call in list(c.calls.values())
                 if call.task is not None and not call.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await srv.wait_closed()
        self._servers.clear()


def server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """An h2 server context from PEM in memory: the key goes through an anonymous memfd, never a file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    fds = []
    try:
        for name, pem in (("crt", cert_pem), ("key", key_pem)):
            fd = os.memfd_create(f"epp-tls-{name}", os.MFD_CLOEXEC)
            fds.append(fd)
            os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)
    return ctx

