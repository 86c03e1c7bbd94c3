"""Random and mutated frame sequences through a fake transport, in random read sizes: the connection never
raises out of its callbacks (nor do the handler tasks it starts), never holds more than its bounds allow, and
always ends in a defined state (open and answering, or closed with a GOAWAY of an RFC 9113 error code; after
the peer goes, no call, task or byte of it left)."""

from __future__ import annotations

import asyncio
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2grpc import Limits
from h2grpc import codec as c
from tests.h2.wire import FakeTransport, connect, frame, msg, parse, request_block, settle

LIMITS = Limits(keepalive_time_s=0, max_streams_per_connection=4, max_header_list_bytes=2_048,
                max_header_frames=4, max_output_buffer=1 << 20, premature_reset_min_streams=8)
MAX_RPCS = 6
MAX_PARTIAL = 50_000
PATHS = ["/test.Svc/Echo", "/test.Svc/Hang", "/test.Svc/Nope"]

payloads = st.binary(max_size=48)
sids = st.sampled_from([0, 1, 3, 5, 7, 9, 2, 0x7FFFFFFF])


@st.composite
def raw_frame(draw: st.DrawFn) -> bytes:
    """Any frame header over any small payload: types past the known ones, every flag, any stream."""
    kind = draw(st.integers(0, 11))
    return frame(kind, draw(st.integers(0, 255)), draw(sids), draw(payloads))


@st.composite
def grpc_frame(draw: st.DrawFn) -> bytes:
    """The frames of a plausible conversation, each of which the fuzz may then mutate."""
    sid = draw(st.sampled_from([1, 3, 5, 7, 9, 11]))
    which = draw(st.integers(0, 7))
    if which == 0:
        return frame(c.HEADERS, c.END_HEADERS | draw(st.sampled_from([0, c.END_STREAM])), sid,
                     request_block(draw(st.sampled_from(PATHS))))
    if which == 1:
        data = msg(draw(payloads)) if draw(st.booleans()) else b"\x00" + struct.pack(">I", draw(
            st.integers(0, 1 << 20))) + draw(payloads)
        return frame(c.DATA, draw(st.sampled_from([0, c.END_STREAM])), sid, data)
    if which == 2:
        return frame(c.RST_STREAM, 0, sid, struct.pack(">I", draw(st.integers(0, 13))))
    if which == 3:
        return frame(c.WINDOW_UPDATE, 0, draw(st.sampled_from([0, sid])), struct.pack(">I", draw(
            st.sampled_from([0, 1, 65_535, (1 << 31) - 1]))))
    if which == 4:
        return frame(c.SETTINGS, 0, 0, struct.pack(">HI", draw(st.integers(1, 7)), draw(
            st.sampled_from([0, 1, 16_384, 65_535, 1 << 24, (1 << 31) - 1, 1 << 31]))))
    if which == 5:
        return frame(c.PING, draw(st.sampled_from([0, c.ACK])), 0, b"12345678")
    if which == 6:
        block = request_block(draw(st.sampled_from(PATHS)))
        cut = draw(st.integers(0, len(block)))
        return frame(c.HEADERS, 0, sid, block[:cut]) + frame(c.CONTINUATION, c.END_HEADERS, sid, block[cut:])
    return frame(c.DATA, c.END_STREAM, sid)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(b"".join(draw(st.lists(grpc_frame(), min_size=1, max_size=12))))
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.integers(0, 2))
        if how == 0:
            data[at] = draw(st.integers(0, 255))
        elif how == 1:
            del data[at:at + draw(st.integers(1, 8))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


streams = st.one_of(
    st.lists(raw_frame(), max_size=20).map(b"".join),
    mutated(),
    st.lists(grpc_frame(), min_size=1, max_size=20).map(b"".join),
)


def _check_bounds(server, conn, t: FakeTransport) -> None:  # noqa: ANN001
    assert len(conn.calls) <= LIMITS.max_streams_per_connection
    assert server.active <= MAX_RPCS
    assert 0 <= server.partial_bytes <= MAX_PARTIAL
    assert len(conn.lingering) <= LIMITS.max_streams_per_connection and len(conn.skipped) <= 16
    assert len(conn.header_parts) <= LIMITS.max_header_frames
    assert len(t.out) <= LIMITS.max_output_buffer + 4 * LIMITS.max_frame + 1_000


async def _drive(data: bytes, cuts: list[int]) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    server, handlers, conn, t = connect(LIMITS, max_concurrent_rpcs=MAX_RPCS)
    server.max_partial_bytes = MAX_PARTIAL
    stream = c.PREFACE[:0] + data
    pos = 0
    out = bytearray()
    for cut in [*sorted(cuts), len(stream)]:
        if t.closing:
            break
        conn.data_received(stream[pos:max(pos, cut)])  # raising here fails the test: nothing may escape
        pos = max(pos, cut)
        _check_bounds(server, conn, t)
        await settle(3)
        _check_bounds(server, conn, t)
        out += t.out
        t.out.clear()
    frames = parse(bytes(out))
    codes = [struct.unpack(">I", p[4:8])[0] for k, _, _, p in frames if k == c.GOAWAY]
    assert all(0 <= code <= 13 for code in codes)
    assert bool([code for code in codes if code != c.NO_ERROR]) == t.closing  # closed exactly when it said why
    if not t.closing:  # or else waiting for the rest of a frame or header block, and no more than one frame's
        assert len(conn.buf) < 9 + LIMITS.max_frame + len(c.PREFACE)
    if not t.closing and not conn.buf and not conn.header_sid:  # between frames: still answering
        conn.data_received(frame(c.PING, 0, 0, b"stillok?"))
        assert (c.PING, c.ACK, 0, b"stillok?") in parse(bytes(t.out))
    conn.connection_lost(None)
    await settle(10)
    assert not conn.calls and server.active == 0 and server.partial_bytes == 0
    assert handlers.started == handlers.finished
    assert not errors, errors


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(streams, st.lists(st.integers(0, 600), max_size=6))
def test_random_and_mutated_frames_never_escape_the_callbacks_or_the_bounds(data: bytes, cuts: list[int]) -> None:
    asyncio.run(_drive(data, cuts))
