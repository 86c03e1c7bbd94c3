"""Unfinished messages against a server in a child process, measured in the child's resident memory.

A counter of buffered bytes says what the server meant to hold; VmRSS says what it holds: the copies per frame,
a buffer grown by reallocation, the allocator's holes and a buffer kept after its call all show there and
nowhere else. The server is a child process (its RSS is not this process's client buffers), serving a
stream-stream method that reads its requests (and drops them), over h2grpc (`h2`) or grpcio's asyncio server (`grpcio`).

`python -m tests.h2.partial_rss [--transport h2|grpcio] [--calls 10] [--mb 30]` prints the figures of one attack:
`calls` messages of `mb` MB each, announced whole and sent but their last byte, over one connection (the
figure the README's bound row quotes). Tests import `ServerProcess` and `Attack`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import multiprocessing as mp
import os
import struct
import sys
import time
from typing import Any

import grpc
import hpack

from h2grpc import codec as h2

_PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20


def _same(b: bytes) -> bytes:
    return b


def _heap_up_to_32_mib() -> None:
    """A long-running server has freed big blocks before (each large body it took), and glibc's malloc then
    serves blocks up to that size (at most 32 MiB, its dynamic mmap threshold's ceiling) from its heap, where a
    buffer that grows is copied and leaves holes that stay resident. A fresh process maps each block over
    128 KiB on its own, which hides that: set the threshold where a long-running one ends up."""
    if os.environ.get("RSS_FRESH_MALLOC"):
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * MiB)  # M_MMAP_THRESHOLD


def _serve(transport: str, cap: int, budget: int, port_q: Any) -> None:
    _heap_up_to_32_mib()
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency of the picker
        pass

    async def hold(requests, context):  # noqa: ANN001, ANN202
        # reads, as the ext_proc servicer does (grpcio's core takes in a message only for a reader); the
        # messages never end, so the reads never return
        async for r in requests:
            del r  # dropped: whatever stays held is the server's
        yield b""

    async def main() -> None:
        handler = grpc.stream_stream_rpc_method_handler(hold, request_deserializer=_same,
                                                        response_serializer=_same)
        if transport == "h2":
            from h2grpc import H2GrpcServer
            server: Any = H2GrpcServer(max_concurrent_rpcs=1000, max_receive_message_length=cap,
                                       max_send_message_length=cap, max_partial_bytes=budget)
            server.add_registered_method_handlers("rss.Svc", {"Hold": handler})
            port = await server.bind("127.0.0.1", 0)
        else:
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", cap),
                                              ("grpc.max_send_message_length", cap)],
                                     maximum_concurrent_rpcs=1000)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rss.Svc", {"Hold": handler}),))
            port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        gc.collect()
        port_q.put(port)
        await asyncio.Event().wait()

    asyncio.run(main())


class ServerProcess:
    """A server in a child process; `rss()` reads its VmRSS from /proc."""

    def __init__(self, transport: str = "h2", cap: int = 32 * MiB, budget: int = 32 * MiB) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(transport, cap, budget, q), daemon=True)
        self.proc.start()
        self.port: int = q.get(timeout=60)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def _frame(kind: int, flags: int, sid: int, payload: bytes | memoryview = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + bytes(payload)


_HEADERS = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", "/rss.Svc/Hold"),
                                   (":authority", "x"), ("content-type", "application/grpc"),
                                   ("te", "trailers")])


class Attack:
    """One HTTP/2 connection that opens streams and sends, for each, a message announced at `size` bytes but
    `size - short` of it (plus the 5-byte prefix), honouring the server's flow control, then holds them.
    `statuses` gathers the grpc-status of the streams the server ended."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r: asyncio.StreamReader
        self.w: asyncio.StreamWriter
        self.conn_window = 65_535
        self.initial = 65_535
        self.windows: dict[int, int] = {}
        self.statuses: dict[int, str] = {}
        self.reset: set[int] = set()
        self.more = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        self.next_sid = 1
        self.decoder = hpack.Decoder()
        self.pongs = 0

    async def open(self) -> None:
        self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        self.w.write(h2.PREFACE + _frame(h2.SETTINGS, 0, 0))
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await self.r.readexactly(9)
                n = int.from_bytes(head[:3], "big")
                kind, flags, sid = head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = await self.r.readexactly(n)
                if kind == h2.SETTINGS and not flags & h2.ACK:
                    for i in range(0, n, 6):
                        key, value = struct.unpack_from(">HI", payload, i)
                        if key == h2.S_INITIAL_WINDOW_SIZE:
                            for s in self.windows:
                                self.windows[s] += value - self.initial
                            self.initial = value
                    self.w.write(_frame(h2.SETTINGS, h2.ACK, 0))
                elif kind == h2.WINDOW_UPDATE:
                    inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
                    if sid == 0:
                        self.conn_window += inc
                    elif sid in self.windows:
                        self.windows[sid] += inc
                elif kind == h2.PING and not flags & h2.ACK:
                    self.w.write(_frame(h2.PING, h2.ACK, 0, payload))
                elif kind == h2.PING:
                    self.pongs += 1
                elif kind == h2.HEADERS and flags & h2.END_STREAM:
                    status = dict(self.decoder.decode(payload)).get("grpc-status")
                    if status is not None:
                        self.statuses[sid] = status
                    self.windows.pop(sid, None)
                elif kind == h2.HEADERS:
                    self.decoder.decode(payload)
                elif kind == h2.RST_STREAM:
                    self.reset.add(sid)
                    self.windows.pop(sid, None)
                elif kind == h2.GOAWAY:
                    return
                self.more.set()

    async def send_unfinished(self, calls: int, size: int, short: int = 1, timeout: float = 120.0) -> list[int]:
        """Open `calls` streams and send on each a message announced at `size` bytes, all of it but `short`
        bytes, a frame to each stream in turn (so the server's buffers grow interleaved, as Envoy's streams do).
        Returns the stream ids; a stream the server ends or resets gets no more (without error)."""
        body = memoryview(b"\x00" + size.to_bytes(4, "big") + b"x" * (size - short))
        return await self.send_interleaved(_HEADERS, body, calls, timeout)

    async def send_interleaved(self, headers: bytes, body: memoryview, calls: int, timeout: float) -> list[int]:
        """Open `calls` streams with `headers` and send `body` on each, a DATA frame to each stream in turn,
        honouring the server's windows; a stream the server ends, answers or resets gets no more."""
        sids = []
        for _ in range(calls):
            sid = self.next_sid
            self.next_sid += 2
            self.windows[sid] = self.initial
            self.w.write(_frame(h2.HEADERS, h2.END_HEADERS, sid, headers))
            sids.append(sid)
        pos = dict.fromkeys(sids, 0)
        deadline = time.monotonic() + timeout
        while True:
            todo = [s for s in sids if pos[s] < len(body) and s in self.windows and s not in self.statuses]
            if not todo:
                break
            sent = False
            for sid in todo:
                n = min(16_384, len(body) - pos[sid], self.windows[sid], self.conn_window)
                if n <= 0:
                    continue
                self.w.write(_frame(h2.DATA, 0, sid, body[pos[sid]:pos[sid] + n]))
                self.windows[sid] -= n
                self.conn_window -= n
                pos[sid] += n
                sent = True
            if not sent:
                self.more.clear()
                await self.w.drain()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.more.wait(), max(0.0, deadline - time.monotonic()))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no window for {timeout}s")
            elif self.w.transport.get_write_buffer_size() > 1 << 20:
                await self.w.drain()
        await self.w.drain()
        return sids

    async def wait_for(self, sid: int, timeout: float = 30.0) -> str | None:
        """The grpc-status the server ended `sid` with (None: reset, or not ended within `timeout`)."""
        deadline = time.monotonic() + timeout
        while sid not in self.statuses and sid not in self.reset and time.monotonic() < deadline:
            self.more.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.more.wait(), 0.5)
        return self.statuses.get(sid)

    async def ping(self, timeout: float = 60.0) -> None:
        """Two PINGs answered, one after the other: the server has handled every frame sent before them (it
        reads them in order), and the handlers those frames woke have run (its loop runs what is ready before
        it reads the second)."""
        for _ in range(2):
            await self._ping(timeout)

    async def _ping(self, timeout: float) -> None:
        want = self.pongs + 1
        self.w.write(_frame(h2.PING, 0, 0, b"rss-ping"))
        await self.w.drain()
        deadline = time.monotonic() + timeout
        while self.pongs < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no PING ACK in {timeout}s")
            self.more.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.more.wait(), 0.5)

    def cancel(self, sid: int) -> None:
        self.w.write(_frame(h2.RST_STREAM, 0, sid, (8).to_bytes(4, "big")))  # CANCEL

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.w.close()
        with contextlib.suppress(Exception):
            await self.w.wait_closed()


def steady_rss(server: ServerProcess) -> int:
    """The server's RSS once it has handled what it was sent (after a PING answered): the largest of a few
    readings, so a page the allocator is still returning does not flatter it."""
    readings = []
    for _ in range(3):
        readings.append(server.rss())
        time.sleep(0.05)
    return max(readings)


async def rss_falls_to(server: ServerProcess, limit: int, timeout: float = 30.0) -> int:
    """The server's RSS once it is at most `limit`, or after `timeout` (the caller asserts on the value): a
    closed connection is noticed by the server in its own time, with no answer to wait for."""
    deadline = time.monotonic() + timeout
    while True:
        now = server.rss()
        if now <= limit or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.2)


async def attack(transport: str, calls: int, size: int, cap: int, budget: int, short: int = 1) -> dict[str, float]:
    server = ServerProcess(transport, cap=cap, budget=budget)
    try:
        await asyncio.sleep(0.5)
        base = server.rss()
        a = Attack(server.port)
        await a.open()
        sids = await a.send_unfinished(calls, size, short)
        await a.ping()
        held = steady_rss(server)
        for sid in sids:
            a.cancel(sid)
        await a.ping()
        after = steady_rss(server)
        await a.close()
        return {"base_mb": base / 1e6, "held_growth_mb": (held - base) / 1e6, "after_growth_mb": (after - base) / 1e6,
                "sent_mb": calls * size / 1e6, "ended": float(len(a.statuses) + len(a.reset))}
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=("h2", "grpcio"), default="h2")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--mb", type=int, default=30)
    p.add_argument("--cap-mb", type=int, default=257)
    p.add_argument("--budget-mb", type=int, default=None, help="default: calls x mb + 1 (all fit)")
    p.add_argument("--whole", action="store_true", help="each message whole (the calls still unfinished)")
    a = p.parse_args()
    budget = (a.budget_mb or a.calls * a.mb + 1) * MiB
    out = asyncio.run(attack(a.transport, a.calls, a.mb * 1_000_000, a.cap_mb * MiB, budget, 0 if a.whole else 1))
    print(a.transport, " ".join(f"{k}={v:.1f}" for k, v in out.items()), file=sys.stdout)


if __name__ == "__main__":
    main()
