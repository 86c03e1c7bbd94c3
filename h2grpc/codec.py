"""HTTP/2 framing (RFC 9113 §4, §6) and the few HPACK pieces the server writes (RFC 7541).

Responses use only literal header fields without indexing, so the server keeps no encoder state; requests
go through h2grpc's own decoder (`hpack_decode`: Envoy uses Huffman and the dynamic table), held to a
header-list size and a dynamic-table size. `hpack` still gives the decoder its exception classes, static table
and Huffman code (and the tests their encoder).
"""

from __future__ import annotations

import struct
from urllib.parse import quote

import grpc
import hpack

from h2grpc.hpack_decode import Decoder

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, \
    S_MAX_HEADER_LIST_SIZE = 1, 2, 3, 4, 5, 6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, _, STREAM_CLOSED, FRAME_SIZE_ERROR, \
    REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, _, ENHANCE_YOUR_CALM = range(12)
MAX_WINDOW = (1 << 31) - 1

U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")


class ConnectionError_(Exception):  # noqa: N801 - not the builtin ConnectionError (an OSError)
    """A connection error (RFC 9113 §5.4.1): GOAWAY with `code`, then the connection closes."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


def head(length: int, kind: int, flags: int, sid: int) -> bytes:
    return (length << 8 | kind).to_bytes(4, "big") + bytes((flags,)) + sid.to_bytes(4, "big")


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return head(len(payload), kind, flags, sid) + payload


def hpack_int(n: int, prefix_bits: int, first: int = 0) -> bytes:
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


def literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman: no encoder state on either side."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: :status 200 (static 8)
_TRAILERS_OK = literal(b"grpc-status", b"0")


def trailers(code: grpc.StatusCode, details: str | None) -> bytes:
    if code is grpc.StatusCode.OK and not details:
        return _TRAILERS_OK
    block = literal(b"grpc-status", str(code.value[0]).encode())
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' as is, everything else %XX of its UTF-8
        block += literal(b"grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode())
    return block


def grpc_timeout(value: str) -> float | None:
    """grpc-timeout: up to 8 digits and a unit (H M S m u n)."""
    units = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
    if len(value) < 2 or len(value) > 9 or value[-1] not in units or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * units[value[-1]]


def header_decoder(max_header_list_bytes: int, table_size: int) -> Decoder:
    """The peer's HPACK: a decoded list over `max_header_list_bytes` (RFC 7541 §4.1 sizes, counted as it
    decodes, so a small block of indexed references cannot expand first) and a dynamic table over
    `table_size` (what our SETTINGS allow) are HPACK errors (`HPACKError`). `decode(block)` gives what
    `hpack.Decoder.decode(block, raw=False)` gave, at a fraction of its cost (`bench/bench_hpack.py`)."""
    return Decoder(max_header_list_bytes, table_size)


HPACKError = hpack.HPACKError
