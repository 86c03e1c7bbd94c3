"""Replicas acting as one picker (issue 17): routing quality, throughput of --processes, sync lag.

    python -m bench.bench_replicas [--quick] [--out DIR]

1. Routing quality on bench_routing's shared-prefix workload (same schedule, same 4 mock workers, caches
   cleared before every run), Envoy in front, KV-aware pickers:
     (one)     1 replica (the reference)
     (nosync)  2 replicas, Envoy round-robins ext_proc streams across them, no replica sync (the behaviour
               before issue 17: each replica knows only its own bookings and predictions)
     (sync)    the same 2 replicas with --peers: bookings and predictions shared
   Target: (sync) cached-token ratio and TTFT p90 within 5% of (one).
2. Throughput: decisions/s of `epp-extproc` (render against the mock renderer + KV scoring against 8
   simulated workers publishing KV events) with --processes 1 vs 2, closed loop over 8 client connections
   (SO_REUSEPORT spreads connections, not streams). Target >= 1.6x. The load generator, the renderer and
   the KV publisher share the same 2 cores, so this is a lower bound on a dedicated host.
3. Sync lag: p99 of epp_replica_sync_lag_seconds (oldest change of a batch -> the peer's ack, sender's
   clock) over the (sync) runs and the 2-process throughput run. Target <= 5 ms on loopback.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import bench_routing as R
from bench import harness as H
from bench.bench_scale import bodies_for
from bench.kvpub import make_doc

CONFIGS = {"one": "1 replica", "nosync": "2 replicas, no sync", "sync": "2 replicas, replica sync"}
LAGS = {"visible": "epp_replica_sync_visible_lag_seconds",  # booked there -> applied here (the target)
        "acked": "epp_replica_sync_lag_seconds"}  # booked here -> peer's ack back here (upper bound)


# ----------------------------------------------------------------------------- 1. routing quality
def pickers_for(st: H.Stack, cfg: str, spec: str, renderer: H.Proc, extra: Sequence[str] = (), *,
                replicas: int = 2, nats_url: str | None = None, pool: str = "bench") -> list[H.Proc]:
    """The picker processes of one configuration; `extra`: more flags for each of them. `replicas` (2 unless
    said) for "nosync" and "sync"; "sync" is the gRPC full mesh (each replica's --peers lists all the others),
    or with `nats_url` replica sync over NATS subjects (`--replica-sync-plane nats`, pool `pool`: issue 47)."""
    if cfg == "one":
        return [H.picker(st, spec, "trtllm-render", renderer, extra=extra)]
    if cfg == "nosync":
        return [H.picker(st, spec, "trtllm-render", renderer, extra=extra) for _ in range(replicas)]
    if nats_url is not None:
        return [H.picker(st, spec, "trtllm-render", renderer,
                         extra=["--replica-sync-plane", "nats", "--nats-url", nats_url, "--kv-plane-pool", pool,
                                *extra])
                for _ in range(replicas)]
    ports = [H.free_port() for _ in range(replicas)]
    return [H.picker(st, spec, "trtllm-render", renderer,
                     extra=["--replica-sync-port", str(me),
                            "--peers", ",".join(f"127.0.0.1:{q}" for q in ports if q != me), *extra])
            for me in ports]


def lag_hist(metrics_ports: list[int]) -> dict[str, dict[float, float]]:
    total: dict[str, dict[float, float]] = {k: {} for k in LAGS}
    for port in metrics_ports:
        text = H.get_text(f"http://127.0.0.1:{port}/metrics")
        for key, name in LAGS.items():
            for k, v in H.histogram(text, name).items():
                total[key][k] = total[key].get(k, 0.0) + v
    return total


def lag_summary(h: dict[float, float]) -> dict[str, Any]:
    return H.hist_summary_ms(h)


def run_routing(w: R.Workload) -> tuple[list[dict[str, Any]], dict[str, dict[float, float]]]:
    rows: list[dict[str, Any]] = []
    lag: dict[str, dict[float, float]] = {}
    with H.Stack() as outer:
        workers = [H.mock_worker(outer, f"worker-{i}", w.mock_args()) for i in range(w.workers)]
        renderer = H.mock_renderer(outer)
        spec = H.endpoints_spec(workers)
        for cfg in CONFIGS:
            with H.Stack() as st:
                pks = pickers_for(st, cfg, spec, renderer)
                for pk in pks:
                    H.wait_subscribed(pk, [m.address for m in workers])
                env = H.envoy(st, picker_proc=pks[0], more_pickers=pks[1:])
                url = env.url + "/v1/chat/completions"
                for rate in w.rates:
                    R.wait_idle(workers)
                    R.clear_all(workers)
                    time.sleep(0.3)  # let the AllBlocksCleared events reach the pickers
                    before = [_picks(p.extra["metrics_port"]) for p in pks]
                    res, el, _ = asyncio.run(R.run_rate(url, w, rate, seed=int(rate * 100)))
                    R.wait_idle(workers)
                    row = {"config": cfg, "rate": rate, **R.measure(res, el)}
                    row["picks_per_replica"] = [_picks(p.extra["metrics_port"]) - b
                                                for p, b in zip(pks, before, strict=True)]
                    rows.append(row)
                    print(f"  ({cfg}) {rate:>5} req/s: TTFT p90 {H.fmt(row.get('ttft_p90_ms'))} ms, cached "
                          f"{row['cached_ratio']:.3f}, errors {row['errors']}, per worker {row['per_worker']}, "
                          f"per replica {row['picks_per_replica']}", flush=True)
                if cfg == "sync":
                    lag = lag_hist([p.extra["metrics_port"] for p in pks])
    return rows, lag


def _picks(metrics_port: int) -> int:
    text = H.get_text(f"http://127.0.0.1:{metrics_port}/metrics")
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("epp_picks_total")))


# ----------------------------------------------------------------------------- 2. throughput
class Client(H.ExtProcClient):
    """ExtProcClient on its own TCP connection (gRPC shares subchannels between identical channels)."""

    def __init__(self, port: int) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=[("grpc.use_local_subchannel_pool", 1)])
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)


async def closed_loop(port: int, bodies: list[bytes], connections: int, per_conn: int,
                      seconds: float) -> tuple[int, float, int]:
    clients = [Client(port) for _ in range(connections)]
    done = rejected = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def loop(c: Client, k: int) -> None:
        nonlocal done, rejected
        i = k
        while time.perf_counter() < deadline:
            dest, _ = await c.decide(bodies[i % len(bodies)])
            i += 1
            if dest:
                done += 1
            else:
                rejected += 1

    try:
        await asyncio.gather(*(loop(c, k) for k, c in enumerate(clients) for _ in range(per_conn)))
    finally:
        for c in clients:
            await c.close()
    return done, time.perf_counter() - t0, rejected


def run_throughput(seconds: float, quick: bool) -> tuple[list[dict[str, Any]], dict[str, dict[float, float]]]:
    rows = []
    lag: dict[str, dict[float, float]] = {}
    doc = make_doc(256, 1)
    bodies = bodies_for(doc, 2048 if not quick else 512, 32, random.Random(7))
    for n in (1, 2):
        with H.Stack() as st:
            pub = H.kv_publisher(st, 8, rate=10, doc_blocks=256, cap=2048)
            spec, addrs = H.fake_worker_spec(pub)
            rend = H.mock_renderer(st)
            pk = picker_group(st, spec, rend, n)
            for i in range(n):
                H.wait_subscribed(H.Proc(f"p{i}", [], None, st.dir / "unused",
                                         extra={"metrics_port": pk.extra["metrics_port"] + i}), addrs, timeout=60)
            H.kvpub_command(pub, "go")
            time.sleep(1.0)
            asyncio.run(closed_loop(pk.port, bodies, 2, 2, 1.0))  # warm-up: connections, caches
            procs = {"picker": pk, "renderer": rend, "kvpub": pub}
            cpu0 = {k: tree_cpu_seconds(p.proc.pid) for k, p in procs.items() if p.proc}
            t_cpu0 = time.process_time()
            ok, el, rejected = asyncio.run(closed_loop(pk.port, bodies, 8, 4, seconds))
            cpu = {k: round(tree_cpu_seconds(p.proc.pid) - cpu0[k], 2) for k, p in procs.items() if p.proc}
            row = {"processes": n, "decisions": ok, "rejected": rejected, "elapsed_s": round(el, 2),
                   "decisions_per_s": ok / el if el > 0 else 0.0,
                   "cpu_s": {**cpu, "client": round(time.process_time() - t_cpu0, 2)},
                   "load_avg_1m": os.getloadavg()[0]}
            if n > 1:  # process i serves its metrics on metrics-port + i
                ports = [pk.extra["metrics_port"] + i for i in range(n)]
                lag = lag_hist(ports)
                row["picks_per_process"] = [_picks(p) for p in ports]
            rows.append(row)
            print(f"  --processes {n}: {row['decisions_per_s']:.0f} decisions/s ({ok} in {el:.1f}s, "
                  f"{rejected} rejected) {row.get('picks_per_process', '')}", flush=True)
    return rows, lag


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU of a process and all its descendants (the --processes children), from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += H.proc_cpu_seconds(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def side_ports(n: int) -> int:
    """A metrics port m with m .. m + n - 1 all free (process i serves its metrics on metrics-port + i)."""
    while True:
        m = H.free_port()
        try:
            for i in range(1, n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", m + i))
        except OSError:
            continue
        return m


def picker_group(st: H.Stack, spec: str, renderer: H.Proc, n: int) -> H.Proc:
    """`epp-extproc --processes n` over simulated workers (so `SIMULATED_WORKER_FLAGS`: no prober)."""
    grpc_port, health = H.free_port(), H.free_port()
    metrics = side_ports(n)
    argv = [H.PICKER, "--bind", "127.0.0.1", "--grpc-port", str(grpc_port), "--health-port", str(health),
            "--metrics-port", str(metrics), "--endpoints", spec, "--log-level", "WARNING",
            "--tokenizer-protocol", "trtllm-render", "--tokenizer-service-url", renderer.url,
            "--max-inflight-requests", "100000", *H.SIMULATED_WORKER_FLAGS, "--processes", str(n),
            "--secure-serving=false"]  # the client below speaks h2c
    p = st.add(H.Proc("picker", argv, grpc_port, st.dir / "picker.log", extra={"metrics_port": metrics}))
    for i in range(n):
        H.wait_port(metrics + i, 30, p.proc)
    return p


# ----------------------------------------------------------------------------- report
def targets(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["result"]["routing"]
    out: dict[str, Any] = {"routing": []}
    for rate in sorted({r["rate"] for r in rows}):
        by = {r["config"]: r for r in rows if r["rate"] == rate}
        one = by.get("one")
        if one is None:
            continue
        entry: dict[str, Any] = {"rate": rate}
        for cfg in ("nosync", "sync"):
            r = by.get(cfg)
            if r is None:
                continue
            entry[cfg] = {"cached_over_one": H.ratio(r["cached_ratio"], one["cached_ratio"]),
                          "ttft_p90_over_one": H.ratio(r.get("ttft_p90_ms"), one.get("ttft_p90_ms"))}
        s = entry.get("sync", {})
        entry["sync_within_5pct"] = bool(s) and (s["cached_over_one"] or 0) >= 0.95 and \
            (s["ttft_p90_over_one"] or 99) <= 1.05
        out["routing"].append(entry)
    tp = {r["processes"]: r for r in doc["result"]["throughput"]}
    speed = H.ratio(tp.get(2, {}).get("decisions_per_s"), tp.get(1, {}).get("decisions_per_s"))
    out["throughput_2_over_1"] = {"ratio": speed, "target": 1.6, "met": speed is not None and speed >= 1.6}
    for where in ("routing", "throughput"):
        lag = doc["result"]["lag"].get(where, {})
        vis, ack = lag.get("visible", {}), lag.get("acked", {})
        out[f"sync_lag_ms_{where}"] = {"visible": vis, "acked": ack, "target_p99": 5.0,
                                       "met": vis.get("p99_ms") is not None and vis["p99_ms"] <= 5.0}
    return out


def print_report(doc: dict[str, Any]) -> None:
    rows = doc["result"]["routing"]
    base = {r["rate"]: r for r in rows if r["config"] == "one"} or {r["rate"]: r for r in rows}
    print("\nRouting quality, 2 replicas behind Envoy vs 1 (ratios to (one) at the same rate)")
    print(H.table([[r["config"], r["rate"], r["requests"], r["errors"], r.get("ttft_p90_ms"),
                    H.ratio(r.get("ttft_p90_ms"), base[r["rate"]].get("ttft_p90_ms")), r["cached_ratio"],
                    H.ratio(r["cached_ratio"], base[r["rate"]]["cached_ratio"]), r["output_tokens_per_s"]]
                   for r in rows],
                  ["cfg", "rate", "reqs", "err", "TTFT p90", "x/one p90", "cached", "x/one cached", "out tok/s"]))
    print("\nThroughput (render + KV scoring), decisions/s")
    tp = doc["result"]["throughput"]
    print(H.table([[r["processes"], r["decisions_per_s"], r["decisions"], r["rejected"], r["cpu_s"]["picker"],
                    r["cpu_s"]["renderer"], r["cpu_s"]["client"], r["elapsed_s"], r["load_avg_1m"]] for r in tp],
                  ["processes", "decisions/s", "decisions", "rejected", "picker cpu s", "renderer cpu s",
                   "client cpu s", "wall s", "load avg"]))
    H.print_targets(doc)


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["result"]["routing"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    H.plot_by_config(axes[:2], rows, CONFIGS, "rate", (lambda r: r.get("ttft_p90_ms"), lambda r: r["cached_ratio"]))
    axes[0].set_yscale("log")
    H.label_axes(axes[:2], ("TTFT p90 (ms, log)", "cached-token ratio"), "offered load (req/s, Poisson)")
    axes[0].legend(fontsize=8)
    tp = doc["result"]["throughput"]
    axes[2].bar([str(r["processes"]) for r in tp], [r["decisions_per_s"] for r in tp])
    axes[2].set_xlabel("--processes")
    axes[2].set_title("decisions/s (render + KV scoring)")
    H.save_figure(fig, "Replicas: 2 behind Envoy with/without sync vs 1; --processes 1 vs 2", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "replicas")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s)")
    ap.add_argument("--parts", default="routing,throughput", help="which parts to run (default both)")
    a = ap.parse_args(argv)
    w = R.QUICK if a.quick else R.Workload(rates=(16, 32))
    if a.rates:
        w.rates = tuple(float(x) for x in a.rates.split(","))
    parts = a.parts.split(",")
    routing, lag, tp, lag2 = [], {}, [], {}  # type: ignore[var-annotated]
    if "routing" in parts:
        print("replicas: routing quality, 1 vs 2 replicas", flush=True)
        routing, lag = run_routing(w)
    if "throughput" in parts:
        print("replicas: throughput, --processes 1 vs 2", flush=True)
        tp, lag2 = run_throughput(2.0 if a.quick else 10.0, a.quick)
    lags = {"routing": {k: lag_summary(h) for k, h in lag.items()},  # at the routing benchmark's rates
            "throughput": {k: lag_summary(h) for k, h in lag2.items()}}  # with 2 processes saturated
    doc = {"bench": "replicas", **H.meta(a.quick), "configs": CONFIGS, "workload": w.__dict__,
           "result": {"routing": routing, "throughput": tp, "lag": lags}}
    doc["targets"] = targets(doc)
    return H.publish(doc, a.out, "replicas", print_report, chart)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
