"""Scale of the index and the event path (issue 7 section 3).

    python -m bench.bench_scale [--quick] [--out DIR]

8 -> 64 -> 256 simulated workers (`bench.kvpub`: one real ZMQ PUB socket per worker, TensorRT-LLM wire form)
publish KV events concurrently at a realistic rate (10 batches/s per worker, 1..15 fresh blocks each, hanging
off a long shared prefix every worker partly holds, with LRU removals once a worker holds its cap) while
requests of 1k..32k tokens are scored through the real picker's ext_proc port (`bench.picker_host`: the
product plus timing probes; trtllm-render against the mock renderer; 4 concurrent clients).

Per (workers, prompt length): ingest lag p99 (batch `ts` stamped at publish -> applied to the index),
decision time p99 (`Picker.decide`, includes the render hop), index lookup p99 (`Pipeline.candidates`),
picker RSS and CPU utilisation. Baseline for the growth ratios: 8 workers at the same prompt length (and 1k
tokens at the same worker count). Chart: log-log growth with workers and with prompt length.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.kvpub import make_doc

DOC_BLOCKS = 1024  # 32k tokens of shared prefix


def bodies_for(doc: list[int], n_tokens: int, k: int, rng: random.Random) -> list[bytes]:
    out = []
    for i in range(k):
        toks = doc[:n_tokens - 1] + [100 + rng.randrange(31000)]
        out.append(json.dumps({"model": "mock-model", "max_tokens": 1, "prompt_token_ids": toks,
                               "messages": [{"role": "user", "content": f"q{i}"}]}).encode())
    return out


async def score_loop(port: int, bodies: list[bytes], concurrency: int, max_requests: int,
                     seconds: float) -> tuple[list[float], float, int]:
    client = H.ExtProcClient(port)
    rtt: list[float] = []
    rejected = 0
    it = iter(range(max_requests))
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker() -> None:
        nonlocal rejected
        for i in it:
            if time.perf_counter() > deadline:
                return
            dest, dt = await client.decide(bodies[i % len(bodies)])
            if dest:
                rtt.append(dt)
            else:
                rejected += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return rtt, time.perf_counter() - t0, rejected


def run_workers(n: int, lengths: list[int], seconds: float, rate: float, cap: int) -> list[dict[str, Any]]:
    rows = []
    doc = make_doc(DOC_BLOCKS, 1)
    rng = random.Random(n)
    with H.Stack() as st:
        pub = H.kv_publisher(st, n, rate=rate, doc_blocks=DOC_BLOCKS, cap=cap)
        spec, addrs = H.fake_worker_spec(pub)
        rend = H.mock_renderer(st)
        pk = H.picker(st, spec, "trtllm-render", rend, extra=H.SIMULATED_WORKER_FLAGS,
                      argv0=[sys.executable, "-m", "bench.picker_host"])
        H.wait_subscribed(pk, addrs, timeout=60)
        rss_idle = pk.rss_bytes()
        H.wait_warm(pk, addrs, H.kvpub_command(pub, "go")["warm"], timeout=60, poll=0.2)
        time.sleep(0.5)
        for length in lengths:
            bodies = bodies_for(doc, length, 8, rng)
            m0 = H.get_text(H.picker_url(pk) + "/metrics")
            cpu0, t0 = pk.cpu_seconds(), time.monotonic()
            rtt, el, rejected = asyncio.run(score_loop(pk.port, bodies, 4, 100_000, seconds))
            cpu = (pk.cpu_seconds() - cpu0) / (time.monotonic() - t0)
            m1 = H.get_text(H.picker_url(pk) + "/metrics")
            d = {name: H.hist_summary_ms(H.hist_delta(H.histogram(m1, name), H.histogram(m0, name)))
                 for name in ("bench_decision_seconds", "bench_lookup_seconds", "bench_kv_ingest_lag_seconds",
                              "bench_kv_apply_seconds", "epp_decision_seconds", "epp_render_seconds")}
            snap = H.get_json(H.picker_url(pk) + "/debug/kv")
            pst = H.kvpub_command(pub, "stats")
            row = {"workers": n, "prompt_tokens": length, "decisions": len(rtt), "rejected": rejected,
                   "decisions_per_s": len(rtt) / el if el > 0 else 0.0,
                   "decision": d["bench_decision_seconds"], "lookup": d["bench_lookup_seconds"],
                   "ingest_lag": d["bench_kv_ingest_lag_seconds"], "apply_batch": d["bench_kv_apply_seconds"],
                   "epp_decision_histogram": d["epp_decision_seconds"], "render": d["epp_render_seconds"],
                   "extproc_round_trip": H.pcts_ms(rtt), "picker_rss_mb": pk.rss_bytes() / 2**20,
                   "picker_rss_idle_mb": rss_idle / 2**20, "picker_cpu_util": cpu,
                   "index_unique_blocks": snap["unique_blocks"],
                   "index_blocks_total": sum(w["blocks_indexed"] for w in snap["workers"].values()),
                   "events_batches_per_s_target": rate * n, "publisher": pst}
            rows.append(row)
            print(f"  {n:>4} workers {length:>6} tokens: decision p99 {H.fmt(row['decision']['p99_ms'])} ms, "
                  f"lookup p99 {H.fmt(row['lookup']['p99_ms'], '.3f')} ms, ingest lag p99 "
                  f"{H.fmt(row['ingest_lag']['p99_ms'])} ms, RSS {row['picker_rss_mb']:.0f} MB, picker CPU "
                  f"{cpu * 100:.0f}%, {row['decisions_per_s']:.0f} decisions/s, events "
                  f"{pst['rate']:.0f}/{rate * n:.0f} batches/s", flush=True)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    by = {(r["workers"], r["prompt_tokens"]): r for r in rows}
    wmin = min(r["workers"] for r in rows)
    lmin = min(r["prompt_tokens"] for r in rows)
    for r in rows:
        bw = by[(wmin, r["prompt_tokens"])]
        bl = by[(r["workers"], lmin)]
        r["vs_fewest_workers"] = {k: H.ratio(r[k]["p99_ms"], bw[k]["p99_ms"]) for k in ("decision", "lookup",
                                                                                          "ingest_lag")}
        r["vs_fewest_workers"]["rss"] = H.ratio(r["picker_rss_mb"], bw["picker_rss_mb"])
        r["vs_shortest_prompt"] = {k: H.ratio(r[k]["p99_ms"], bl[k]["p99_ms"]) for k in ("decision", "lookup")}


def first_bottleneck(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first figure to cross its limit, scanning configurations from the lightest up: decision p99 > 1 ms
    without render is judged on the lookup; ingest lag p99 > 100 ms means routing on a stale view; picker CPU
    > 90% means the single event loop is saturated (everything queues behind it)."""
    limits = [("picker_cpu_util", 0.9, lambda r: r["picker_cpu_util"]),
              ("ingest_lag_p99_ms", 100.0, lambda r: r["ingest_lag"]["p99_ms"] or 0.0),
              ("lookup_p99_ms", 1.0, lambda r: r["lookup"]["p99_ms"] or 0.0),
              ("decision_p99_ms", 10.0, lambda r: r["decision"]["p99_ms"] or 0.0)]
    for r in sorted(rows, key=lambda r: (r["workers"], r["prompt_tokens"])):
        crossed = [(name, lim, f(r)) for name, lim, f in limits if f(r) > lim]
        if crossed:
            return {"workers": r["workers"], "prompt_tokens": r["prompt_tokens"],
                    "crossed": [{"figure": n, "limit": lim, "value": v} for n, lim, v in crossed]}
    return {"workers": None, "crossed": []}


def print_report(doc: dict[str, Any]) -> None:
    rows = doc["rows"]
    print("\nScale (p99 in ms; 'x8w' = ratio to the fewest workers at the same prompt length)")
    print(H.table([[r["workers"], r["prompt_tokens"], r["decision"]["p99_ms"], r["vs_fewest_workers"]["decision"],
                    r["lookup"]["p99_ms"], r["vs_fewest_workers"]["lookup"], r["ingest_lag"]["p50_ms"],
                    r["ingest_lag"]["p99_ms"], r["vs_fewest_workers"]["ingest_lag"], r["render"]["p50_ms"],
                    r["picker_rss_mb"], r["picker_cpu_util"], r["decisions_per_s"], r["publisher"]["rate"]]
                   for r in rows],
                  ["workers", "tokens", "dec p99", "x8w", "lookup p99", "x8w", "lag p50", "lag p99", "x8w",
                   "render p50", "RSS MB", "CPU", "dec/s", "ev/s"]))
    print("\nFirst bottleneck:", json.dumps(doc["first_bottleneck"]))


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["rows"]
    ws = sorted({r["workers"] for r in rows})
    ls = sorted({r["prompt_tokens"] for r in rows})
    by = {(r["workers"], r["prompt_tokens"]): r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for L in ls:
        axes[0].plot(ws, [by[(w, L)]["decision"]["p99_ms"] for w in ws], "o-", label=f"decision p99, {L} tok")
        axes[0].plot(ws, [by[(w, L)]["lookup"]["p99_ms"] for w in ws], "s--", label=f"lookup p99, {L} tok")
    axes[1].plot(ws, [max(by[(w, L)]["ingest_lag"]["p99_ms"] or 0 for L in ls) for w in ws], "o-",
                 label="ingest lag p99 (worst over prompt lengths)")
    axes[1].plot(ws, [max(by[(w, L)]["picker_rss_mb"] for L in ls) for w in ws], "s-", label="picker RSS (MB)")
    axes[1].plot(ws, [max(by[(w, L)]["picker_cpu_util"] for L in ls) * 100 for w in ws], "^-",
                 label="picker CPU (%)")
    for w in ws:
        axes[2].plot(ls, [by[(w, L)]["decision"]["p99_ms"] for L in ls], "o-", label=f"decision p99, {w} workers")
        axes[2].plot(ls, [by[(w, L)]["lookup"]["p99_ms"] for L in ls], "s--", label=f"lookup p99, {w} workers")
    titles = ("time vs workers (ms)", "event path and memory vs workers", "time vs prompt length (ms)")
    for ax, title, xl in zip(axes, titles, ("workers", "workers", "prompt tokens"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    H.save_figure(fig, "Picker scale: workers publishing KV events (10 batches/s each) while requests are scored", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "scale")
    ap.add_argument("--rate", type=float, default=10.0, help="KV-event batches per second per worker")
    a = ap.parse_args(argv)
    if a.quick:
        workers, lengths, seconds = [4, 16], [1024, 8192], 1.0
    else:
        workers, lengths, seconds = [8, 64, 256], [1024, 4096, 16384, 32000], 6.0
    print("scale: workers x prompt length", flush=True)
    rows = []
    for n in workers:
        rows += run_workers(n, lengths, seconds, a.rate, cap=512)
    add_ratios(rows)
    doc = {"bench": "scale", **H.meta(a.quick), "rate_per_worker": a.rate, "doc_blocks": DOC_BLOCKS,
           "rows": rows}
    doc["first_bottleneck"] = first_bottleneck(rows)
    return H.publish(doc, a.out, "scale", print_report, chart)


if __name__ == "__main__":
    main()
