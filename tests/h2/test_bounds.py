"""Each named bound of h2grpc (`h2grpc.limits.Limits`, README.md "Bounds"), driven by a peer that crosses
it: the server's answer (GOAWAY / RST_STREAM code, gRPC status) and the process's resident memory against a
baseline taken in the same test. The margins (RSS_MARGIN) are far under what the unbounded behaviour costs
and far over what a busy machine's noise adds."""

from __future__ import annotations

import asyncio
import gc
import struct

import pytest

from h2grpc import Limits, hpack_decode, native
from h2grpc import codec as h2
from h2grpc.call import Call
from tests.h2.wire import connect, frame, goaway_code, msg, request_block, rss, settle, status_of

RSS_MARGIN = 24 << 20
NO_KEEPALIVE = Limits(keepalive_time_s=0)


def _rst(sid: int, code: int = h2.CANCEL) -> bytes:
    return frame(h2.RST_STREAM, 0, sid, struct.pack(">I", code))


# --- rapid reset (CVE-2023-44487) ------------------------------------------------------------------------

async def test_rapid_reset_pairs_end_the_connection_with_enhance_your_calm_at_the_premature_reset_rule() -> None:
    """20,000 HEADERS + RST_STREAM pairs in one burst (the issue's attack): the connection goes with
    ENHANCE_YOUR_CALM once 500 streams were opened and more than half of them reset young."""
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    block = request_block()
    base = rss()
    burst = b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid, block) + _rst(sid) for sid in range(1, 40_001, 2))
    conn.data_received(burst)
    await settle()
    frames = t.take()
    assert goaway_code(frames) == h2.ENHANCE_YOUR_CALM
    goaway = next(p for k, _, _, p in frames if k == h2.GOAWAY)
    assert struct.unpack(">I", goaway[:4])[0] == 999  # the 500th stream: nothing past it was processed
    assert t.closing and conn.opened == 500 and server.active == 0 and not conn.calls
    assert server.goaways == {h2.ENHANCE_YOUR_CALM: 1}
    del burst
    assert rss() - base < RSS_MARGIN
    conn.connection_lost(None)


async def test_resets_of_under_half_the_streams_keep_the_connection() -> None:
    """Envoy resets our stream for each downstream client that leaves: a minority of young resets, at any
    rate, is ordinary traffic."""
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    block = request_block("/test.Svc/Echo")
    out = []
    for i in range(1_000):
        sid = 2 * i + 1
        out.append(frame(h2.HEADERS, h2.END_HEADERS, sid, block))
        if i % 5 < 2:  # 40 % reset at once
            out.append(_rst(sid))
        else:
            out.append(frame(h2.DATA, h2.END_STREAM, sid, msg(b"hi")))
    conn.data_received(b"".join(out))
    await settle(20)
    assert goaway_code(t.take()) is None and not t.closing
    assert conn.opened == 1_000 and conn.premature_resets == 400
    conn.connection_lost(None)


async def test_resets_of_answered_streams_are_not_premature() -> None:
    """Lean mode: Envoy ends each request's ext_proc stream with a reset once its HTTP request is over, most
    within a second of opening and after the picker's answer. 600 such streams keep the connection."""
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    block = request_block("/test.Svc/Echo")
    conn.data_received(b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid, block) + frame(h2.DATA, 0, sid, msg(b"hi"))
                                for sid in range(1, 1201, 2)))
    await settle(20)
    assert all(c.headers_sent for c in conn.calls.values()) and len(conn.calls) == 600
    conn.data_received(b"".join(_rst(sid) for sid in range(1, 1201, 2)))
    await settle()
    assert goaway_code(t.take()) is None and not t.closing
    assert conn.opened == 600 and conn.premature_resets == 0
    conn.connection_lost(None)


async def test_resets_of_old_streams_are_not_premature() -> None:
    """A stream reset after `premature_reset_s` (a client that gave up on a slow answer) does not count."""
    server, handlers, conn, t = connect(Limits(keepalive_time_s=0, premature_reset_min_streams=4,
                                               premature_reset_s=0.05))
    block = request_block()
    conn.data_received(b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid, block) for sid in (1, 3, 5, 7)))
    await asyncio.sleep(0.1)
    conn.data_received(b"".join(_rst(sid) for sid in (1, 3, 5, 7)))
    await settle()
    assert goaway_code(t.take()) is None and conn.premature_resets == 0
    conn.connection_lost(None)


async def test_a_reset_streams_call_and_handler_task_are_released_at_once() -> None:
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, request_block()))
    await settle()
    call = conn.calls[1]
    task = call.task
    assert task is not None and handlers.started == 1 and server.active == 1
    del call
    conn.data_received(_rst(1))
    assert not conn.calls and server.active == 0  # released in the frame's own callback
    await settle()
    assert task.done() and handlers.finished == 1  # the handler's finally ran
    del task
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Call) and o.conn is conn]
    conn.connection_lost(None)


# --- control-frame floods -------------------------------------------------------------------------------

async def test_a_ping_flood_from_a_peer_that_reads_is_answered_in_bounded_memory() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    read = b"".join(frame(h2.PING, 0, 0, b"%08d" % i) for i in range(4_000))
    base = rss()
    for _ in range(50):  # 200,000 PINGs, 4,000 a read
        conn.data_received(read)
        assert len(t.out) == 4_000 * 17  # one write a read, each PING answered
        t.out.clear()
    assert not t.closing and rss() - base < RSS_MARGIN
    conn.connection_lost(None)


async def test_a_ping_flood_from_a_peer_that_never_reads_is_aborted_past_the_output_buffer() -> None:
    server, _, conn, t = connect(Limits(keepalive_time_s=0, max_output_buffer=1 << 20), reads=False)
    read = b"".join(frame(h2.PING, 0, 0, b"%08d" % i) for i in range(4_000))
    base = rss()
    reads = 0
    while not t.closing and reads < 1_000:
        conn.data_received(read)
        reads += 1
    assert t.aborted and reads == (1 << 20) // (4_000 * 17) + 1  # the read whose answers pass 1 MiB
    assert rss() - base < RSS_MARGIN
    conn.connection_lost(None)


async def test_a_settings_flood_costs_no_visit_to_the_open_streams_and_is_acked() -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE moves every open stream's window: one shift, not a loop over them."""
    server, _, conn, t = connect(NO_KEEPALIVE)
    block = request_block()
    conn.data_received(b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid, block) for sid in range(1, 2_001, 2)))
    await settle()
    t.take()
    flood = b"".join(frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 1_000 + i % 2))
                     for i in range(4_000))
    base = rss()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(10):
        conn.data_received(flood)
        assert sum(1 for k, f, _, _ in t.take() if k == h2.SETTINGS and f & h2.ACK) == 4_000
    # 40,000 SETTINGS x 1,000 open streams would be 40 M visits (tens of seconds); one shift each is ~0.1 s
    assert loop.time() - t0 < 5.0 and len(conn.calls) == 1_000 and not t.closing
    assert rss() - base < RSS_MARGIN
    conn.connection_lost(None)


# --- empty frames (CVE-2019-9518) -----------------------------------------------------------------------

async def test_empty_data_frames_past_the_limit_end_the_connection_with_enhance_your_calm() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, request_block()))
    conn.data_received(frame(h2.DATA, 0, 1) * 16)
    assert goaway_code(t.take()) is None  # the limit itself is allowed
    base = rss()
    conn.data_received(frame(h2.DATA, 0, 1) * 100_000)
    assert goaway_code(t.take()) == h2.ENHANCE_YOUR_CALM and t.closing
    assert rss() - base < RSS_MARGIN
    await settle()
    conn.connection_lost(None)


async def test_a_frame_with_a_payload_starts_the_count_of_empty_frames_again() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, request_block()))
    conn.data_received((frame(h2.DATA, 0, 1) * 16 + frame(h2.DATA, 0, 1, b"\x00")) * 10)
    assert goaway_code(t.take()) is None and not t.closing
    await settle()
    conn.connection_lost(None)


async def test_empty_headers_frames_past_the_limit_end_the_connection_with_enhance_your_calm() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid) for sid in range(1, 200, 2)))
    assert goaway_code(t.take()) == h2.ENHANCE_YOUR_CALM
    assert conn.opened == 16  # each empty block opened a stream (ended at once: no :method) until the limit
    await settle()
    conn.connection_lost(None)


# --- HPACK ----------------------------------------------------------------------------------------------

async def test_an_hpack_header_list_bomb_is_a_compression_error() -> None:
    """A 20 KB block that decodes to a 64 MB header list: one 4,000-byte field in the dynamic table, then
    16,000 one-byte references to it. The decoder counts the list as it grows and stops at 64 KiB."""
    server, _, conn, t = connect(NO_KEEPALIVE)
    seed = b"\x40" + h2.hpack_int(1, 7) + b"x" + h2.hpack_int(4_000, 7) + b"v" * 4_000  # indexed: entry 62
    block = seed + b"\xbe" * 16_000
    first, rest = block[:16_000], block[16_000:]
    base = rss()
    conn.data_received(frame(h2.HEADERS, 0, 1, first) + frame(h2.CONTINUATION, h2.END_HEADERS, 1, rest))
    assert goaway_code(t.take()) == h2.COMPRESSION_ERROR and t.closing
    assert not conn.calls and rss() - base < RSS_MARGIN
    conn.connection_lost(None)


@pytest.mark.parametrize("path", ["c", "pure"])
@pytest.mark.parametrize("coded", [b"\xff\xff\xff\xff", b"\x18", b"\x1f\xff"],
                         ids=["eos", "padding-not-ones", "padding-over-7-bits"])
async def test_a_bad_huffman_string_is_a_compression_error(coded: bytes, path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 7541 §5.2: an EOS symbol, or padding over 7 bits or not all ones, in a header's Huffman value; on
    the C decoder (h2grpc._huffman) and on the pure path alike."""
    if path == "c" and native.MODULE is None:
        pytest.skip("h2grpc._huffman is not built or EPP_H2GRPC_PURE is set")
    monkeypatch.setattr(hpack_decode, "huffman_decode",
                        native.MODULE.decode if path == "c" else hpack_decode.huffman_decode_py)
    server, _, conn, t = connect(NO_KEEPALIVE)
    bad = b"\x40\x0bx-trace-bad" + h2.hpack_int(len(coded), 7, 0x80) + coded  # literal, incremental indexing
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, request_block() + bad))
    assert goaway_code(t.take()) == h2.COMPRESSION_ERROR and t.closing
    assert not conn.calls
    conn.connection_lost(None)


async def test_a_dynamic_table_size_update_over_our_setting_is_a_compression_error() -> None:
    """RFC 7541 §6.3: a size update over SETTINGS_HEADER_TABLE_SIZE (4,096, advertised) is a decoding error;
    without the check a peer could make the decoder keep a table of any size."""
    server, _, conn, t = connect(NO_KEEPALIVE)
    update = h2.hpack_int(1 << 24, 5, 0x20)  # dynamic table size update to 16 MiB
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, update + request_block()))
    assert goaway_code(t.take()) == h2.COMPRESSION_ERROR and t.closing
    conn.connection_lost(None)


async def test_a_dynamic_table_size_within_our_setting_is_taken() -> None:
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, h2.hpack_int(4_096, 5, 0x20) + request_block()))
    await settle()
    assert goaway_code(t.take()) is None and handlers.started == 1
    conn.connection_lost(None)
    await settle()


# --- flow control: readers that do not read -------------------------------------------------------------

async def test_a_zero_window_reader_parks_each_handler_on_one_message() -> None:
    """A peer that opens no window: each handler waits with one message framed, nothing more piles up."""
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, 0)))
    block = request_block("/test.Svc/Flood")
    base = rss()
    conn.data_received(b"".join(frame(h2.HEADERS, h2.END_HEADERS, sid, block)
                                + frame(h2.DATA, h2.END_STREAM, sid, msg(b"65536")) for sid in range(1, 201, 2)))
    await settle(50)
    assert handlers.started == 100 and handlers.finished == 0 and not t.closing
    assert all(len(c.pending) == 65_541 for c in conn.calls.values())  # one message each, its window shut
    assert not any(k == h2.DATA for k, _, _, _ in t.take())
    assert rss() - base < RSS_MARGIN
    conn.connection_lost(None)
    await settle()
    assert handlers.finished == 100 and server.active == 0


async def test_a_peer_that_never_reads_stops_the_handlers_then_loses_the_connection() -> None:
    """Handlers wait while the transport is paused; control answers that still pile up (a PING flood) pass
    the output cap and the connection is aborted, its calls cancelled."""
    server, handlers, conn, t = connect(Limits(keepalive_time_s=0, max_output_buffer=4 << 20), reads=False)
    block = request_block("/test.Svc/Flood")
    base = rss()
    windows = (frame(h2.SETTINGS, 0, 0, struct.pack(">HI", h2.S_INITIAL_WINDOW_SIZE, h2.MAX_WINDOW))
               + frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", h2.MAX_WINDOW - 65_535)))
    conn.data_received(windows + frame(h2.HEADERS, h2.END_HEADERS, 1, block)
                       + frame(h2.DATA, h2.END_STREAM, 1, msg(b"16000")))
    await settle(200)
    assert conn.paused and not t.aborted and handlers.finished == 0
    parked = t.buffered
    await settle(200)
    assert t.buffered == parked  # the handler is parked on the paused transport
    pings = b"".join(frame(h2.PING, 0, 0, b"%08d" % i) for i in range(4_000))
    for _ in range(200):
        if t.closing:
            break
        conn.data_received(pings)
    assert t.aborted and t.buffered <= (4 << 20) + len(pings)
    conn.connection_lost(None)
    await settle()
    assert handlers.finished == 1 and server.active == 0
    assert rss() - base < RSS_MARGIN


# --- stream states (RFC 9113 §5.1) ----------------------------------------------------------------------

async def test_data_after_the_peers_end_stream_is_a_stream_closed_reset_and_the_connection_goes_on() -> None:
    """Half-closed (remote): any frame but WINDOW_UPDATE, PRIORITY, RST_STREAM is a stream error of type
    STREAM_CLOSED; the handler is cancelled, the connection serves the next stream."""
    server, handlers, conn, t = connect(NO_KEEPALIVE)
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 1, request_block())
                       + frame(h2.DATA, h2.END_STREAM, 1, msg(b"a")))
    await settle()
    assert handlers.started == 1
    conn.data_received(frame(h2.DATA, 0, 1, msg(b"b")))
    frames = t.take()
    assert (h2.RST_STREAM, 0, 1, struct.pack(">I", h2.STREAM_CLOSED)) in frames
    assert goaway_code(frames) is None and not conn.calls and server.active == 0
    await settle()
    assert handlers.finished == 1
    conn.data_received(frame(h2.HEADERS, h2.END_HEADERS, 3, request_block("/test.Svc/Echo"))
                       + frame(h2.DATA, h2.END_STREAM, 3, msg(b"next")))
    await settle(10)
    frames = t.take()
    assert (h2.DATA, 0, 3, msg(b"next")) in frames
    assert [status_of(p) for k, f, s, p in frames if k == h2.HEADERS and f & h2.END_STREAM] == ["0"]
    conn.connection_lost(None)


# --- frame and block sizes --------------------------------------------------------------------------

async def test_a_frame_over_the_max_frame_size_is_a_frame_size_error_before_its_payload_is_read() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    base = rss()
    conn.data_received((16_385).to_bytes(3, "big") + bytes((h2.DATA, 0)) + (1).to_bytes(4, "big"))
    assert goaway_code(t.take()) == h2.FRAME_SIZE_ERROR and t.closing
    assert rss() - base < RSS_MARGIN
    conn.connection_lost(None)


async def test_a_header_block_over_the_list_size_in_encoded_bytes_is_enhance_your_calm() -> None:
    server, _, conn, t = connect(NO_KEEPALIVE)
    block = b"\x00" * 16_000
    base = rss()
    conn.data_received(frame(h2.HEADERS, 0, 1, block) + frame(h2.CONTINUATION, 0, 1, block) * 4)
    assert goaway_code(t.take()) == h2.ENHANCE_YOUR_CALM and t.closing
    assert len(conn.header_parts) <= 5 and rss() - base < RSS_MARGIN
    conn.connection_lost(None)

