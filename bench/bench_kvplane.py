"""Ingest CPU of one picker, NATS plane against direct ZeroMQ sockets, and what the relay and the server cost
(issue 47). A short smoke by default; the issue's 256-worker figure is ``--workers 256``.

    python -m bench.bench_kvplane [--workers 32] [--rate 10] [--seconds 8] [--repeats 1] [--warmup 1]
        [--planes zmq,nats[,nats-q]] [--no-prime] [--pin] [--out FILE]

`bench.kvpub` publishes ``--rate`` batches a second per simulated worker (its own process); one `epp-kv-relay`
process reads them all and publishes them on a real nats-server. In this process, for each plane in turn,
a KvIndex is fed either by today's `SubscriberManager` (one SUB per worker) or by `PlaneSubscribers` (one NATS
subscription for the pool, after a dump per worker); the figure is this process's CPU (``process_time``: its
Python thread and libzmq's I/O thread) per 1,000 batches applied over the steady window, with the relay's,
nats-server's and kvpub's CPU over the same window beside it (from /proc). Lag is not measured here:
`bench_ingest_cpu` does that for the ZeroMQ path.

Fairness (the first 256-worker smoke's planes did not do the same work for the same batches): both
planes' indexes start from the relay's dump (``--no-prime``: the ZeroMQ index starts empty, as before). Without
it the direct index missed the shared prefix that kvpub stored at ``go``, so every batch's chain had an unknown
parent and was skipped, and every removal named an unknown block: the direct plane did less index work for the
same batches. And kvpub's ``go`` (the shared prefix) now waits until the relay's sockets had time to connect,
and is checked in the relay's dumps (``relay_missed_warm_prefix_workers``): sent at once, the relay missed it
at about half the workers, whose chains were then skipped on the plane too. Each window starts after a settle
and a ``gc.collect()``; the time the collector spent inside the window is recorded (``gc_ms``). Windows run in
ABBA order (zmq, nats, nats, zmq, ...; ABCCBA with ``nats-q``), after ``--warmup`` discarded windows per plane. ``--pin`` puts this
process on CPU 0 and kvpub, the relay and nats-server on the others.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
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
INDEX_COUNTERS = ("events_applied", "skipped_unknown_parent", "blocks_stored", "blocks_removed", "removed_unknown",
                  "evicted")


def batches(idx: KvIndex, addrs: list[str]) -> int:
    return sum(idx.stats(a).batches for a in addrs)


def index_counters(idx: KvIndex, addrs: list[str]) -> dict[str, int]:
    return {k: sum(getattr(idx.stats(a), k) for a in addrs) for k in INDEX_COUNTERS}


class GcClock:
    """Time the cyclic collector spends, by generation, while armed."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.ms = 0.0
        self.runs = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self.t0) * 1e3
            self.runs[info["generation"]] += 1


async def wait_live(mgr: PlaneSubscribers, addrs: list[str]) -> None:
    deadline = time.monotonic() + 60
    while not all(mgr.stats(a).mode == "live" and not mgr.stats(a).fallback for a in addrs):
        if time.monotonic() > deadline:
            raise RuntimeError("workers never went live on the plane")
        await asyncio.sleep(0.1)


async def prime(idx: KvIndex, addrs: list[str], server: NatsServer) -> int:
    """Load every worker's dump from the relay into ``idx`` (the plane's own start), then leave the plane: the
    index keeps its entries (`PlaneSubscribers.close`)."""
    plane = PlaneSubscribers(idx, SubscriberManager(idx), [server.url], Subjects(pool="bench"), dump_timeout_s=10)
    try:
        for a in addrs:
            await plane.add(a, [KvSource("tcp://127.0.0.1:1")])  # never opened: the plane serves them
        await wait_live(plane, addrs)
        return sum(plane.stats(a).dump_blocks for a in addrs)
    finally:
        await plane.close()


async def one_window(plane: str, addrs: list[str], endpoints: list[str], server: NatsServer, seconds: float,
                     settle: float, primed: bool, others: dict[str, int]) -> dict[str, Any]:
    idx = KvIndex(BS)
    direct = SubscriberManager(idx)
    mgr: SubscriberManager | PlaneSubscribers = direct
    primed_blocks = None
    if plane in ("nats", "nats-q"):
        mgr = PlaneSubscribers(idx, direct, [server.url], Subjects(pool="bench"), dump_timeout_s=10,
                               direct_dispatch=plane == "nats")
    elif primed:
        primed_blocks = await prime(idx, addrs, server)
    try:
        for a, ep in zip(addrs, endpoints, strict=True):
            await mgr.add(a, [KvSource(ep)])
        if isinstance(mgr, PlaneSubscribers):
            await wait_live(mgr, addrs)
            primed_blocks = sum(mgr.stats(a).dump_blocks for a in addrs)
        await asyncio.sleep(settle)
        gc.collect()
        clock = GcClock()
        gc.callbacks.append(clock)
        try:
            i0, m0 = index_counters(idx, addrs), H.machine_busy()
            b0, c0, t0 = batches(idx, addrs), time.process_time(), time.monotonic()
            o0 = {k: proc_cpu_seconds(pid) for k, pid in others.items()}
            await asyncio.sleep(seconds)
            b1, c1, t1 = batches(idx, addrs), time.process_time(), time.monotonic()
            o1 = {k: proc_cpu_seconds(pid) for k, pid in others.items()}
            i1, m1 = index_counters(idx, addrs), H.machine_busy()
        finally:
            gc.callbacks.remove(clock)
        n = max(1, b1 - b0)
        out: dict[str, Any] = {"plane": plane, "batches": b1 - b0, "batches_per_s": round((b1 - b0) / (t1 - t0), 1),
                               "picker_cpu_ms_per_1k_batches": round((c1 - c0) * 1e6 / n, 1),
                               "picker_cpu_share": round((c1 - c0) / (t1 - t0), 3),
                               "gc_ms": round(clock.ms, 1), "gc_runs": clock.runs,
                               "primed_blocks": primed_blocks, "blocks_at_end": sum(idx.blocks_indexed(a) for a in addrs),
                               "index": {k: i1[k] - i0[k] for k in INDEX_COUNTERS},
                               "machine_busy_cores": H.busy_cores(m0, m1),
                               "loadavg_1m_end": float(Path("/proc/loadavg").read_text().split()[0])}
        for k in others:
            out[f"{k}_cpu_share"] = round((o1[k] - o0[k]) / (t1 - t0), 3)
            out[f"{k}_cpu_ms_per_1k_batches"] = round((o1[k] - o0[k]) * 1e6 / n, 1)
        return out
    finally:
        if isinstance(mgr, PlaneSubscribers):
            await mgr.close()
        else:
            await direct.close()


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs), "runs": xs}


def order(planes: list[str], repeats: int) -> list[str]:
    """The planes in order, then reversed, and so on (ABBA for two, ABCCBA for three): each plane as often
    early as late in the run."""
    out: list[str] = []
    for r in range(repeats):
        out += planes if r % 2 == 0 else planes[::-1]
    return out


def summarize(rounds: list[dict[str, Any]], planes: list[str]) -> dict[str, Any]:
    """Per plane, median [min..max] of each figure; per pair of planes, the claim (disjoint spreads of the picker's
    CPU per 1,000 batches) and, beside it, the paired ratios: within each repeat (one pass over the planes, run
    back to back) the ratio of the two windows' figures, which cancels the load that changes between repeats
    (other processes on the machine) but is not the claim rule."""
    summary: dict[str, Any] = {}
    for plane in planes:
        rs = [x for x in rounds if x["plane"] == plane]
        summary[plane] = {k: spread([x[k] for x in rs])
                          for k in ("picker_cpu_ms_per_1k_batches", "picker_cpu_share", "gc_ms", "relay_cpu_share",
                                    "nats_server_cpu_share", "kvpub_cpu_share", "relay_cpu_ms_per_1k_batches",
                                    "nats_server_cpu_ms_per_1k_batches", "machine_busy_cores")}
    k = "picker_cpu_ms_per_1k_batches"
    blocks = [rounds[i:i + len(planes)] for i in range(0, len(rounds), len(planes))]
    for x, y in (("nats", "zmq"), ("nats-q", "zmq"), ("nats", "nats-q")):
        if x in summary and y in summary:
            fx, fy = summary[x][k], summary[y][k]
            ratios = [round(next(w[k] for w in b if w["plane"] == x) / next(w[k] for w in b if w["plane"] == y), 3)
                      for b in blocks]
            summary[f"{x}_vs_{y}"] = {
                "ratio_of_medians": round(fx["median"] / fy["median"], 3),
                "claim": (f"{x} < {y}" if fx["max"] < fy["min"] else f"{y} < {x}" if fy["max"] < fx["min"]
                          else "none (spreads overlap)"),
                "paired_ratios": {"median": round(statistics.median(ratios), 3), "min": min(ratios),
                                  "max": max(ratios), "runs": ratios}}
    return summary


async def run(a: argparse.Namespace) -> dict[str, Any]:
    ncpu = os.cpu_count() or 1
    if a.pin and ncpu > 1:
        os.sched_setaffinity(0, {0})
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
            assert relay.pid is not None and server.proc is not None and pub.proc is not None
            others = {"relay": relay.pid, "nats_server": server.proc.pid, "kvpub": pub.proc.pid}
            if a.pin and ncpu > 1:
                for pid in others.values():
                    for task in os.listdir(f"/proc/{pid}/task"):  # every thread (libzmq's, the Go runtime's)
                        os.sched_setaffinity(int(task), set(range(1, ncpu)))
            # the relay's SUB sockets connect after it is ready (ZeroMQ's slow joiner): a "go" sent at once lost
            # the shared prefix at some workers, so their chains had an unknown parent on every plane
            await asyncio.sleep(max(3.0, a.workers / 32))
            warm = H.kvpub_command(pub, "go")["warm"]
            await asyncio.sleep(1.0)
            check = KvIndex(BS)
            await prime(check, addrs, server)
            relay_short = sum(1 for ad, n in zip(addrs, warm, strict=True) if check.blocks_indexed(ad) < n)
            del check
            if relay_short:
                print(f"warning: the relay missed the warm prefix of {relay_short} workers", flush=True)
            warmups: list[dict[str, Any]] = []
            planes = a.planes.split(",")
            for _ in range(a.warmup):
                for plane in planes:
                    warmups.append(await one_window(plane, addrs, endpoints, server, a.seconds, a.settle,
                                                    not a.no_prime, others))
            rounds: list[dict[str, Any]] = []
            for plane in order(planes, a.repeats):
                rounds.append(await one_window(plane, addrs, endpoints, server, a.seconds, a.settle,
                                               not a.no_prime, others))
                print(json.dumps(rounds[-1]), flush=True)
            stats = H.kvpub_command(pub, "stats")
        finally:
            await server.stop()
    summary = summarize(rounds, planes)
    return {"workers": a.workers, "rate_per_worker": a.rate, "seconds": a.seconds, "settle": a.settle,
            "relay_missed_warm_prefix_workers": relay_short,
            "warmup": a.warmup, "primed": not a.no_prime, "pinned": bool(a.pin and ncpu > 1), "cpus": ncpu,
            "publisher": stats, "warmups": warmups, "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--rate", type=float, default=10)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between a plane's start and its window")
    ap.add_argument("--repeats", type=int, default=1, help="measured windows per plane, in ABBA order")
    ap.add_argument("--warmup", type=int, default=1, help="discarded windows per plane before the measured ones")
    ap.add_argument("--planes", default="zmq,nats", help="zmq (direct sockets), nats (the plane), nats-q (the plane "
                    "through nats-py's subscription queue and task, as before the direct dispatch)")
    ap.add_argument("--no-prime", action="store_true", help="the direct plane's index starts empty (the old bench)")
    ap.add_argument("--pin", action="store_true", help="this process on CPU 0, kvpub/relay/nats-server on the rest")
    ap.add_argument("--out", default=None)
    ap.add_argument("--summarize", metavar="RESULT", help="summarize a result file's rounds again (paired ratios "
                    "included) and print it; nothing is run")
    a = ap.parse_args(argv)
    if a.summarize:
        res = json.loads(Path(a.summarize).read_text())
        planes = list(dict.fromkeys(x["plane"] for x in res["rounds"]))
        emit(summarize(res["rounds"], planes), a.out)
        return 0
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
