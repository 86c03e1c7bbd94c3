"""Routing quality on the public Mooncake trace, driven by NVIDIA AIPerf (issue 16).

    python -m bench.bench_trace [--quick] [--out DIR] [--only a,c] [--rates 10,17.5,25] [--speedup 2.5]

Nobody here shaped this workload: the Mooncake FAST'25 synthetic trace (`bench/traces/`, 3,993 requests,
multi-turn, 512-token prefix blocks), reduced as `bench/trace_workload.py` says exactly (whole prefix trees
1 in 10, one hash id = 32 mock tokens = one KV block, outputs / 4, timestamps / the load multiplier / the mock
speedup), replayed on its own timestamps by AIPerf (`aiperf profile --custom-dataset-type mooncake_trace
--fixed-schedule`, literal prompts in `text_input`, a locally trained BPE tokenizer, server token counts).

Four `trtllm-mock` workers run the iteration-level timing model (`--scheduler iteration`) calibrated to
TensorRT-LLM's published Llama-3.1-8B FP8 H100 figures (trtllm_mock/README.md), scaled so one mock prompt
token costs what the 16 real tokens it stands for would, with the KV capacity of that GPU (900 blocks of
512 real tokens) and its per-step budget (max_num_tokens 8192 real = 512 mock tokens).

  (a)  Envoy round-robin, no ext_proc (baseline)
  (b)  Envoy + picker, load only (--tokenizer-protocol none)
  (c)  Envoy + picker, trtllm-render + KV events, defaults (overlap credit 2.0)
  (c1) the same with Dynamo's overlap credit 1.0
  (e)  Envoy + picker, trtllm-render, NO KV events: only its own predictions of what it routed where, kept
       for the whole run (the "approximate prefix" routing llm-d compares against)
  (d)  oracle cached-token ratio of the same prompts in arrival order: one LRU cache with the capacity of
       all four workers together (`pooled_lru`), and an infinite cache

Every (config, load) run gets a fresh picker and Envoy and starts from empty worker caches. TTFT, ITL,
output tokens/s and the cached-token ratio are AIPerf's own figures (its usage-based
`overall_usage_prompt_cache_read_pct`); the workers' /mock/stats deltas give which worker served what and
cross-check the cached tokens; the picker's `epp_picks_total` is recorded for the picker configurations.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import trace_workload as T
from trtllm_mock.config import LLAMA_8B_H100

AIPERF = str(H.BIN / "aiperf")
CONFIGS = {"a": "envoy round-robin", "b": "picker, load only", "c": "picker, KV-aware (defaults)",
           "c1": "picker, KV-aware, overlap credit 1.0", "e": "picker, prediction only (no KV events)"}
BS = 32


@dataclass
class Plan:
    scale: T.TraceScale = field(default_factory=T.TraceScale)
    rates: tuple[float, ...] = (10.0, 17.5, 25.0)  # offered loads, req/s of simulated time
    speedup: float = 2.5
    workers: int = 4
    num_blocks: int = 900  # H100 80GB, Llama-3.1-8B, BF16 KV: ~458k tokens = ~900 blocks of 512
    max_num_tokens: int = 512  # 8192 real tokens (TensorRT-LLM default) / 16
    max_batch_size: int = 2048  # trtllm-serve default; KV capacity binds first
    aiperf_timeout_s: float = 240.0

    def mock_args(self) -> list[str]:
        k = self.scale.length_divisor
        c = LLAMA_8B_H100
        return ["--scheduler", "iteration", "--speedup", str(self.speedup), "--num-blocks", str(self.num_blocks),
                "--max-num-tokens", str(self.max_num_tokens), "--max-batch-size", str(self.max_batch_size),
                "--step-base-ms", str(c["step_base_ms"]),
                "--step-prefill-ms-per-token", f"{c['step_prefill_ms_per_token'] * k:.6g}",
                "--step-decode-ms-per-token", str(c["step_decode_ms_per_token"]),
                "--step-kv-read-ms-per-token", f"{c['step_kv_read_ms_per_token'] * k:.6g}",
                "--max-seq-len", "1000000", "--heartbeat-interval", "1"]


QUICK = Plan(scale=T.TraceScale(max_requests=24), rates=(40.0,), speedup=4.0, aiperf_timeout_s=60.0)


# ----------------------------------------------------------------------------- AIPerf
def aiperf_command(url: str, input_file: Path, tokenizer: Path, artifacts: Path, timeout_s: float) -> list[str]:
    """The AIPerf invocation a user would run against their own gateway (only --url changes)."""
    return [AIPERF, "profile", "--model", "mock-model", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--input-file", str(input_file), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--fixed-schedule-auto-offset", "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--request-timeout-seconds", str(int(timeout_s)), "--random-seed", "1",
            "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--workers-max", "4", "--record-processors", "1"]


def run_aiperf(cmd: list[str], timeout_s: float, log: Path) -> None:
    """Run AIPerf in its own process group, so a hang is ended with everything it spawned."""
    with log.open("wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
        try:
            rc = p.wait(timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    if rc != 0:
        raise RuntimeError(f"aiperf exited {rc}:\n{log.read_text()[-3000:]}")


def aiperf_figures(artifacts: Path) -> dict[str, Any]:
    doc = json.loads((artifacts / "profile_export_aiperf.json").read_text())

    def q(metric: str, *keys: str) -> dict[str, float | None]:
        m = doc.get(metric) or {}
        return {k: m.get(k) for k in keys}

    ttft = q("time_to_first_token", "p50", "p90", "p99", "avg")
    itl = q("inter_token_latency", "p50", "p90", "p99", "avg")
    out = {f"ttft_{k}_ms": v for k, v in ttft.items()}
    out.update({f"itl_{k}_ms": v for k, v in itl.items()})
    out["output_tokens_per_s"] = (doc.get("output_token_throughput") or {}).get("avg")
    out["requests"] = int((doc.get("request_count") or {}).get("avg") or 0)
    errs = doc.get("error_summary") or []
    out["errors"] = int(sum(e.get("count", 0) for e in errs)) if isinstance(errs, list) else 0
    out["aiperf_cached_ratio"] = ((doc.get("overall_usage_prompt_cache_read_pct") or {}).get("avg") or 0.0) / 100
    out["aiperf_prompt_tokens"] = (doc.get("total_usage_prompt_tokens") or {}).get("avg")
    out["replay_sched_lag_p99_ms"] = (doc.get("replay_sched_lag_p99") or {}).get("avg")
    out["benchmark_duration_s"] = (doc.get("benchmark_duration") or {}).get("avg")
    return out


# ----------------------------------------------------------------------------- one run
def stats(workers: list[H.Proc]) -> dict[str, dict[str, Any]]:
    return {m.name: H.get_json(m.url + "/mock/stats") for m in workers}


def wait_idle(workers: list[H.Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats(workers).values()):
            return
        time.sleep(0.2)


_PICKS = re.compile(r'^epp_picks_total\{endpoint="([^"]+)"[^}]*\} (\S+)$', re.M)


def picker_picks(pk: H.Proc) -> dict[str, int]:
    return {ep: int(float(v)) for ep, v in _PICKS.findall(H.get_text(H.picker_url(pk) + "/metrics"))}


def start_config(st: H.Stack, cfg: str, workers: list[H.Proc], renderer: H.Proc) -> tuple[H.Proc, H.Proc | None]:
    addrs = [m.address for m in workers]
    if cfg == "a":
        return H.envoy(st, upstreams=addrs), None
    if cfg == "b":
        pk = H.picker(st, H.endpoints_spec(workers))
    elif cfg in ("c", "c1"):
        extra = ["--kv-overlap-score-credit", "1"] if cfg == "c1" else []
        pk = H.picker(st, H.endpoints_spec(workers), "trtllm-render", renderer, extra=extra)
        H.wait_subscribed(pk, addrs)
    else:  # (e): no KV endpoint given and no default port, predictions kept for the whole run
        spec = ",".join(f"{m.name}={m.address}" for m in workers)
        pk = H.picker(st, spec, "trtllm-render", renderer,
                      extra=["--kv-event-port", "0", "--prediction-ttl-s", "100000"])
    return H.envoy(st, picker_proc=pk), pk


def run_one(cfg: str, divisor: float, plan: Plan, workers: list[H.Proc], renderer: H.Proc, input_file: Path,
            tokenizer: Path, work: Path) -> dict[str, Any]:
    wait_idle(workers)
    for m in workers:
        H.post_json(m.url + "/mock/cache/clear")
    before = stats(workers)
    with H.Stack(prefix=f"epp-trace-{cfg}-") as st:
        env, pk = start_config(st, cfg, workers, renderer)
        art = work / f"aiperf-{cfg}-{divisor:g}"
        shutil.rmtree(art, ignore_errors=True)
        t0 = time.monotonic()
        run_aiperf(aiperf_command(env.url, input_file, tokenizer, art, plan.aiperf_timeout_s),
                   plan.aiperf_timeout_s + 120, work / f"aiperf-{cfg}-{divisor:g}.log")
        wall = time.monotonic() - t0
        wait_idle(workers)
        after = stats(workers)
        picks = picker_picks(pk) if pk is not None else None
    served = {k: after[k]["requests_served"] - before[k]["requests_served"] for k in after}
    dp = sum(after[k]["prompt_tokens_total"] - before[k]["prompt_tokens_total"] for k in after)
    dc = sum(after[k]["cached_tokens_total"] - before[k]["cached_tokens_total"] for k in after)
    row = {"config": cfg, "divisor": divisor, **aiperf_figures(art), "per_worker_served": served,
           "workers_cached_ratio": dc / dp if dp else 0.0, "workers_prompt_tokens": dp, "picker_picks": picks,
           "aiperf_wall_s": round(wall, 1), "loadavg_1m": os.getloadavg()[0]}
    return row


def run(plan: Plan, configs: list[str], work: Path) -> dict[str, Any]:
    rows_all = T.load(T.find_trace())
    rows = T.sample(rows_all, plan.scale)
    prompts = [T.prompt_ids(T.prompt_text(r, plan.scale)) for r in rows]
    orc = T.oracle(prompts, workers=plan.workers, capacity=plan.num_blocks, bs=BS)
    tok = T.build_tokenizer(work / "tokenizer")
    base_rate = T.offered_rate(rows, 1.0)
    out_rows: list[dict[str, Any]] = []
    with H.Stack(prefix="epp-trace-") as outer:
        workers = [H.mock_worker(outer, f"worker-{i}", plan.mock_args()) for i in range(plan.workers)]
        renderer = H.mock_renderer(outer)
        for rate in plan.rates:
            d = rate / base_rate  # the trace replayed d times faster than recorded
            f = T.write_aiperf_input(rows, plan.scale, d * plan.speedup, work / f"trace-{rate:g}rps.jsonl")
            for cfg in configs:
                row = run_one(cfg, d, plan, workers, renderer, f, tok, work)
                row["offered_rps"] = rate
                out_rows.append(row)
                print(f"  ({cfg:>2}) {rate:g} req/s (trace x{d:.1f}): TTFT p50/p90/p99 "
                      f"{H.fmt(row['ttft_p50_ms'], '.0f')}/{H.fmt(row['ttft_p90_ms'], '.0f')}/"
                      f"{H.fmt(row['ttft_p99_ms'], '.0f')} ms, ITL p50/p90 {H.fmt(row['itl_p50_ms'], '.1f')}/"
                      f"{H.fmt(row['itl_p90_ms'], '.1f')} ms, {H.fmt(row['output_tokens_per_s'], '.0f')} out tok/s, "
                      f"cached {row['aiperf_cached_ratio']:.3f} (workers {row['workers_cached_ratio']:.3f}), "
                      f"errors {row['errors']}, served {row['per_worker_served']}, {row['aiperf_wall_s']}s",
                      flush=True)
    return {"rows": out_rows, "oracle": orc, "requests": len(rows), "trace_requests": len(rows_all),
            "trace_rate_rps": base_rate, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(T.output_tokens(r, plan.scale) for r in rows)}


# ----------------------------------------------------------------------------- report
def _row(doc: dict[str, Any], cfg: str, d: float) -> dict[str, Any] | None:
    return next((r for r in doc["result"]["rows"] if r["config"] == cfg and r["divisor"] == d), None)


def with_ratios(doc: dict[str, Any]) -> None:
    """Each row against (a) at the same load: TTFT/ITL as a/x (>1 = better than round-robin), tokens/s x/a."""
    for r in doc["result"]["rows"]:
        a = _row(doc, "a", r["divisor"])
        if a is None:
            continue
        r["vs_a"] = {"ttft_p50": H.ratio(a["ttft_p50_ms"], r["ttft_p50_ms"]),
                     "ttft_p90": H.ratio(a["ttft_p90_ms"], r["ttft_p90_ms"]),
                     "ttft_p99": H.ratio(a["ttft_p99_ms"], r["ttft_p99_ms"]),
                     "itl_p50": H.ratio(a["itl_p50_ms"], r["itl_p50_ms"]),
                     "itl_p90": H.ratio(a["itl_p90_ms"], r["itl_p90_ms"]),
                     "output_tokens_per_s": H.ratio(r["output_tokens_per_s"], a["output_tokens_per_s"]),
                     "cached_ratio": H.ratio(r["aiperf_cached_ratio"], a["aiperf_cached_ratio"])}


def saturating_divisor(doc: dict[str, Any]) -> float:
    """The first load at which round-robin's TTFT p90 is 3x its value at the lowest load (else the top one):
    where (a) has saturated, the load the issue's TTFT targets are judged at."""
    a = sorted((r for r in doc["result"]["rows"] if r["config"] == "a"), key=lambda r: r["divisor"])
    if not a:
        return max(r["divisor"] for r in doc["result"]["rows"])
    floor = a[0]["ttft_p90_ms"] or 0.0
    return next((r["divisor"] for r in a if (r["ttft_p90_ms"] or 0.0) >= 3 * floor), a[-1]["divisor"])


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc["result"]["rows"]
    sat = saturating_divisor(doc)
    bound = doc["result"]["oracle"]["pooled_lru"]
    out: dict[str, Any] = {}
    for other, factor in (("a", 5.0), ("e", 2.0)):
        per = []
        for d in sorted({r["divisor"] for r in rows}):
            x, c = _row(doc, other, d), _row(doc, "c", d)
            if x and c:
                g = H.ratio(x["ttft_p90_ms"], c["ttft_p90_ms"])
                per.append({"divisor": d, f"{other}_ms": x["ttft_p90_ms"], "c_ms": c["ttft_p90_ms"], "ratio": g,
                            "met": g is not None and g >= factor})
        at = next((p for p in per if p["divisor"] == sat), None)
        if at is not None:
            out[f"c_ttft_p90_{factor:g}x_below_{other}_at_saturation"] = {"saturating_divisor": sat, **at,
                                                                        "per_load": per}
    per = [{"divisor": r["divisor"], "c": r["aiperf_cached_ratio"], "oracle_pooled_lru": bound,
            "c_over_oracle": H.ratio(r["aiperf_cached_ratio"], bound)} for r in rows if r["config"] == "c"]
    if per:
        out["c_cached_within_5pct_of_oracle"] = {"per_load": per, "met": all((p["c_over_oracle"] or 0) >= 0.95
                                                                              for p in per)}
    wins = []
    for r in rows:
        c_r = _row(doc, "c", r["divisor"]) if r["config"] == "c1" else None
        if c_r is None:
            continue
        for m in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"):
            if r[m] is not None and c_r[m] is not None and r[m] < c_r[m]:
                wins.append({"divisor": r["divisor"], "metric": m, "c1": r[m], "c": c_r[m]})
        if r["aiperf_cached_ratio"] > c_r["aiperf_cached_ratio"]:
            wins.append({"divisor": r["divisor"], "metric": "cached_ratio", "c1": r["aiperf_cached_ratio"],
                         "c": c_r["aiperf_cached_ratio"]})
    if any(r["config"] == "c1" for r in rows):
        out["c1_beats_c"] = {"where": wins, "any": bool(wins)}
    return out


def print_report(doc: dict[str, Any]) -> None:
    res = doc["result"]
    print(f"\nMooncake trace, {res['requests']} of {res['trace_requests']} requests, {res['prompt_tokens']} prompt "
          f"tokens (mock), (d) oracle cached ratio: pooled LRU {res['oracle']['pooled_lru']:.3f}, infinite "
          f"{res['oracle']['infinite']:.3f}. Ratios are against (a) at the same load (TTFT/ITL a/x).")
    print(H.table([[r["config"], f"{r['offered_rps']:.1f}", r["requests"], r["errors"], r["ttft_p50_ms"],
                    r["ttft_p90_ms"], r["ttft_p99_ms"], (r.get("vs_a") or {}).get("ttft_p90"), r["itl_p50_ms"],
                    r["itl_p90_ms"], (r.get("vs_a") or {}).get("itl_p50"), r["output_tokens_per_s"],
                    (r.get("vs_a") or {}).get("output_tokens_per_s"), r["aiperf_cached_ratio"],
                    r["workers_cached_ratio"]] for r in res["rows"]],
                  ["cfg", "req/s", "reqs", "err", "TTFT p50", "p90", "p99", "a/x p90", "ITL p50", "p90",
                   "a/x ITL", "out tok/s", "x/a", "cached", "(workers)"]))
    print("\nTargets")
    for k, v in doc["targets"].items():
        print(f"  {k}: {json.dumps(v)}")


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["result"]["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    H.plot_by_config(axes, rows, doc["configs"], "offered_rps",
                     (lambda r: r["ttft_p90_ms"], lambda r: r["itl_p50_ms"], lambda r: r["aiperf_cached_ratio"],
                      lambda r: r["output_tokens_per_s"]))
    orc = doc["result"]["oracle"]
    axes[2].axhline(orc["pooled_lru"], color="k", ls="--", label="(d) oracle, pooled LRU of real capacity")
    axes[2].axhline(orc["infinite"], color="k", ls=":", label="(d) infinite cache")
    axes[0].set_yscale("log")
    H.label_axes(axes, ("TTFT p90 (ms, log)", "ITL p50 (ms)", "cached-token ratio", "output tokens/s"),
                 "offered load (req/s of simulated time)")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    H.save_figure(fig, "Mooncake trace via AIPerf on 4 iteration-scheduled mock workers", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "trace")
    ap.add_argument("--only", help="comma-separated subset of configurations (a,b,c,c1,e)")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s of simulated time)")
    ap.add_argument("--speedup", type=float, help="mock speedup (wall-clock compression)")
    ap.add_argument("--work", help="directory for AIPerf inputs, artifacts and logs (default: a temp dir)")
    a = ap.parse_args(argv)
    plan = QUICK if a.quick else Plan()
    configs = ["c"] if a.quick else list(CONFIGS)  # --quick: does it run at all
    if a.only:
        configs = [k for k in CONFIGS if k in a.only.split(",")]
    if a.rates:
        plan.rates = tuple(float(x) for x in a.rates.split(","))
    if a.speedup:
        plan.speedup = a.speedup
    import tempfile

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="epp-trace-work-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"trace: Mooncake via AIPerf, configs {configs}, loads {plan.rates} req/s, work dir {work}", flush=True)
    load_before = os.getloadavg()
    result = run(plan, configs, work)
    result["loadavg_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    doc = {"bench": "trace", **H.meta(a.quick), "configs": {k: CONFIGS[k] for k in configs},
           "plan": {**asdict(plan), "scale": plan.scale.describe()}, "mock_args": plan.mock_args(),
           "aiperf_command": aiperf_command("http://<gateway>", Path("<trace.jsonl>"), Path("<tokenizer dir>"),
                                            Path("<artifacts>"), plan.aiperf_timeout_s)[1:],
           "result": result}
    with_ratios(doc)
    doc["targets"] = targets(doc)
    return H.publish(doc, a.out, "trace", print_report, chart)


if __name__ == "__main__":
    main()
