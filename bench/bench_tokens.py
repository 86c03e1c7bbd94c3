"""The picker's cost per request against the length of the answer: lean mode vs GAIE's echo mode vs no picker.

One mock worker streams one SSE chunk per token at a realistic pace (`--decode-ms-per-token`); the same
streamed chat requests (8, 256 and 1024 output tokens, `include_usage`) go through a real Envoy configured by
the product's generator (a) with no picker (round-robin baseline), (b) with the picker in lean response mode
(the default of every generated config) and (c) with the picker in echo mode (every response chunk through
the picker's stream, what GAIE-style gateway configs do). Reported per request: the picker's and Envoy's CPU
(user + system, from /proc), and, for each mode, its cost at 1024 tokens over its cost at 8 tokens.

A picker spends CPU while no request is running too (the engines' /metrics scraped every 100 ms, health,
probes; measured at 8-11 ms/s with one worker), and a 1024-token answer lasts ~130 times longer than an
8-token one, so the raw per-request figure charges each long request its share of that background. Each
stack's idle rate is therefore measured in the same run, over `IDLE_S` seconds with the same processes
before any traffic, and the figures are given both raw and net of it (rate x wall time / requests). The
length target is judged on the net figure, which is what a request costs; the background is reported as
its own line (it is per worker per second, not per request).

The echo path's floor comes from `bench.echo_floor`: a trivial grpc.aio servicer that only echoes chunks,
against the real picker, driven the same way in the same run; the picker's own share of a chunk is the
difference.

Targets (issue 15): lean at 1024 tokens <= 1.3x its own cost at 8 tokens; the maximum streamed tokens/s one
picker core carries (1 s of CPU / CPU per token); GAIE's echo mode per-chunk cost halved.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench import echo_floor
from bench import harness as H

NAME = "tokens"
LENGTHS = (8, 256, 1024)
# more requests for the short answers: CPU times from /proc tick at 10 ms, and 64 requests of ~1.5 ms each
# are only ~10 ticks, so a cell of 8-token answers would be ±10% on granularity alone (as would the ratio)
REQUESTS_SCALE = {8: 8, 256: 2, 1024: 2}
# lean and echo on the picker's default ext_proc transport (its own h2 server), and both again on grpcio's
# server (`--extproc-transport grpcio`, what the picker used before): the transport's share, same run
MODES = ("none", "lean", "echo", "lean_grpcio", "echo_grpcio")
IDLE_S = 10.0


def body(max_tokens: int, i: int) -> bytes:
    return json.dumps({"model": "mock-model", "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"request {i}: tell me a long story"}]}).encode()


def run_mode(mode: str, requests: int, concurrency: int, decode_ms: float, idle_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": mode, "rows": [], "idle_s": idle_s}
    with H.Stack() as st:
        w = H.mock_worker(st, "w0", ["--decode-ms-per-token", str(decode_ms), "--max-batch-size", "256"],
                          kv=False)
        pk = None
        if mode != "none":
            # idle workers are scraped less often (--worker-metrics-idle-interval-ms): off here, so the
            # background measured while idle is the one that runs while the worker streams
            pk = H.picker(st, f"w0={w.address}", extra=[
                "--endpoint-probe-interval-ms", "0", "--worker-metrics-idle-interval-ms", "0",
                "--extproc-transport", "grpcio" if mode.endswith("_grpcio") else "h2"])
        env = H.envoy(st, picker_proc=pk, upstreams=(w.address,),
                      response_mode="echo" if mode.startswith("echo") else "lean")
        url = f"{env.url}/v1/chat/completions"
        asyncio.run(H.closed_loop(url, lambda i: body(8, i), concurrency=2, max_requests=8, max_seconds=30,
                                  stream=True))  # warm-up: connections, certificate, caches
        p0, e0 = (pk.cpu_seconds() if pk else 0.0), env.cpu_seconds()
        time.sleep(idle_s)
        idle_p = (pk.cpu_seconds() - p0) / idle_s if pk else None
        idle_e = (env.cpu_seconds() - e0) / idle_s
        out["picker_idle_cpu_ms_per_s"] = idle_p * 1000 if idle_p is not None else None
        out["envoy_idle_cpu_ms_per_s"] = idle_e * 1000
        for n in LENGTHS:
            p0 = pk.cpu_seconds() if pk else 0.0
            e0 = env.cpu_seconds()
            results, elapsed = asyncio.run(H.closed_loop(url, lambda i, n=n: body(n, i), concurrency=concurrency,
                                                         max_requests=requests * REQUESTS_SCALE[n],
                                                         max_seconds=300, stream=True))
            ok = [r for r in results if r.status == 200 and not r.error]
            p1 = pk.cpu_seconds() if pk else 0.0
            e1 = env.cpu_seconds()
            k = max(len(ok), 1)
            row = {"output_tokens": n, "requests": len(results), "ok": len(ok),
                   "picker_cpu_ms_per_request": (p1 - p0) * 1000 / k if pk else None,
                   "envoy_cpu_ms_per_request": (e1 - e0) * 1000 / k, "wall_s": elapsed}
            row["picker_net_cpu_ms_per_request"] = (
                max(0.0, p1 - p0 - idle_p * elapsed) * 1000 / k if idle_p is not None else None)
            row["envoy_net_cpu_ms_per_request"] = max(0.0, e1 - e0 - idle_e * elapsed) * 1000 / k
            out["rows"].append(row)
            print(f"{mode:>5} {n:>5} tokens: {len(ok)}/{len(results)} ok, picker "
                  f"{H.fmt(row['picker_cpu_ms_per_request'])} ms (net {H.fmt(row['picker_net_cpu_ms_per_request'])}),"
                  f" envoy {row['envoy_cpu_ms_per_request']:.2f} ms (net {row['envoy_net_cpu_ms_per_request']:.2f})"
                  f" CPU per request", flush=True)
    return out


def summarize(doc: dict[str, Any]) -> None:
    by = {m["mode"]: {r["output_tokens"]: r for r in m["rows"]} for m in doc["modes"]}
    s: dict[str, Any] = {}
    for mode in MODES[1:]:
        rows = by.get(mode)
        if not rows:
            continue
        c8, c1024 = rows[8]["picker_cpu_ms_per_request"], rows[1024]["picker_cpu_ms_per_request"]
        n8, n1024 = rows[8]["picker_net_cpu_ms_per_request"], rows[1024]["picker_net_cpu_ms_per_request"]
        s[mode] = {"picker_1024_over_8_raw": H.ratio(c1024, c8),
                   "picker_1024_over_8_net": H.ratio(n1024, n8),
                   "picker_net_us_per_extra_chunk": (n1024 - n8) * 1000 / (1024 - 8),
                   "picker_idle_cpu_ms_per_s": next(m["picker_idle_cpu_ms_per_s"] for m in doc["modes"]
                                                    if m["mode"] == mode),
                   "max_streamed_tokens_per_s_one_core": 1024 / (n1024 / 1000) if n1024 else None}
    if "lean" in s:
        r = s["lean"]["picker_1024_over_8_net"]
        s["lean_target_met"] = r is not None and r <= 1.3
    floor = doc.get("echo_floor")
    if floor:
        s["echo_floor"] = {t: {k: floor[t][k] for k in ("trivial_us_per_chunk", "picker_us_per_chunk",
                                                        "picker_own_us_per_chunk")} for t in ("grpcio", "h2")}
        s["echo_floor"]["picker_h2_over_grpcio"] = floor["picker_h2_over_grpcio"]
    if "echo" in s and "echo_grpcio" in s:  # (lean's per-chunk figures are ~0 +- noise: no ratio of those)
        s["echo_h2_over_grpcio_per_extra_chunk"] = H.ratio(s["echo"]["picker_net_us_per_extra_chunk"],
                                                           s["echo_grpcio"]["picker_net_us_per_extra_chunk"])
    for mode in ("lean", "echo"):
        if mode in s and f"{mode}_grpcio" in s:  # the transport's effect, same run
            s[f"{mode}_h2_over_grpcio_at_8"] = H.ratio(by[mode][8]["picker_net_cpu_ms_per_request"],
                                                       by[f"{mode}_grpcio"][8]["picker_net_cpu_ms_per_request"])
    if "lean" in s and "echo" in s:
        s["echo_over_lean_at_1024"] = H.ratio(by["echo"][1024]["picker_cpu_ms_per_request"],
                                              by["lean"][1024]["picker_cpu_ms_per_request"])
    doc["summary"] = s


def report(doc: dict[str, Any]) -> None:
    rows = []
    for m in doc["modes"]:
        for r in m["rows"]:
            rows.append([m["mode"], r["output_tokens"], f"{r['ok']}/{r['requests']}",
                         H.fmt(r["picker_cpu_ms_per_request"]), H.fmt(r["picker_net_cpu_ms_per_request"]),
                         H.fmt(r["envoy_cpu_ms_per_request"]), H.fmt(r["envoy_net_cpu_ms_per_request"])])
    print(H.table(rows, ["mode", "output tokens", "ok", "picker CPU ms/req", "net of idle", "envoy CPU ms/req",
                         "net of idle"]))
    print(json.dumps(doc["summary"], indent=1))


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for m in doc["modes"]:
        xs = [r["output_tokens"] for r in m["rows"]]
        if m["mode"] != "none":
            ax[0].plot(xs, [r["picker_net_cpu_ms_per_request"] for r in m["rows"]], marker="o", label=m["mode"])
        ax[1].plot(xs, [r["envoy_net_cpu_ms_per_request"] for r in m["rows"]], marker="o", label=m["mode"])
    for a, t in zip(ax, ("picker CPU ms / request (net of idle)", "Envoy CPU ms / request (net of idle)"),
                    strict=True):
        a.set_xscale("log")
        a.set_xlabel("streamed output tokens (one SSE chunk each)")
        a.set_title(t)
        a.legend()
    H.save_figure(fig, "Cost per request vs answer length", path)


def main() -> None:
    ap = H.bench_parser(__doc__, NAME)
    ap.add_argument("--decode-ms-per-token", type=float, default=2.0)
    args = ap.parse_args()
    requests, conc = (4, 2) if args.quick else (64, 16)
    decode = 0.2 if args.quick else args.decode_ms_per_token
    idle = 1.0 if args.quick else IDLE_S
    doc: dict[str, Any] = {"meta": H.meta(args.quick), "decode_ms_per_token": decode, "requests": requests,
                           "concurrency": conc, "modes": [run_mode(m, requests, conc, decode, idle) for m in MODES]}
    # quick: 8 x 292 extra chunks, enough CPU (~70 ms) to stand well above the 10 ms clock tick it is read in
    doc["echo_floor"] = echo_floor.measure(*((300, 8, 4) if args.quick else (1000, 32, 8)))
    summarize(doc)
    H.publish(doc, args.out, NAME, report, chart)


if __name__ == "__main__":
    main()
