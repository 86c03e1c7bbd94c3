"""Not a test (run by hand: `python tests/measure_worker_get.py [N]`). Client CPU per GET to a loopback
worker, aiohttp vs `adapters/http1.py` (through `WorkerHttp`), in one run, three interleaved rounds.

The worker is a separate process (aiohttp web) answering /health (2 bytes) and /metrics (~6 kB of Prometheus
text), so `time.process_time` in this process is the client's CPU alone. The prober pattern opens a fresh
connection per GET; the scraper pattern reuses a kept-alive one. Requests are sequential.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import sys
import time
from collections.abc import Awaitable, Callable

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
METRICS = ("# HELP trtllm_num_requests_waiting x\n# TYPE trtllm_num_requests_waiting gauge\n"
           + "".join(f'some_histogram_bucket{{le="{i}"}} {i}\n' for i in range(200))
           + "trtllm_num_requests_waiting 3\ntrtllm_num_requests_running 5\ntrtllm_kv_cache_utilization 0.4\n")


def serve(port: int) -> None:
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    app.router.add_get("/metrics", lambda r: web.Response(text=METRICS))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def with_aiohttp(addr: str, path: str, fresh: bool) -> float:
    import aiohttp

    conn = aiohttp.TCPConnector(force_close=fresh, limit=4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=2)) as s:
        t = time.process_time()
        for _ in range(N):
            async with s.get(f"http://{addr}{path}") as r:
                await r.read()
        return (time.process_time() - t) / N * 1e6


async def with_http1(addr: str, path: str, fresh: bool) -> float:
    from epp_extproc.adapters.worker_http import WorkerHttp

    c = WorkerHttp(timeout_s=2)
    t = time.process_time()
    for _ in range(N):
        await c.get(addr, path, fresh=fresh)
    cpu = (time.process_time() - t) / N * 1e6
    await c.close()
    return cpu


async def main(addr: str) -> None:
    res: dict[str, list[float]] = {}
    clients: tuple[tuple[str, Callable[[str, str, bool], Awaitable[float]]], ...] = (
        ("aiohttp", with_aiohttp), ("http1", with_http1))
    for _ in range(3):
        for name, fn in clients:
            for label, path, fresh in (("prober /health fresh conn", "/health", True),
                                       ("scraper /metrics kept-alive", "/metrics", False)):
                res.setdefault(f"{label} {name}", []).append(await fn(addr, path, fresh))
    for k, v in res.items():
        print(f"{k:45s} CPU us/GET: {' '.join(f'{x:.0f}' for x in v)}  (min {min(v):.0f})")


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = multiprocessing.Process(target=serve, args=(port,), daemon=True)
    p.start()
    time.sleep(1.5)
    try:
        asyncio.run(main(f"127.0.0.1:{port}"))
    finally:
        p.terminate()
