"""Two servers fed the same frames: h2grpc's connection, and the `h2` library's server-side H2Connection
(hyper-h2, the reference a differential test compares against). Each is reduced to what RFC 9113 fixes:
the connection error it ends with (a GOAWAY code), the streams it resets (RST_STREAM codes), and each stream's
state (RFC 9113 §5.1) as the peer left it."""

from __future__ import annotations

import dataclasses
import struct

import h2.config
import h2.connection
import h2.exceptions
import h2.stream

from h2grpc import Limits
from h2grpc import codec as c
from tests.h2.wire import connect, frame, msg, parse, request_block

TRAILERS = c.literal(b"x-trailer", b"1")


@dataclasses.dataclass(frozen=True)
class Event:
    """One frame (or a header block split in two) a client may send, well-formed or not."""

    kind: str  # headers, split_headers, data, rst, window_update, ping, settings, priority, unknown, continuation
    sid: int
    flag: bool = False  # END_STREAM for headers/data
    value: int = 0  # data bytes, RST code, window increment, PING length, initial window

    def encode(self, opened: set[int]) -> bytes:
        sid = self.sid
        if self.kind in ("headers", "split_headers"):
            block = TRAILERS if sid in opened else request_block()
            opened.add(sid)
            flags = c.END_STREAM if self.flag else 0
            if self.kind == "headers":
                return frame(c.HEADERS, flags | c.END_HEADERS, sid, block)
            return frame(c.HEADERS, flags, sid, block[:3]) + frame(c.CONTINUATION, c.END_HEADERS, sid, block[3:])
        if self.kind == "data":
            return frame(c.DATA, c.END_STREAM if self.flag else 0, sid, msg(b"d" * self.value))
        if self.kind == "rst":
            return frame(c.RST_STREAM, 0, sid, struct.pack(">I", self.value))
        if self.kind == "window_update":
            return frame(c.WINDOW_UPDATE, 0, sid, struct.pack(">I", self.value))
        if self.kind == "ping":
            return frame(c.PING, 0, sid, b"p" * self.value)
        if self.kind == "settings":
            return frame(c.SETTINGS, 0, sid, struct.pack(">HI", c.S_INITIAL_WINDOW_SIZE, self.value))
        if self.kind == "priority":
            return frame(c.PRIORITY, 0, sid, struct.pack(">IB", 0, 15))
        if self.kind == "unknown":
            return frame(0x42, 0, sid, b"u")
        if self.kind == "continuation":
            return frame(c.CONTINUATION, c.END_HEADERS, sid, TRAILERS)
        raise ValueError(self.kind)


@dataclasses.dataclass
class Outcome:
    connection_error: int | None = None  # the GOAWAY code it ended with
    resets: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (stream, RST_STREAM code) sent
    states: dict[int, str] = dataclasses.field(default_factory=dict)  # stream -> idle/open/half_closed_remote/closed


def _events_bytes(events: list[Event]) -> list[bytes]:
    opened: set[int] = set()
    return [e.encode(opened) for e in events]


async def run_h2grpc(events: list[Event]) -> Outcome:
    server, handlers, conn, t = connect(Limits(keepalive_time_s=0))
    out = Outcome()
    for data in _events_bytes(events):
        conn.data_received(data)
        for kind, _, sid, payload in t.take():
            if kind == c.RST_STREAM:
                out.resets.append((sid, struct.unpack(">I", payload)[0]))
            elif kind == c.GOAWAY and struct.unpack(">I", payload[4:8])[0] != c.NO_ERROR:
                out.connection_error = struct.unpack(">I", payload[4:8])[0]
        if out.connection_error is not None:
            break
    if out.connection_error is None:
        for sid in sorted({e.sid for e in events if e.sid}):
            call = conn.calls.get(sid)
            if call is not None:
                out.states[sid] = "half_closed_remote" if call.ended else "open"
            else:
                out.states[sid] = "closed" if sid <= conn.last_sid else "idle"
    conn.connection_lost(None)
    return out


_STATES = {h2.stream.StreamState.OPEN: "open", h2.stream.StreamState.HALF_CLOSED_REMOTE: "half_closed_remote",
           h2.stream.StreamState.CLOSED: "closed", h2.stream.StreamState.IDLE: "idle"}


def run_h2(events: list[Event]) -> Outcome:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, validate_inbound_headers=False))
    conn.initiate_connection()
    conn.data_to_send()
    out = Outcome()
    for data in [c.PREFACE + frame(c.SETTINGS, 0, 0), *_events_bytes(events)]:
        try:
            conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            out.connection_error = int(e.error_code)
            break
        for kind, _, sid, payload in parse(conn.data_to_send()):
            if kind == c.RST_STREAM:
                out.resets.append((sid, struct.unpack(">I", payload)[0]))
    if out.connection_error is None:
        for sid in sorted({e.sid for e in events if e.sid}):
            stream = conn.streams.get(sid)
            if stream is not None:
                out.states[sid] = _STATES.get(stream.state_machine.state, str(stream.state_machine.state))
            else:
                out.states[sid] = "closed" if sid <= conn.highest_inbound_stream_id else "idle"
    return out
