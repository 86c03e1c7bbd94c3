"""The picker's cost per request against the length of the answer: lean mode vs GAIE's echo mode vs no picker.

One mock worker streams one SSE chunk per token at a realistic pace (`--decode-ms-per-token`); the same
streamed chat requests (8, 256 and 1024 output tokens, `include_usage`) go through a real Envoy configured by
the product's generator (a) with no picker (round-robin baseline), (b) with the picker in lean response mode
(the default of every generated config) and (c) with the picker in echo mode (every response chunk through
the picker's stream, what GAIE-style gateway configs do). Reported per request: the picker's and Envoy's CPU
(user + system, from /proc), and, for each mode, its cost at 1024 tokens over its cost at 8 tokens.

Targets (issue 15): lean at 1024 tokens <= 1.3x its own cost at 8 tokens; the maximum streamed tokens/s one
picker core carries (1 s of CPU / CPU per token).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bench import harness as H

NAME = "tokens"
LENGTHS = (8, 256, 1024)
MODES = ("none", "lean", "echo")


def body(max_tokens: int, i: int) -> bytes:
    return json.dumps({"model": "mock-model", "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"request {i}: tell me a long story"}]}).encode()


def run_mode(mode: str, requests: int, concurrency: int, decode_ms: float) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": mode, "rows": []}
    with H.Stack() as st:
        w = H.mock_worker(st, "w0", ["--decode-ms-per-token", str(decode_ms), "--max-batch-size", "256"],
                          kv=False)
        pk = None
        if mode != "none":
            pk = H.picker(st, f"w0={w.address}", extra=["--endpoint-probe-interval-ms", "0"])
        env = H.envoy(st, picker_proc=pk, upstreams=(w.address,), response_mode="echo" if mode == "echo" else "lean")
        url = f"{env.url}/v1/chat/completions"
        asyncio.run(H.closed_loop(url, lambda i: body(8, i), concurrency=2, max_requests=8, max_seconds=30,
                                  stream=True))  # warm-up: connections, certificate, caches
        for n in LENGTHS:
            p0 = pk.cpu_seconds() if pk else 0.0
            e0 = env.cpu_seconds()
            results, elapsed = asyncio.run(H.closed_loop(url, lambda i, n=n: body(n, i), concurrency=concurrency,
                                                         max_requests=requests, max_seconds=300, stream=True))
            ok = [r for r in results if r.status == 200 and not r.error]
            p1 = pk.cpu_seconds() if pk else 0.0
            e1 = env.cpu_seconds()
            k = max(len(ok), 1)
            out["rows"].append({"output_tokens": n, "requests": len(results), "ok": len(ok),
                                "picker_cpu_ms_per_request": (p1 - p0) * 1000 / k if pk else None,
                                "envoy_cpu_ms_per_request": (e1 - e0) * 1000 / k,
                                "wall_s": elapsed})
            print(f"{mode:>5} {n:>5} tokens: {len(ok)}/{len(results)} ok, picker "
                  f"{H.fmt(out['rows'][-1]['picker_cpu_ms_per_request'])} ms, envoy "
                  f"{out['rows'][-1]['envoy_cpu_ms_per_request']:.2f} ms CPU per request", flush=True)
    return out


def summarize(doc: dict[str, Any]) -> None:
    by = {m["mode"]: {r["output_tokens"]: r for r in m["rows"]} for m in doc["modes"]}
    s: dict[str, Any] = {}
    for mode in ("lean", "echo"):
        rows = by.get(mode)
        if not rows:
            continue
        c8, c1024 = rows[8]["picker_cpu_ms_per_request"], rows[1024]["picker_cpu_ms_per_request"]
        s[mode] = {"picker_1024_over_8": H.ratio(c1024, c8),
                   "picker_us_per_extra_chunk": (c1024 - c8) * 1000 / (1024 - 8),
                   "max_streamed_tokens_per_s_one_core": 1024 / (c1024 / 1000) if c1024 else None}
    if "lean" in s:
        s["lean_target_met"] = s["lean"]["picker_1024_over_8"] is not None and s["lean"]["picker_1024_over_8"] <= 1.3
    if "lean" in s and "echo" in s:
        s["echo_over_lean_at_1024"] = H.ratio(by["echo"][1024]["picker_cpu_ms_per_request"],
                                              by["lean"][1024]["picker_cpu_ms_per_request"])
    doc["summary"] = s


def report(doc: dict[str, Any]) -> None:
    rows = []
    for m in doc["modes"]:
        for r in m["rows"]:
            rows.append([m["mode"], r["output_tokens"], f"{r['ok']}/{r['requests']}",
                         H.fmt(r["picker_cpu_ms_per_request"]), H.fmt(r["envoy_cpu_ms_per_request"])])
    print(H.table(rows, ["mode", "output tokens", "ok", "picker CPU ms/req", "envoy CPU ms/req"]))
    print(json.dumps(doc["summary"], indent=1))


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for m in doc["modes"]:
        xs = [r["output_tokens"] for r in m["rows"]]
        if m["mode"] != "none":
            ax[0].plot(xs, [r["picker_cpu_ms_per_request"] for r in m["rows"]], marker="o", label=m["mode"])
        ax[1].plot(xs, [r["envoy_cpu_ms_per_request"] for r in m["rows"]], marker="o", label=m["mode"])
    for a, t in zip(ax, ("picker CPU ms / request", "Envoy CPU ms / request"), strict=True):
        a.set_xscale("log")
        a.set_xlabel("streamed output tokens (one SSE chunk each)")
        a.set_title(t)
        a.legend()
    H.save_figure(fig, "Cost per request vs answer length", path)


def main() -> None:
    ap = H.bench_parser(__doc__, NAME)
    ap.add_argument("--decode-ms-per-token", type=float, default=2.0)
    args = ap.parse_args()
    requests, conc = (4, 2) if args.quick else (32, 8)
    decode = 0.2 if args.quick else args.decode_ms_per_token
    doc: dict[str, Any] = {"meta": H.meta(args.quick), "decode_ms_per_token": decode, "requests": requests,
                           "concurrency": conc, "modes": [run_mode(m, requests, conc, decode) for m in MODES]}
    summarize(doc)
    H.publish(doc, args.out, NAME, report, chart)


if __name__ == "__main__":
    main()
