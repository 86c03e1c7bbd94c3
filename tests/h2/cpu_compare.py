"""Same-run CPU comparison of two h2 server implementations (not a test: `python -m tests.h2.cpu_compare OLD.py`).

A trivial bytes servicer (stream-stream echo, and unary) in a child process on uvloop, grpcio's asyncio client
in this one; the server process's user+system CPU from /proc per echoed message (8 concurrent streams) and per
unary request (a stream each: HEADERS, DATA, trailers). Runs alternate old, new, old, new... so both see the
same machine load (each first in every other round); the median of each is reported.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import grpc

MESSAGES = 6_000  # per stream, 8 streams
UNARY = 6_000  # requests, 8 at a time
_TICK = os.sysconf("SC_CLK_TCK")


def _same(b: bytes) -> bytes:
    return b


def _serve(impl: str, port_q: Any) -> None:
    import uvloop

    if impl == "new":
        from h2grpc import H2GrpcServer
    else:
        spec = importlib.util.spec_from_file_location("old_h2server", impl)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        H2GrpcServer = mod.H2GrpcServer  # noqa: N806

    async def echo(requests, context):  # noqa: ANN001, ANN202
        async for r in requests:
            yield r

    async def unary(request, context):  # noqa: ANN001, ANN202
        return request

    async def main() -> None:
        server = H2GrpcServer(max_concurrent_rpcs=1000)
        kw = {"request_deserializer": _same, "response_serializer": _same}
        server.add_registered_method_handlers("b.S", {
            "Echo": grpc.stream_stream_rpc_method_handler(echo, **kw),
            "Unary": grpc.unary_unary_rpc_method_handler(unary, **kw)})
        port = await server.bind("127.0.0.1", 0)
        await server.start()
        port_q.put(port)
        await asyncio.Event().wait()

    uvloop.run(main())


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def _drive(port: int, pid: int) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        echo = ch.stream_stream("/b.S/Echo", request_serializer=_same, response_deserializer=_same)
        unary = ch.unary_unary("/b.S/Unary", request_serializer=_same, response_deserializer=_same)
        await unary(b"warm")
        payload = b"x" * 200

        async def stream() -> None:
            call = echo()
            for _ in range(MESSAGES):
                await call.write(payload)
                await call.read()
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF

        c0 = _cpu(pid)
        await asyncio.gather(*(stream() for _ in range(8)))
        per_msg = (_cpu(pid) - c0) / (8 * MESSAGES)

        async def requests() -> None:
            for _ in range(UNARY // 8):
                await unary(payload)

        c0 = _cpu(pid)
        await asyncio.gather(*(requests() for _ in range(8)))
        per_req = (_cpu(pid) - c0) / UNARY
    return per_msg, per_req


def run(impl: str) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_serve, args=(impl, q), daemon=True)
    p.start()
    try:
        port = q.get(timeout=30)
        return asyncio.run(_drive(port, p.pid))
    finally:
        p.kill()
        p.join()


def main() -> None:
    old = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    got: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for i in range(rounds):
        pair = (("old", old), ("new", "new"))
        for name, impl in pair if i % 2 == 0 else pair[::-1]:  # neither always first
            got[name].append(run(impl))
            msg_us, req_us = (x * 1e6 for x in got[name][-1])
            print(f"{name} µs/msg {msg_us:.1f}  µs/unary {req_us:.1f}", flush=True)
    print(json.dumps({name: {"us_per_echoed_message": round(statistics.median(r[0] for r in runs) * 1e6, 1),
                             "us_per_unary_request": round(statistics.median(r[1] for r in runs) * 1e6, 1)}
                      for name, runs in got.items()}))


if __name__ == "__main__":
    main()


def frames_only(old: str, rounds: int = 10, messages: int = 20_000) -> dict[str, float]:
    """The same comparison without sockets or the client (the machine's load barely moves it): frames fed to
    one connection of each implementation through a fake transport, 8 echo streams, process CPU per echoed
    message, rounds alternating."""
    import uvloop

    from tests.h2.wire import FakeTransport, frame, msg, request_block

    spec = importlib.util.spec_from_file_location("old_h2server", old)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    from h2grpc import H2GrpcServer, Limits
    from h2grpc.connection import Connection

    async def echo(requests, context):  # noqa: ANN001, ANN202
        async for r in requests:
            yield r

    def make(name: str) -> tuple[Any, FakeTransport]:
        kw = {"request_deserializer": _same, "response_serializer": _same}
        if name == "new":
            server = H2GrpcServer(max_concurrent_rpcs=100, limits=Limits(keepalive_time_s=0))
            conn = Connection(server)
        else:
            server = mod.H2GrpcServer(max_concurrent_rpcs=100, keepalive_time_s=0)
            conn = mod._Connection(server)
        server.add_registered_method_handlers("b.S", {"Echo": grpc.stream_stream_rpc_method_handler(echo, **kw)})
        t = FakeTransport()
        conn.connection_made(t)
        conn.data_received(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
        return conn, t

    async def one(name: str) -> float:
        conn, t = make(name)
        sids = list(range(1, 17, 2))
        conn.data_received(b"".join(frame(1, 4, s, request_block("/b.S/Echo")) for s in sids))
        reads = [frame(0, 0, s, msg(b"x" * 200)) for s in sids]
        c0 = time.process_time()
        for _ in range(messages // len(sids)):
            for r in reads:
                conn.data_received(r)
            for _ in range(3):
                await asyncio.sleep(0)
            t.out.clear()
        cpu = time.process_time() - c0
        conn.connection_lost(None)
        return cpu / messages

    got: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(rounds):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            got[name].append(uvloop.run(one(name)))
    return {name: round(statistics.median(v) * 1e6, 2) for name, v in got.items()}
