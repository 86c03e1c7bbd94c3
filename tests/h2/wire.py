"""Frames in, frames out, without a socket: a connection driven through a fake transport, and the resident
memory a bound test compares against a baseline taken in the same test."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator

import grpc
import hpack

from h2grpc import H2GrpcServer, Limits
from h2grpc import codec as h2
from h2grpc.connection import Connection

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident bytes of this process now (no psutil: /proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def request_block(path: str = "/test.Svc/Hang") -> bytes:
    return b"".join(h2.literal(k.encode(), v.encode()) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
        ("content-type", "application/grpc"), ("te", "trailers")))


def msg(b: bytes) -> bytes:
    return b"\x00" + len(b).to_bytes(4, "big") + b


def parse(out: bytes) -> list[tuple[int, int, int, bytes]]:
    """The frames of what the server wrote: (type, flags, stream, payload)."""
    frames, pos = [], 0
    while pos + 9 <= len(out):
        n = int.from_bytes(out[pos:pos + 3], "big")
        frames.append((out[pos + 3], out[pos + 4], int.from_bytes(out[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                       out[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return frames


def goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int | None:
    for kind, _, _, payload in frames:
        if kind == h2.GOAWAY:
            return struct.unpack(">I", payload[4:8])[0]
    return None


def status_of(block: bytes) -> str | None:
    return dict(hpack.Decoder().decode(block)).get("grpc-status")


class FakeTransport:
    """What a connection writes. `reads=False`: a peer that never reads: every byte stays in the buffer, and
    past the high-water mark the protocol is told to pause, as a real transport would."""

    def __init__(self, reads: bool = True) -> None:
        self.out = bytearray()
        self.reads = reads
        self.buffered = 0
        self.closing = False
        self.aborted = False
        self.high = 1 << 20
        self.protocol: Connection | None = None

    def get_extra_info(self, name: str) -> None:
        return None

    def set_write_buffer_limits(self, high: int) -> None:
        self.high = high

    def write(self, data: bytes) -> None:
        self.out += data
        if not self.reads:
            before = self.buffered
            self.buffered += len(data)
            if before <= self.high < self.buffered and self.protocol is not None:
                self.protocol.pause_writing()

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True

    def take(self) -> list[tuple[int, int, int, bytes]]:
        frames = parse(bytes(self.out))
        self.out.clear()
        return frames


def _same(b: bytes) -> bytes:
    return b


class Handlers:
    """Hang: waits until released (a call that holds its slot). Flood: writes messages of `size` forever.
    Echo: answers each message."""

    def __init__(self) -> None:
        self.started = 0
        self.finished = 0
        self.release = asyncio.Event()

    async def hang(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:  # noqa: ANN001
        self.started += 1
        try:
            await self.release.wait()
            yield b"released"
        finally:
            self.finished += 1

    async def flood(self, request: bytes, context) -> None:  # noqa: ANN001
        self.started += 1
        try:
            chunk = b"f" * int(request)
            while True:
                await context.write(chunk)
        finally:
            self.finished += 1

    async def echo(self, requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:  # noqa: ANN001
        async for r in requests:
            yield r

    def register(self, server: H2GrpcServer) -> None:
        kw = {"request_deserializer": _same, "response_serializer": _same}
        server.add_registered_method_handlers("test.Svc", {
            "Hang": grpc.stream_stream_rpc_method_handler(self.hang, **kw),
            "Flood": grpc.unary_stream_rpc_method_handler(self.flood, **kw),
            "Echo": grpc.stream_stream_rpc_method_handler(self.echo, **kw)})


def connect(limits: Limits | None = None, reads: bool = True, max_concurrent_rpcs: int = 100_000,
            ) -> tuple[H2GrpcServer, Handlers, Connection, FakeTransport]:
    """A server, its handlers, and one connection past the preface and SETTINGS (its first output taken)."""
    server = H2GrpcServer(max_concurrent_rpcs=max_concurrent_rpcs, limits=limits or Limits(keepalive_time_s=0))
    handlers = Handlers()
    handlers.register(server)
    conn = Connection(server)
    t = FakeTransport(reads)
    t.protocol = conn
    conn.connection_made(t)  # type: ignore[arg-type]
    conn.data_received(h2.PREFACE + frame(h2.SETTINGS, 0, 0))
    t.take()
    return server, handlers, conn, t


async def settle(turns: int = 5) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)
