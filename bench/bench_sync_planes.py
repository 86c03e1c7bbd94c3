"""Replica sync, the gRPC mesh against NATS subjects (issue 47): how long a booking takes to be seen by the
other replicas. A smoke: all replicas in this one process (so no CPU per replica here: `bench_sync_cpu`
measures that, and visibility, with replica processes on both planes), loopback, a real nats-server.

    python -m bench.bench_sync_planes [--replicas 3] [--bookings 200] [--out FILE]

Each booking is made on replica 0 and timed until every other replica's load view shows it (polled every
0.2 ms); then freed, and the free awaited the same way before the next booking.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.bench_kvplane import emit
from epp_extproc.app import PickerApp
from epp_extproc.config import Config, ProcessSlot
from epp_extproc.dev.nats import NatsServer
from epp_extproc.dev.procs import free_port

WORKER = "127.0.0.1:1"


def apps(plane: str, n: int, server: NatsServer) -> list[PickerApp]:
    common: dict[str, Any] = {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "admin_port": 0,
                              "bind": "127.0.0.1", "endpoints": f"w={WORKER}", "endpoint_probe_interval_ms": 0,
                              "secure_serving": False, "worker_metrics_interval_ms": 0}
    if plane == "nats":
        return [PickerApp(Config(replica_sync_plane="nats", nats_url=server.url, kv_plane_pool="bench", **common))
                for _ in range(n)]
    ports = [free_port() for _ in range(n)]
    return [PickerApp(Config(replica_sync_port=p, peers=",".join(f"127.0.0.1:{q}" for q in ports if q != p),
                             **common), ProcessSlot()) for p in ports]


async def until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.perf_counter() + timeout
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.0002)


async def measure(plane: str, n: int, bookings: int, server: NatsServer) -> dict[str, Any]:
    group = apps(plane, n, server)
    for a in group:
        await a.start()
    try:
        await until(lambda: all(a.ready() for a in group), 30)
        await asyncio.sleep(0.5)
        first, others = group[0], group[1:]
        lags = []
        for i in range(bookings):
            t0 = time.perf_counter()
            bk = first.load.book(WORKER, i + 1)
            await until(lambda i=i: all(o.load.load(WORKER).prefill_blocks == i + 1 for o in others))
            lags.append(time.perf_counter() - t0)
            bk.free()
            await until(lambda: all(o.load.load(WORKER).inflight == 0 for o in others))
        lags.sort()
        return {"plane": plane, "replicas": n, "bookings": bookings,
                "visible_ms_p50": round(statistics.median(lags) * 1000, 2),
                "visible_ms_p90": round(lags[int(len(lags) * 0.9)] * 1000, 2),
                "visible_ms_max": round(lags[-1] * 1000, 2)}
    finally:
        for a in group:
            await a.stop(0)


async def run(a: argparse.Namespace) -> list[dict[str, Any]]:
    server = NatsServer()
    await server.start()
    try:
        return [await measure(plane, a.replicas, a.bookings, server) for plane in ("grpc", "nats")]
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--bookings", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    emit(asyncio.run(run(a)), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
