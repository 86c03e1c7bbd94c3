"""Ten thousand simulated workers against eight, in one run (issue 45's last Proof bullet).

    python -m bench.bench_tenk [--workers 8,10000] [--modes inprocess,apart] [--rate 0.2] [--seconds 20]
        [--doc-blocks 128] [--shards 4] [--max-endpoints N] [--out bench/results/tenk.json]

How the workers are simulated: `bench.kvpub` processes of at most 2,500 workers each, every worker one real
ZeroMQ PUB socket bound on `ipc://` (TensorRT-LLM's wire form; ipc so that ten thousand workers use no TCP
ports; a PUB holds three descriptors, so 2,500 per process stays inside this machine's `ulimit -n` of
20,000). Until the picker has subscribed, each worker sends an empty batch every max(0.2, workers per
process / 1,000) s; then each stores between half and all of one shared `--doc-blocks` document (the index
holds blocks for every worker) and publishes `--rate` batches per second (a chain of 1..7 fresh blocks off the
document, LRU removals past 64 fresh blocks). Their HTTP side is not simulated: the picker is started with the
prober and the metric scraper off (`--endpoint-probe-interval-ms 0 --worker-metrics-interval-ms 0`) and is only
asked for decisions through its ext_proc port (`bench.picker_host`: the product plus timing probes;
trtllm-render against the mock renderer, one client, requests one after another, no forwarding), as
`bench_scale` does. The picker reads its endpoints from a JSON file (`--endpoints-file`), as a large pool
would be given them: ten thousand entries do not fit one argument (Linux caps one at 128 KiB).

Per (mode, workers): start (launch -> ext_proc port and /metrics answer) and subscribed (-> every worker's
subscription has received a batch) times, or the refusal and its message from the picker's log; RSS of the
picker (and, `apart`, of its ingest shards) subscribed-and-empty, warm (every worker's prefix indexed) and at
the end; the background CPU (subscriptions and the steady events, no decisions) measured over `--idle-s`,
then `--seconds` of decisions: decision p50/p99 (`Director.propose`, the render hop included), lookup p50/p99,
the ext_proc round trip, and CPU per decision (the picker's CPU over the window less the background rate,
over the decisions; `apart`: the shards' too). Memory per worker = (RSS at N - RSS at the fewest) / (N - fewest),
same mode, warm.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.bench_scale import bodies_for, score_loop
from bench.kvpub import make_doc
from epp_extproc.dev import procs

PER_PUBLISHER = 2500  # PUB sockets per kvpub process: 3 descriptors each, under a 20,000 `ulimit -n`


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_s(pids: list[int]) -> float:
    return sum(procs.proc_cpu_seconds(p) for p in pids)


def kv_workers(pk: procs.Proc) -> dict[str, Any]:
    return H.get_json(H.picker_url(pk) + "/debug/kv", timeout=120)["workers"]


def log_errors(pk: procs.Proc, limit: int = 5) -> list[str]:
    lines = [x for x in pk.log_text().splitlines() if "ERROR" in x or "error" in x.lower()]
    return [x[:600] for x in lines[:limit]]


def run_one(mode: str, n: int, a: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "workers": n, "rate_per_worker": a.rate, "doc_blocks": a.doc_blocks}
    doc = make_doc(a.doc_blocks, 1)
    with H.Stack(prefix="epp-tenk-") as st:
        pubs, endpoints = [], []
        t0 = time.monotonic()
        for k in range(math.ceil(n / PER_PUBLISHER)):
            m = min(PER_PUBLISHER, n - k * PER_PUBLISHER)
            d = st.dir / f"p{k}"
            d.mkdir()
            p = H.kv_publisher(st, m, rate=a.rate, doc_blocks=a.doc_blocks, cap=64, new_blocks=4,
                               heartbeat_s=max(0.2, m / 1000), ipc_dir=str(d), name=f"kvpub{k}")
            pubs.append(p)
            endpoints += p.extra["endpoints"]
        row["publishers"] = len(pubs)
        row["publishers_bound_s"] = round(time.monotonic() - t0, 2)
        addrs = [f"127.0.{i // 40000}.{1 + (i // 40000)}:{20000 + i % 40000}" for i in range(n)]
        eps = [{"name": f"sim-{i}", "address": addrs[i], "kv_events": e} for i, e in enumerate(endpoints)]
        eps_file = st.dir / "endpoints.json"
        eps_file.write_text(json.dumps({"endpoints": eps}, separators=(",", ":")))
        row["endpoints_file_bytes"] = eps_file.stat().st_size
        rend = H.mock_renderer(st)
        extra = [*H.SIMULATED_WORKER_FLAGS, "--worker-metrics-interval-ms", "0"]
        if mode == "apart":
            extra += ["--kv-ingest", "apart", "--kv-ingest-shards", str(a.shards)]
        if a.max_endpoints:
            extra += ["--max-endpoints", str(a.max_endpoints)]
        pk = procs.picker(st.dir, endpoints_file=eps_file, protocol="trtllm-render", renderer_url=rend.url,
                          argv0=[sys.executable, "-m", "bench.picker_host"],
                          args=["--log-level", "WARNING", "--max-inflight-requests", str(H.PICKER_MAX_INFLIGHT),
                                *extra])
        t_launch = time.monotonic()
        st.add(pk, timeout=300)
        row["start_s"] = round(time.monotonic() - t_launch, 2)
        pid = pk.pid
        assert pid is not None

        def pids() -> list[int]:
            return [pid, *children(pid)] if mode == "apart" else [pid]

        # subscribed: every worker's subscription has received a batch (a heartbeat)
        deadline = time.monotonic() + a.subscribe_timeout
        snap: dict[str, Any] = {}
        while time.monotonic() < deadline:
            snap = kv_workers(pk)
            got = sum(1 for x in addrs if snap.get(x, {}).get("batches", 0) > 0)
            refused = sum(1 for x in addrs if snap.get(x, {}).get("unsubscribed"))
            if got == n or (refused and got + refused == n):  # the refused wait for a socket that never frees
                break
            time.sleep(0.2 if n <= 1000 else 1.0)
        got = sum(1 for x in addrs if snap.get(x, {}).get("batches", 0) > 0)
        row["subscribed"] = got
        row["subscribed_s"] = round(time.monotonic() - t_launch, 2)
        refusals = [w.get("subscribe_error") for w in snap.values() if w.get("subscribe_error")]
        row["unsubscribed"] = sum(1 for w in snap.values() if w.get("unsubscribed"))
        row["indexed_workers"] = len(snap)
        if refusals:
            row["subscribe_error_example"] = refusals[0]
        row["log_errors"] = log_errors(pk)
        print(f"  {mode} {n}: start {row['start_s']} s, subscribed {got}/{n} at {row['subscribed_s']} s "
              f"(index knows {len(snap)} workers, {row['unsubscribed']} refused)", flush=True)
        for e in row["log_errors"]:
            print("   log:", e, flush=True)
        if got == 0:
            row["error"] = "no worker subscribed"
            return row
        time.sleep(1.0)
        row["rss_subscribed_mb"] = round(rss_mb(pid), 1)
        row["rss_subscribed_shards_mb"] = round(sum(rss_mb(p) for p in pids()[1:]), 1)
        # warm: every worker stores its share of the document
        warm: list[int] = []
        for p in pubs:
            warm += H.kvpub_command(p, "go")["warm"]
        t_w = time.monotonic()
        want = sum(w for x, w in zip(addrs, warm, strict=True) if snap.get(x, {}).get("batches", 0) > 0)
        blocks = 0
        while time.monotonic() - t_w < a.warm_timeout:
            time.sleep(1.0)
            snap = kv_workers(pk)
            blocks = sum(min(w.get("blocks_indexed", 0), k) for x, k in zip(addrs, warm, strict=True)
                         if (w := snap.get(x)))
            if blocks >= want:
                break
        row["warm_s"] = round(time.monotonic() - t_w, 2)
        row["warm_blocks_wanted"] = want
        row["warm_blocks_indexed"] = blocks
        time.sleep(2.0)
        # the background: subscriptions, watchdog and the steady events, no decisions
        c0, t1 = cpu_s(pids()), time.monotonic()
        time.sleep(a.idle_s)
        idle_rate = (cpu_s(pids()) - c0) / (time.monotonic() - t1)
        row["background_cpu_util"] = round(idle_rate, 4)
        row["rss_warm_mb"] = round(rss_mb(pid), 1)
        row["rss_warm_shards_mb"] = round(sum(rss_mb(p) for p in pids()[1:]), 1)
        # decisions, one after another
        bodies = bodies_for(doc, a.doc_blocks * 32, 8, random.Random(n))
        m0 = H.get_text(H.picker_url(pk) + "/metrics")
        c0p, c0all, t2 = procs.proc_cpu_seconds(pid), cpu_s(pids()), time.monotonic()
        rtt, el, rejected = asyncio.run(score_loop(pk.port, bodies, 1, 1_000_000, a.seconds))
        el_cpu = time.monotonic() - t2
        cp, call = procs.proc_cpu_seconds(pid) - c0p, cpu_s(pids()) - c0all
        m1 = H.get_text(H.picker_url(pk) + "/metrics")
        d = {name: H.hist_summary_ms(H.hist_delta(H.histogram(m1, name), H.histogram(m0, name)))
             for name in ("bench_decision_seconds", "bench_lookup_seconds", "epp_render_seconds")}
        nd = max(len(rtt), 1)
        row.update({
            "decisions": len(rtt), "rejected": rejected, "decisions_per_s": round(len(rtt) / el, 1),
            "decision": d["bench_decision_seconds"], "lookup": d["bench_lookup_seconds"],
            "render": d["epp_render_seconds"], "extproc_round_trip": H.pcts_ms(rtt),
            "picker_cpu_s": round(cp, 3), "all_cpu_s": round(call, 3), "window_s": round(el_cpu, 2),
            "cpu_ms_per_decision_raw": round(call / nd * 1000, 3),
            "cpu_ms_per_decision": round((call - idle_rate * el_cpu) / nd * 1000, 3),
            "picker_cpu_ms_per_decision_raw": round(cp / nd * 1000, 3),
            "rss_end_mb": round(rss_mb(pid), 1),
            "rss_end_shards_mb": round(sum(rss_mb(p) for p in pids()[1:]), 1),
            "publisher": [H.kvpub_command(p, "stats") for p in pubs],
        })
        snap = kv_workers(pk)
        row["blocks_indexed_end"] = sum(w.get("blocks_indexed", 0) for w in snap.values())
        row["batches_end"] = sum(w.get("batches", 0) for w in snap.values())
        row["log_errors"] = log_errors(pk)
        print(f"  {mode} {n}: {row['decisions']} decisions, p50/p99 {H.fmt(row['decision']['p50_ms'])}/"
              f"{H.fmt(row['decision']['p99_ms'])} ms, lookup p99 {H.fmt(row['lookup']['p99_ms'], '.3f')} ms, "
              f"CPU/decision {row['cpu_ms_per_decision']} ms (raw {row['cpu_ms_per_decision_raw']}, background "
              f"{idle_rate * 100:.1f}% of a core), RSS warm {row['rss_warm_mb']} MB (+shards "
              f"{row['rss_warm_shards_mb']})", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = sorted((r for r in rows if r["mode"] == mode and "cpu_ms_per_decision" in r), key=lambda r: r["workers"])
        if len(rs) < 2:
            continue
        lo, hi = rs[0], rs[-1]
        span = hi["workers"] - lo["workers"]
        rss = lambda r: r["rss_warm_mb"] + r["rss_warm_shards_mb"]  # noqa: E731
        ratio = H.ratio(hi["cpu_ms_per_decision"], lo["cpu_ms_per_decision"])
        out[mode] = {
            "fewest": lo["workers"], "most": hi["workers"],
            "cpu_per_decision_ratio": ratio, "target_cpu_ratio": 3.0,
            "target_met": ratio is not None and ratio <= 3.0 and hi.get("subscribed") == hi["workers"],
            "decision_p50_ratio": H.ratio(hi["decision"]["p50_ms"], lo["decision"]["p50_ms"]),
            "decision_p99_ratio": H.ratio(hi["decision"]["p99_ms"], lo["decision"]["p99_ms"]),
            "kb_per_worker_warm": round((rss(hi) - rss(lo)) * 1024 / span, 1),
            "kb_per_worker_subscribed": round(((hi["rss_subscribed_mb"] + hi["rss_subscribed_shards_mb"])
                                               - (lo["rss_subscribed_mb"] + lo["rss_subscribed_shards_mb"]))
                                              * 1024 / span, 1),
        }
    return out


def print_report(doc: dict[str, Any]) -> None:
    rows = [r for r in doc["rows"] if "decision" in r]
    print(H.table([[r["mode"], r["workers"], r["start_s"], r["subscribed_s"], r["decision"]["p50_ms"],
                    r["decision"]["p99_ms"], r["lookup"]["p99_ms"], r["cpu_ms_per_decision"],
                    r["cpu_ms_per_decision_raw"], r["background_cpu_util"], r["rss_warm_mb"],
                    r["rss_warm_shards_mb"]] for r in rows],
                  ["mode", "workers", "start s", "subscribed s", "dec p50", "dec p99", "lookup p99", "CPU/dec ms",
                   "raw", "background", "RSS MB", "shards MB"]))
    print(json.dumps(doc["summary"], indent=1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "tenk")
    ap.add_argument("--workers", default="8,10000")
    ap.add_argument("--modes", default="inprocess,apart")
    ap.add_argument("--rate", type=float, default=0.2, help="KV-event batches per second per worker")
    ap.add_argument("--seconds", type=float, default=20.0, help="decisions window")
    ap.add_argument("--idle-s", type=float, default=8.0, help="background CPU window (no decisions)")
    ap.add_argument("--doc-blocks", type=int, default=128, help="shared document, in 32-token blocks")
    ap.add_argument("--shards", type=int, default=4, help="--kv-ingest-shards for apart")
    ap.add_argument("--max-endpoints", type=int, default=0, help="the picker's --max-endpoints (0: its default)")
    ap.add_argument("--subscribe-timeout", type=float, default=240.0)
    ap.add_argument("--warm-timeout", type=float, default=240.0)
    a = ap.parse_args(argv)
    rows = []
    for mode in a.modes.split(","):
        for n in (int(x) for x in a.workers.split(",")):
            try:
                rows.append(run_one(mode, n, a))
            except Exception as e:  # a size that cannot run says so in the results
                rows.append({"mode": mode, "workers": n, "error": f"{type(e).__name__}: {e}"})
                print(f"  {mode} {n}: {rows[-1]['error']}", flush=True)
    doc = {"bench": "tenk", **H.meta(False), "argv": sys.argv[1:], "rows": rows}
    doc["summary"] = summarize(rows)
    out = Path(a.out) if a.out.endswith(".json") else Path(a.out) / "tenk.json"
    H.write_json(out, doc)
    print_report(doc)
    return doc


if __name__ == "__main__":
    main()
