"""One HTTP/2 connection as an asyncio protocol: frames in, the stream states, flow control both ways, and
the connection's bounds (`limits.Limits`). Each frame costs O(1): the answers to one read's frames leave in
one write, a WINDOW_UPDATE visits only the calls waiting for window, and a new SETTINGS_INITIAL_WINDOW_SIZE
is one shift, not a loop over the open streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING

import grpc

from h2grpc.call import Call
from h2grpc.codec import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_HEADER_TABLE_SIZE,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTING,
    SETTINGS,
    STREAM_CLOSED,
    U32,
    WINDOW_UPDATE,
    ConnectionError_,
    HPACKError,
    frame,
    grpc_timeout,
    header_decoder,
)

if TYPE_CHECKING:
    from h2grpc.server import H2GrpcServer

KEEPALIVE_PING = b"epp-kpal"


class Connection(asyncio.Protocol):
    """One client connection. Frames are handled in `data_received` itself (no task per frame); a connection
    error raised anywhere below becomes one GOAWAY with its code and the close."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.log = server.log
        self.limits = limits = server.limits
        self.stream_window = limits.stream_window  # read on every message: plain attributes, not a lookup chain
        self.credit_step = limits.credit_step
        self.max_frame = limits.max_frame
        self.max_output_buffer = limits.max_output_buffer
        self.connection_window = limits.connection_window
        self.refill_at = limits.connection_window // 2
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer_name = "unknown"
        self.buf = b""
        self.preface = False
        self.decoder = header_decoder(limits.max_header_list_bytes, limits.header_table_size)
        self.calls: dict[int, Call] = {}
        self.last_sid = 0
        self.peer_initial_window = 65_535
        self.peer_max_frame = limits.max_frame
        self.send_window = 65_535
        # SETTINGS_INITIAL_WINDOW_SIZE moves every stream's window: one shift here, not a loop over the streams
        self.window_shift = 0
        self.waiting: dict[int, Call] = {}  # calls whose output waits for window: what a WINDOW_UPDATE wakes
        self.corked: list[bytes] | None = None  # while a read's frames are handled, writes gather here
        self.recv_window = limits.connection_window  # raised from 65,535 by our first WINDOW_UPDATE
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
        self.opened = 0  # streams this connection opened, and of them those the peer reset young (rapid reset)
        self.premature_resets = 0
        self.empty_frames = 0  # empty DATA/HEADERS frames without END_STREAM in a row
        self.lingering: dict[int, None] = {}  # streams we closed first: the peer's frames in flight are ignored
        self.skipped: list[tuple[int, int]] = []  # stream ids the peer skipped (closed, never opened), recent

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
        lim = self.limits
        settings = b"".join(SETTING.pack(k, v) for k, v in (
            (S_MAX_CONCURRENT_STREAMS, self.server.max_streams_per_connection),
            (S_INITIAL_WINDOW_SIZE, lim.stream_window), (S_MAX_HEADER_LIST_SIZE, lim.max_header_list_bytes),
            (S_HEADER_TABLE_SIZE, lim.header_table_size), (S_ENABLE_PUSH, 0)))
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, U32.pack(lim.connection_window - 65_535)))
        self.server.connections.add(self)
        self.loop.call_later(self.limits.preface_timeout_s, self._check_preface)
        if self.server.keepalive_time_s > 0:
            self.keepalive = self.loop.call_later(self.server.keepalive_time_s, self._check_alive)

    def _check_preface(self) -> None:
        """A client that connects and says nothing holds a socket for nothing (and would block a drain)."""
        if not self.preface and self.transport is not None and not self.transport.is_closing():
            self.log.info("gRPC connection from %s closed: no HTTP/2 preface within %.0fs", self.peer_name,
                     self.limits.preface_timeout_s)
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
            self.log.warning("gRPC connection from %s closed: nothing received for %.0fs, not even the answer to a "
                        "PING; %d open calls end as cancelled", self.peer_name, now - self.last_rx, len(self.calls))
            t.abort()
            return
        self.ping_sent = None
        if now - self.last_rx >= server.keepalive_time_s:
            self.write(frame(PING, 0, 0, KEEPALIVE_PING))
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
        except ConnectionError_ as e:
            self.close(e.code, str(e))
        except HPACKError as e:
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
        max_frame = self.max_frame
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(buf):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.buf = buf
                return
            if not buf.startswith(PREFACE):
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            pos = len(PREFACE)
            self.preface = True
        n = len(buf)
        # DATA payloads from 12 KiB (a large message's full frames) are views: the call copies them once
        view: memoryview | None = None
        while n - pos >= 9:
            word = int.from_bytes(buf[pos:pos + 4], "big")
            length = word >> 8
            if length > max_frame:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"frame of {length} bytes over {max_frame}")
            end = pos + 9 + length
            if end > n:
                break
            kind = word & 0xFF
            flags = buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            start = pos + 9
            pos = end
            if self.header_sid and kind != CONTINUATION:
                raise ConnectionError_(PROTOCOL_ERROR, "a header block interrupted by another frame")
            # empty DATA and HEADERS in a row (CVE-2019-9518; CONTINUATIONs: max_header_frames); the hot path,
            # a DATA frame with a payload, pays one test and one attribute read
            if not length and kind <= HEADERS and not flags & END_STREAM:
                self.empty_frames += 1
                if self.empty_frames > self.limits.max_consecutive_empty_frames:
                    raise ConnectionError_(ENHANCE_YOUR_CALM, f"over {self.limits.max_consecutive_empty_frames}"
                                                              " empty frames in a row")
            elif self.empty_frames and kind <= HEADERS:
                self.empty_frames = 0
            if kind == DATA:
                if length < 12_288:
                    self._data(sid, flags, buf[start:end])
                else:
                    if view is None:
                        view = memoryview(buf)
                    self._data(sid, flags, view[start:end])
                continue
            payload = buf[start:end]
            if kind == HEADERS:
                self._headers(sid, flags, payload)
            elif kind == CONTINUATION:
                self._continuation(sid, flags, payload)
            elif kind == SETTINGS:
                self._settings(sid, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(sid, payload)
            elif kind == PING:
                if sid:
                    raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
                if len(payload) != 8:
                    raise ConnectionError_(FRAME_SIZE_ERROR, "PING not of 8 bytes")
                if not flags & ACK:
                    self.write(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM:
                if len(payload) != 4 or not sid:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad RST_STREAM")
                call = self.calls.get(sid)
                if call is not None:
                    call.on_reset()
                    self._count_reset(call)
                elif self._idle(sid):
                    raise ConnectionError_(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")  # §6.4
                else:
                    self.lingering.pop(sid, None)
            elif kind == PRIORITY:  # ignored (§5.3.2) once well-formed (§6.3)
                if not sid:
                    raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._reset(sid, FRAME_SIZE_ERROR)
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # ignored: unknown types (§4.1), GOAWAY (the peer opens no more streams; the open ones run to
            # their end)
        self.buf = buf[pos:]

    def _strip_padding(self, flags: int, payload: bytes | memoryview) -> bytes | memoryview:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1:len(payload) - payload[0]]
        return payload

    def _data(self, sid: int, flags: int, payload: bytes | memoryview) -> None:
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        flow_len = len(payload)
        self.recv_window -= flow_len  # counts on the connection whatever becomes of the stream
        if self.recv_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection sent past its window")
        if self.recv_window <= self.refill_at:
            # the stream windows bound what waits unread; the connection's only paces the peer
            self.write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.connection_window - self.recv_window)))
            self.recv_window = self.connection_window
        call = self.calls.get(sid)
        if call is None:
            self._not_open(sid, flags, "DATA")
            return
        if call.ended:  # half-closed (remote): RFC 9113 §5.1, a stream error of type STREAM_CLOSED
            self._reset(sid, STREAM_CLOSED)
            return
        data = self._strip_padding(flags, payload)
        call.on_data(data, bool(flags & END_STREAM), flow_len)

    def _headers(self, sid: int, flags: int, payload: bytes) -> None:
        if not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(sid, flags, block)
        else:
            self.header_sid, self.header_flags, self.header_parts, self.header_bytes = sid, flags, [block], len(block)

    def _continuation(self, sid: int, flags: int, payload: bytes) -> None:
        if sid != self.header_sid or not sid:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        self.header_parts.append(payload)
        self.header_bytes += len(payload)
        if self.header_bytes > self.limits.max_header_list_bytes:
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"header block over {self.limits.max_header_list_bytes} bytes")
        if len(self.header_parts) > self.limits.max_header_frames:  # empty CONTINUATIONs add no bytes, only frames
            raise ConnectionError_(ENHANCE_YOUR_CALM, f"header block in over {self.limits.max_header_frames} frames")
        if flags & END_HEADERS:
            block = b"".join(self.header_parts)
            self.header_sid, self.header_parts = 0, []
            self._header_block(sid, self.header_flags, block)

    def _header_block(self, sid: int, flags: int, block: bytes) -> None:
        headers = self.decoder.decode(block)  # the decoder's table must see every block
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client end its half of the stream
            if call.ended:  # half-closed (remote): §5.1
                self._reset(sid, STREAM_CLOSED)
            elif not flags & END_STREAM:  # trailers without END_STREAM: a malformed request (§8.1, §8.1.1)
                self._reset(sid, PROTOCOL_ERROR)
            else:
                call.on_end()
            return
        if sid % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on server stream {sid}")
        if sid <= self.last_sid:
            for low, high in self.skipped:
                if low <= sid <= high:  # §5.1.1: a new stream must have a higher id than any opened before
                    raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS opening stream {sid} after {self.last_sid}")
            self._not_open(sid, flags, "HEADERS")
            return
        expected = self.last_sid + 2 if self.last_sid else 1
        if sid > expected:  # the ids skipped are closed, never opened (§5.1.1): a few ranges remembered
            if len(self.skipped) >= 16:
                del self.skipped[0]
            self.skipped.append((expected, sid - 2))
        self.last_sid = sid
        if self.goaway_sent:
            return  # opened after our GOAWAY: not processed (RFC 9113 §6.8), the peer retries elsewhere
        self._open(sid, flags, headers)

    def _open(self, sid: int, flags: int, headers: list[tuple[str, str]]) -> None:
        server = self.server
        if len(self.calls) >= server.max_streams_per_connection:
            self.write(frame(RST_STREAM, 0, sid, U32.pack(REFUSED_STREAM)))
            if not flags & END_STREAM:
                self.linger(sid)
            return
        path = method = ""
        timeout = None
        for k, v in headers:
            if k == ":path":
                path = v
            elif k == ":method":
                method = v
            elif k == "grpc-timeout":
                timeout = grpc_timeout(v)
        handler = server.methods.get(path)
        call = Call(self, sid, path, handler, headers)
        self.calls[sid] = call
        self.opened += 1
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

    def _idle(self, sid: int) -> bool:
        """Idle (§5.1): not opened yet, or an even id (the server's, and it opens none)."""
        return sid > self.last_sid or not sid & 1

    def _not_open(self, sid: int, flags: int, what: str) -> None:
        """DATA or HEADERS on a stream without a call: idle is a connection error (§5.1); a stream we closed
        while the peer was still sending, or reset, takes what was in flight (§5.1 "closed", ignored); any
        other closed stream is a stream error STREAM_CLOSED (§5.1, §6.1)."""
        if self._idle(sid):
            raise ConnectionError_(PROTOCOL_ERROR, f"{what} on idle stream {sid}")
        if sid in self.lingering:
            if flags & END_STREAM:
                del self.lingering[sid]
            return
        self.write(frame(RST_STREAM, 0, sid, U32.pack(STREAM_CLOSED)))

    def _reset(self, sid: int, code: int) -> None:
        """A stream error (§5.4.2): RST_STREAM, the call ends, what the peer has in flight is ignored."""
        self.write(frame(RST_STREAM, 0, sid, U32.pack(code)))
        call = self.calls.get(sid)
        if call is not None:
            call.on_reset()
        self.linger(sid)

    def linger(self, sid: int) -> None:
        """Remember a stream we closed before the peer did: its frames in flight are ignored, not answered.
        At most `max_streams_per_connection` are remembered; a forgotten one's frames get STREAM_CLOSED."""
        lingering = self.lingering
        if len(lingering) >= self.limits.max_streams_per_connection:
            del lingering[next(iter(lingering))]
        lingering[sid] = None

    def _count_reset(self, call: Call) -> None:
        """Rapid reset (CVE-2023-44487), Envoy's premature-reset rule: each stream opened then reset costs a
        header decode, a call and a task, and its slot is free again at once, so the stream cap does not bound
        it. Once the connection has opened `premature_reset_min_streams`, more than half of them reset within
        `premature_reset_s` of opening ends it with ENHANCE_YOUR_CALM. A ratio, not a rate: Envoy, the
        only real client, resets our stream for each downstream client that goes away, at any rate its
        traffic has. Only a stream reset before we answered it counts: in lean mode Envoy ends every
        request's ext_proc stream with a reset once the HTTP request is over, most within a second, after
        the picker's decision went out; the attack resets streams before the server has answered."""
        if call.headers_sent:
            return  # answered already: the work the attack gets for free was done for a peer that waited for it
        lim = self.limits
        if self.loop.time() - call.opened_at < lim.premature_reset_s:
            self.premature_resets += 1
            if self.opened >= lim.premature_reset_min_streams and 2 * self.premature_resets > self.opened:
                raise ConnectionError_(ENHANCE_YOUR_CALM, f"{self.premature_resets} of {self.opened} streams "
                                                          f"reset within {lim.premature_reset_s:g}s of opening")

    def release(self, call: Call) -> None:
        self.waiting.pop(call.sid, None)
        if not call.ended and not call.reset:  # half-closed (local): the peer may still send (§5.1)
            self.linger(call.sid)
        call.drop_partial()
        if self.calls.pop(call.sid, None) is not None and call.task is not None:
            self.server.active -= 1
            if not self.calls and self.goaway_sent and self.transport is not None:
                self._uncork()
                self.transport.close()

    def _settings(self, sid: int, flags: int, payload: bytes) -> None:
        if sid:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, i)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                self.window_shift += value - self.peer_initial_window
                self.peer_initial_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16_384 <= value <= 16_777_215:
                    raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.peer_max_frame = value
            elif key == S_HEADER_TABLE_SIZE:
                pass  # we never index, so the peer's table size does not constrain us
        self.write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        inc = U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
            self._flush_all()
            return
        call = self.calls.get(sid)
        if call is None:
            if self._idle(sid):
                raise ConnectionError_(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")  # §5.1
            return  # closed: allowed in flight (§6.9)
        if inc == 0:
            self._reset(sid, PROTOCOL_ERROR)  # §6.9: a stream error
            return
        call.send_window += inc
        if call.send_window + self.window_shift > MAX_WINDOW:
            self._reset(sid, FLOW_CONTROL_ERROR)
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
        if t.get_write_buffer_size() > self.max_output_buffer:
            self.log.warning("closing the gRPC connection from %s: %d bytes it does not read", self.peer_name,
                        t.get_write_buffer_size())
            t.abort()

    def close(self, code: int, why: str) -> None:
        if code != NO_ERROR:
            self.server.goaways[code] = self.server.goaways.get(code, 0) + 1
        self.log.info("gRPC connection from %s closed: %s", self.peer_name, why)
        self.write(frame(GOAWAY, 0, 0, U32.pack(self.last_sid) + U32.pack(code) + why.encode()[:256]))
        self._uncork()
        if self.transport is not None:
            self.transport.close()

    def start_goaway(self) -> None:
        """Graceful: no new streams, the open ones finish, then the connection closes."""
        if self.goaway_sent:
            return
        self.goaway_sent = True
        self.write(frame(GOAWAY, 0, 0, U32.pack(self.last_sid) + U32.pack(NO_ERROR)))
        if not self.calls and self.transport is not None:
            self._uncork()
            self.transport.close()
