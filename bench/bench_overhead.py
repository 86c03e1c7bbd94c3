"""Overhead of the picker on the request path (issue 7 section 1, issue 2 "Benchmark").

    python -m bench.bench_overhead [--quick] [--out DIR]

Same mock workers (made near-instant: every simulated time divided by 1e6), one Envoy per configuration:

  (a) Envoy round-robin, no ext_proc (the baseline every ratio is against)
  (b) Envoy + picker, load only (--tokenizer-protocol none)
  (c) Envoy + picker, trtllm-render + KV scoring (one extra HTTP hop to the mock renderer per request)

Closed loop at concurrency 1, 16, 32, 64; client latency p50/p90/p99 and req/s, ratios to (a) and the
latency the picker adds (p50(x) - p50(a)). The picker's own decision time comes from its
`epp_decision_seconds` / `epp_score_seconds` histograms (deltas per run).

Decision time for 8k-token prompts over 8 and 64 workers: (1) a real picker process (`bench.picker_host`,
the product plus timing probes) whose workers are simulated KV publishers (`bench.kvpub`) that hold long
prefixes of the prompt, scored through its ext_proc port; its histograms give the figures; (2) the same
`Picker.decide` in-process with the render call stubbed out, timed exactly per call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import request_floor
from bench.chat_bodies import make_bodies
from bench.kvpub import make_doc

FAST_MOCK = ["--speedup", "1000000", "--prefill-ms-per-token", "0", "--decode-ms-per-token", "0",
             "--max-batch-size", "4096", "--num-blocks", "65536"]
CONFIGS = {"a": "envoy round-robin (no ext_proc)", "b": "envoy + picker, load only",
           "c": "envoy + picker, render + KV"}


# ----------------------------------------------------------------------------- end to end
def run_e2e(quick: bool) -> dict[str, Any]:
    levels = [1, 16, 32, 64]
    n_req = {1: 60, 16: 200, 32: 200, 64: 300} if quick else {1: 1500, 16: 4000, 32: 4000, 64: 5000}
    secs = 1.5 if quick else 8.0
    make = make_bodies(120)
    rows: list[dict[str, Any]] = []
    with H.Stack() as outer:
        workers = [H.mock_worker(outer, f"worker-{i}", FAST_MOCK) for i in range(2)]
        renderer = H.mock_renderer(outer)
        for cfg in ("a", "b", "c"):
            with H.Stack() as st:
                pk = None
                if cfg == "a":
                    env = H.envoy(st, upstreams=[w.address for w in workers])
                else:
                    pk = H.picker(st, H.endpoints_spec(workers), "none" if cfg == "b" else "trtllm-render",
                                  renderer if cfg == "c" else None)
                    if cfg == "c":
                        H.wait_subscribed(pk, [w.address for w in workers])
                    env = H.envoy(st, picker_proc=pk)
                url = env.url + "/v1/chat/completions"
                asyncio.run(H.closed_loop(url, make, concurrency=8, max_requests=40 if quick else 300,
                                          max_seconds=5))
                for c in levels:
                    procs = [p for p in (pk, env, renderer, *workers) if p is not None]
                    cpu0 = {p.name: p.cpu_seconds() for p in procs}
                    m0 = H.get_text(H.picker_url(pk) + "/metrics") if pk else ""
                    res, el = asyncio.run(H.closed_loop(url, make, concurrency=c, max_requests=n_req[c],
                                                        max_seconds=secs))
                    row = {"config": cfg, "concurrency": c, **H.summarize(res, el)}
                    ok = max(1, row["requests"] - row["errors"])
                    row["cpu_us_per_request"] = {p.name: (p.cpu_seconds() - cpu0[p.name]) / ok * 1e6 for p in procs}
                    if pk is not None:
                        m1 = H.get_text(H.picker_url(pk) + "/metrics")
                        for name in ("epp_decision_seconds", "epp_score_seconds", "epp_render_seconds"):
                            d = H.hist_delta(H.histogram(m1, name), H.histogram(m0, name))
                            row[name] = H.hist_summary_ms(d)
                    rows.append(row)
                    print(f"  {cfg} c={c:<3} {row['rps']:8.0f} req/s  p50 {row['p50_ms']:.2f} ms  "
                          f"p99 {row['p99_ms']:.2f} ms  errors {row['errors']}", flush=True)
    base = {r["concurrency"]: r for r in rows if r["config"] == "a"}
    for r in rows:
        b = base[r["concurrency"]]
        r["p50_ratio"] = H.ratio(r["p50_ms"], b["p50_ms"])
        r["p99_ratio"] = H.ratio(r["p99_ms"], b["p99_ms"])
        r["rps_ratio"] = H.ratio(r["rps"], b["rps"])
        r["added_p50_ms"] = r["p50_ms"] - b["p50_ms"] if r["p50_ms"] is not None and b["p50_ms"] is not None \
            else None
    return {"rows": rows}


# ----------------------------------------------------------------------------- decision time, real picker
def run_decision_process(n_workers: int, n_tokens: int, reps: int) -> dict[str, Any]:
    doc_blocks = max(n_tokens // 32 + 2, 64)
    doc = make_doc(doc_blocks, 1)
    rng = random.Random(5)
    with H.Stack() as st:
        pub = H.kv_publisher(st, n_workers, rate=0, doc_blocks=doc_blocks)
        spec, addrs = H.fake_worker_spec(pub)
        rend = H.mock_renderer(st)
        pk = H.picker(st, spec, "trtllm-render", rend, extra=H.SIMULATED_WORKER_FLAGS,
                      argv0=[sys.executable, "-m", "bench.picker_host"])
        H.wait_subscribed(pk, addrs)
        H.wait_warm(pk, addrs, H.kvpub_command(pub, "go")["warm"], timeout=20, poll=0.1)

        async def go() -> list[float]:
            c = H.ExtProcClient(pk.port)
            out = []
            try:
                for i in range(reps):
                    toks = doc[:n_tokens - 1] + [100 + rng.randrange(31000)]
                    body = json.dumps({"model": "mock-model", "max_tokens": 1, "prompt_token_ids": toks,
                                       "messages": [{"role": "user", "content": f"q{i}"}]}).encode()
                    dest, dt = await c.decide(body)
                    assert dest, "picker rejected the request"
                    out.append(dt)
            finally:
                await c.close()
            return out

        rtt = asyncio.run(go())
        text = H.get_text(H.picker_url(pk) + "/metrics")
        res = {"workers": n_workers, "prompt_tokens": n_tokens, "requests": reps,
               "histogram_epp_decision": H.hist_summary_ms(H.histogram(text, "epp_decision_seconds")),
               "histogram_epp_score": H.hist_summary_ms(H.histogram(text, "epp_score_seconds")),
               "histogram_epp_render": H.hist_summary_ms(H.histogram(text, "epp_render_seconds")),
               "fine_decision": H.hist_summary_ms(H.histogram(text, "bench_decision_seconds")),
               "fine_lookup": H.hist_summary_ms(H.histogram(text, "bench_lookup_seconds")),
               "extproc_round_trip": H.pcts_ms(rtt)}
    return res


# ----------------------------------------------------------------------------- decision time, in-process
async def _inproc(n_workers: int, n_tokens: int, reps: int) -> dict[str, Any]:
    from epp_extproc.adapters.kv_routing import KvRouting
    from epp_extproc.config import Config
    from epp_extproc.core.admission import BodyBudget, InflightGate
    from epp_extproc.core.assemble import assemble
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
    from epp_extproc.core.lean import LeanSignals
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.core.picker import Picker
    from epp_extproc.core.render import Rendered
    from epp_extproc.core.request import RequestContext
    from epp_extproc.dev.kvwire import pack_batch, stored_event
    from epp_extproc.metrics import PickerMetrics
    from kvindex.decode import decode_payload

    logging.getLogger("epp_extproc").setLevel(logging.ERROR)  # 64 "no KV-event endpoint" warnings
    doc = make_doc(n_tokens // 32 + 2, 1)
    rng = random.Random(9)
    cfg = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:9")
    reg = EndpointRegistry()
    metrics = PickerMetrics()
    load = LoadTracker(metrics.endpoint_inflight)
    kv = KvRouting(reg, block_size=32, max_blocks_per_worker=cfg.max_index_blocks_per_worker, topic="",
                   prediction_ttl_s=cfg.prediction_ttl_s, metrics_registry=None, ask_server_info=False)
    addrs = [f"127.0.0.1:{20000 + i}" for i in range(n_workers)]
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(addrs)])
    await asyncio.sleep(0.05)
    nb = n_tokens // 32
    pool = [rng.randrange(100, 32000) for _ in range(4096 * 32)]
    for i, a in enumerate(addrs):
        k = nb if i == 0 else rng.randint(nb // 2, nb)
        evs = [stored_event([(i << 40) + j for j in range(k)], None, doc[:k * 32], 32)]
        # plus 4096 unrelated blocks per worker, so the index is not trivially small
        evs.append(stored_event([(i << 40) + (1 << 30) + j for j in range(4096)], None, pool, 32))
        kv.index.apply_batch(a, decode_payload(pack_batch(evs)))

    class StubRenderer:  # the render hop is measured separately (histogram epp_render_seconds)
        protocol = "trtllm-render"
        tokens: list[int] = []

        async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
            return Rendered(list(self.tokens))

    rend = StubRenderer()
    director = assemble(cfg, reg, load, metrics, renderer=rend, kv=kv).director  # type: ignore[arg-type]
    picker = Picker(director, gate=InflightGate(cfg.max_inflight_requests),
                    bodies=BodyBudget(cfg.max_body_bytes, cfg.max_buffered_body_bytes), lean=LeanSignals(load, metrics))
    words = " ".join(str(t) for t in doc[:n_tokens])  # a body of realistic size (~6 bytes per token)
    decide, score, cpu = [], [], []
    for i in range(reps):
        rend.tokens = doc[:n_tokens - 1] + [100 + rng.randrange(31000)]
        body = json.dumps({"model": "mock-model", "max_tokens": 1, "messages": [
            {"role": "user", "content": words + f" q{i}"}]}).encode()
        ctx = RequestContext("POST", "/v1/chat/completions", {"content-type": ["application/json"]}, body, None)
        c0, t0 = time.process_time(), time.perf_counter()
        d = await picker.decide(ctx)
        decide.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        d.booking.free()
        req = director.scheduling_request(ctx, await director.planner.plan(ctx, director.parse(ctx)))
        t0 = time.perf_counter()
        director.schedule(req)
        score.append(time.perf_counter() - t0)
    await kv.close()
    return {"workers": n_workers, "prompt_tokens": n_tokens, "requests": reps,
            "decide_without_render": H.pcts_ms(decide), "score_only": H.pcts_ms(score),
            # CPU time of the process per decision (issue 45's figure), mean over the repetitions
            "cpu_ms_per_decide": sum(cpu) / len(cpu) * 1000.0}


def run_decision(quick: bool) -> list[dict[str, Any]]:
    out = []
    reps_proc, reps_in = (20, 50) if quick else (400, 2000)
    for n in (8, 64):
        row = run_decision_process(n, 8192, reps_proc)
        row["in_process"] = asyncio.run(_inproc(n, 8192, reps_in))
        out.append(row)
        print(f"  8k tokens x {n} workers: decision (incl. render) p50 "
              f"{row['fine_decision']['p50_ms']:.3f} p99 {row['fine_decision']['p99_ms']:.3f} ms; "
              f"in-process without render p50 {row['in_process']['decide_without_render']['p50_ms']:.3f} "
              f"p99 {row['in_process']['decide_without_render']['p99_ms']:.3f} ms", flush=True)
    return out


# ----------------------------------------------------------------------------- report
def targets(e2e: dict[str, Any], dec: list[dict[str, Any]], floor: dict[str, Any] | None = None) \
        -> dict[str, Any]:
    rows = e2e["rows"]
    c1 = next(r for r in rows if r["config"] == "c" and r["concurrency"] == 1)
    best_c = max(r["rps"] for r in rows if r["config"] == "c")
    best_cpu = min((r["cpu_us_per_request"].get("picker") for r in rows
                    if r["config"] == "c" and r["concurrency"] > 1), default=None)
    worst_in = max(d["in_process"]["decide_without_render"]["p99_ms"] for d in dec)
    worst_in50 = max(d["in_process"]["decide_without_render"]["p50_ms"] for d in dec)
    worst_proc50 = max(d["fine_decision"]["p50_ms"] or 0 for d in dec)
    worst_proc99 = max(d["fine_decision"]["p99_ms"] or 0 for d in dec)
    return {
        "decision_p50_le_0.2ms": {"target_ms": 0.2, "picker_without_render_ms": worst_in50,
                                  "picker_with_render_ms": worst_proc50, "met_without_render": worst_in50 <= 0.2,
                                  "met_with_render": worst_proc50 <= 0.2},
        "decision_p99_le_1ms": {"target_ms": 1.0, "picker_without_render_ms": worst_in,
                                "picker_with_render_ms": worst_proc99, "met_without_render": worst_in <= 1.0,
                                "met_with_render": worst_proc99 <= 1.0},
        "added_p50_at_c1_le_2ms": {"target_ms": 2.0, "measured_ms": c1["added_p50_ms"],
                                   "met": c1["added_p50_ms"] is not None and c1["added_p50_ms"] <= 2.0},
        "c_sustains_1000_rps": {"target": 1000, "measured_max_rps": best_c, "met": best_c >= 1000,
                                # the client, Envoy, renderer and workers share the 2 cores: what one picker
                                # process carries on a core of its own is 1 s over its CPU per request
                                "picker_cpu_us_per_request": best_cpu,
                                "one_picker_core_rps": 1e6 / best_cpu if best_cpu else None,
                                # the same request driven straight over gRPC (no Envoy on the cores), next
                                # to a servicer that does nothing but route: grpc.aio's own floor
                                # (the picker's default transport, h2; grpcio's server as the same-run baseline)
                                "direct_grpc_one_core_rps": (floor or {}).get("h2", {}).get("one_picker_core_rps"),
                                "direct_grpc_one_core_rps_on_grpcio": (floor or {}).get("grpcio", {}).get(
                                    "one_picker_core_rps"),
                                "direct_grpc_met": ((floor or {}).get("h2", {}).get("one_picker_core_rps") or 0)
                                >= 1000,
                                "trivial_servicer_one_core_rps": (floor or {}).get("h2", {}).get(
                                    "trivial_servicer_core_rps")},
    }


def print_report(doc: dict[str, Any]) -> None:
    rows = doc["e2e"]["rows"]
    print("\nEnd to end (client -> Envoy -> [picker] -> near-instant mock workers); ratios are to (a) at the "
          "same concurrency")
    print(H.table([[r["config"], r["concurrency"], r["rps"], r["p50_ms"], r["p90_ms"], r["p99_ms"],
                    r["added_p50_ms"], r["p50_ratio"], r["p99_ratio"], r["rps_ratio"],
                    (r.get("epp_decision_seconds") or {}).get("p50_ms"),
                    (r.get("epp_decision_seconds") or {}).get("p99_ms")] for r in rows],
                  ["cfg", "conc", "req/s", "p50 ms", "p90 ms", "p99 ms", "added p50", "p50 x", "p99 x",
                   "req/s x", "dec p50", "dec p99"]))
    print("\nDecision time, 8k-token prompts (ms)")
    print(H.table([[d["workers"], d["histogram_epp_decision"]["p50_ms"], d["histogram_epp_decision"]["p99_ms"],
                    d["fine_decision"]["p50_ms"], d["fine_decision"]["p99_ms"], d["histogram_epp_render"]["p50_ms"],
                    d["fine_lookup"]["p50_ms"], d["fine_lookup"]["p99_ms"],
                    d["in_process"]["decide_without_render"]["p50_ms"],
                    d["in_process"]["decide_without_render"]["p99_ms"],
                    d["in_process"]["score_only"]["p50_ms"], d["in_process"]["score_only"]["p99_ms"]]
                   for d in doc["decision_8k"]],
                  ["workers", "epp_dec p50", "epp_dec p99", "dec p50", "dec p99", "render p50", "lookup p50",
                   "lookup p99", "no-render p50", "no-render p99", "score p50", "score p99"]))
    f = doc.get("request_floor")
    if f:
        for t in ("grpcio", "h2"):
            print(f"\nOne request straight over gRPC (lean-mode messages, c=32), ext_proc transport {t}: picker "
                  f"{f[t]['picker_us_per_request']:.0f} us CPU ({f[t]['one_picker_core_rps']:.0f} req/s per core); "
                  f"a trivial servicer {f[t]['trivial_us_per_request']:.0f} us "
                  f"({f[t]['trivial_servicer_core_rps']:.0f} req/s)")
        print(f"picker h2 / grpcio: {f['picker_h2_over_grpcio']:.2f}; one render call "
              f"{f['render_call']['picker_render_client_us_per_call']:.0f} us in the picker's client, "
              f"{f['render_call']['aiohttp_us_per_call']:.0f} us with aiohttp")
    H.print_targets(doc)


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["e2e"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    levels = sorted({r["concurrency"] for r in rows})
    for cfg, label in CONFIGS.items():
        rs = sorted((r for r in rows if r["config"] == cfg), key=lambda r: r["concurrency"])
        axes[0].plot(levels, [r["p50_ms"] for r in rs], "o-", label=f"({cfg}) {label}")
        axes[1].plot(levels, [r["p99_ms"] for r in rs], "o-", label=f"({cfg})")
        axes[2].plot(levels, [r["rps"] for r in rs], "o-", label=f"({cfg})")
    for ax in axes:
        ax.set_xscale("log", base=2)
    H.label_axes(axes, ("latency p50 (ms)", "latency p99 (ms)", "throughput (req/s)"), "concurrency")
    axes[0].legend(fontsize=8)
    H.save_figure(fig, "Picker overhead: same Envoy, same near-instant mock workers (2-core machine)", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "overhead")
    a = ap.parse_args(argv)
    print("overhead: end to end", flush=True)
    e2e = run_e2e(a.quick)
    print("overhead: decision time for 8k-token prompts", flush=True)
    dec = run_decision(a.quick)
    print("overhead: one request's CPU in the picker against a trivial grpc.aio servicer", flush=True)
    floor = request_floor.measure(a.quick)
    doc = {"bench": "overhead", **H.meta(a.quick), "configs": CONFIGS, "mock_args": FAST_MOCK,
           "e2e": e2e, "decision_8k": dec, "request_floor": floor}
    doc["targets"] = targets(e2e, dec, floor)
    return H.publish(doc, a.out, "overhead", print_report, chart)


if __name__ == "__main__":
    main()
