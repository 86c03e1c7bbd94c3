"""Ingest CPU of one picker, NATS plane against direct ZeroMQ sockets, and what the relay and the server cost
(issue 47). A short smoke by default; the issue's 256-worker figure is ``--workers 256``.

    python -m bench.bench_kvplane [--workers 32] [--rate 10] [--seconds 8] [--repeats 1] [--out FILE]

`bench.kvpub` publishes ``--rate`` batches a second per simulated worker (its own process); one `epp-kv-relay`
process reads them all and publishes them on a real nats-server. In this process, for each plane in turn,
a KvIndex is fed either by today's `SubscriberManager` (one SUB per worker) or by `PlaneSubscribers` (one NATS
subscription for the pool, after a dump per worker); the figure is this process's CPU (``process_time``) per
1,000 batches applied over the steady window, with the relay's and nats-server's CPU over the plane's window
beside it (from /proc). Lag is not measured here: `bench_ingest_cpu` does that for the ZeroMQ path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from epp_extproc.dev.nats import NatsServer, relay_proc
from epp_extproc.dev.procs import proc_cpu_seconds
from epp_extproc.kvplane.follower import PlaneSubscribers
from epp_extproc.kvplane.wire import Subjects
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager

BS = 32


def batches(idx: KvIndex, addrs: list[str]) -> int:
    return sum(idx.stats(a).batches for a in addrs)


async def one_window(plane: str, addrs: list[str], endpoints: list[str], server: NatsServer, seconds: float,
                     others: dict[str, int]) -> dict[str, Any]:
    idx = KvIndex(BS)
    direct = SubscriberManager(idx)
    mgr: SubscriberManager | PlaneSubscribers = direct
    if plane == "nats":
        mgr = PlaneSubscribers(idx, direct, [server.url], Subjects(pool="bench"), dump_timeout_s=10)
    try:
        for a, ep in zip(addrs, endpoints, strict=True):
            await mgr.add(a, [KvSource(ep)])
        if isinstance(mgr, PlaneSubscribers):
            plane_mgr = mgr
            deadline = time.monotonic() + 60
            while not all(plane_mgr.stats(a).mode == "live" and not plane_mgr.stats(a).fallback for a in addrs):
                if time.monotonic() > deadline:
                    raise RuntimeError("workers never went live on the plane")
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # settle
        b0, c0, t0 = batches(idx, addrs), time.process_time(), time.monotonic()
        o0 = {k: proc_cpu_seconds(pid) for k, pid in others.items()}
        await asyncio.sleep(seconds)
        b1, c1, t1 = batches(idx, addrs), time.process_time(), time.monotonic()
        o1 = {k: proc_cpu_seconds(pid) for k, pid in others.items()}
        n = max(1, b1 - b0)
        out: dict[str, Any] = {"plane": plane, "batches": b1 - b0, "batches_per_s": round((b1 - b0) / (t1 - t0), 1),
                               "picker_cpu_ms_per_1k_batches": round((c1 - c0) * 1e6 / n, 1),
                               "picker_cpu_share": round((c1 - c0) / (t1 - t0), 3)}
        for k in others:
            out[f"{k}_cpu_share"] = round((o1[k] - o0[k]) / (t1 - t0), 3)
        return out
    finally:
        if isinstance(mgr, PlaneSubscribers):
            await mgr.close()
        else:
            await direct.close()


async def run(a: argparse.Namespace) -> dict[str, Any]:
    with H.Stack("epp-bench-kvplane-") as st:
        server = NatsServer()
        await server.start()
        try:
            pub = H.kv_publisher(st, a.workers, rate=a.rate, doc_blocks=256, cap=2048)
            endpoints = pub.extra["endpoints"]
            addrs = [f"127.0.0.1:{20000 + i}" for i in range(a.workers)]
            eps = st.dir / "endpoints.json"
            eps.write_text(json.dumps({"endpoints": [{"address": ad, "kv_events": ep}
                                                     for ad, ep in zip(addrs, endpoints, strict=True)]}))
            relay = st.add(relay_proc(st.dir, nats_url=server.url, endpoints_file=eps, pool="bench", block_size=BS))
            H.kvpub_command(pub, "go")
            assert relay.pid is not None and server.proc is not None
            others = {"relay": relay.pid, "nats_server": server.proc.pid}
            rounds: list[dict[str, Any]] = []
            for r in range(a.repeats):
                for plane in (("zmq", "nats") if r % 2 == 0 else ("nats", "zmq")):
                    rounds.append(await one_window(plane, addrs, endpoints, server, a.seconds, others))
            stats = H.kvpub_command(pub, "stats")
        finally:
            await server.stop()
    summary: dict[str, Any] = {}
    for plane in ("zmq", "nats"):
        figs = [x["picker_cpu_ms_per_1k_batches"] for x in rounds if x["plane"] == plane]
        summary[plane] = {"picker_cpu_ms_per_1k_batches_median": statistics.median(figs), "runs": figs}
    nats_rounds = [x for x in rounds if x["plane"] == "nats"]
    summary["relay_cpu_share_median"] = statistics.median(x["relay_cpu_share"] for x in nats_rounds)
    summary["nats_server_cpu_share_median"] = statistics.median(x["nats_server_cpu_share"] for x in nats_rounds)
    return {"workers": a.workers, "rate_per_worker": a.rate, "seconds": a.seconds, "publisher": stats,
            "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--rate", type=float, default=10)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    emit(asyncio.run(run(a)), a.out)
    return 0


def emit(result: Any, out: str | None) -> None:
    """Print the result as JSON, and write it to ``out`` when given (bench_sync_planes too)."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
