"""Disaggregated (P/D) against aggregated pools on the Mooncake trace, driven by NVIDIA AIPerf (issue 30).

    python -m bench.bench_pd [--quick] [--out DIR] [--rates 10,25] [--capacities 75] [--repeats 3]
                             [--speedup 2.5] [--transfer-ms-per-block 1.5] [--prefill-workers 2] [--work DIR]

The workload, its scaling, the mock timing model, the capacities, the repeats (arrival-jitter seeds) and the
claim rule are bench_trace's (`bench/bench_trace.py`, imported, not copied). Two pools of four
iteration-scheduled `trtllm-mock` workers, both behind Envoy and the picker with its KV-aware defaults
(trtllm-render, KV events; bench_trace's configuration (c)):

  (agg) four aggregated workers (role `both`)
  (pd)  two prefill workers and two decode workers, each decode worker behind its own `epp-pd-sidecar
        --engine trtllm`; the picker names the sidecar as the decode endpoint (role `decode`) and subscribes
        to the decode worker's own KV events, as `make run ARGS=--pd` does. The picker chooses the pair and
        the decider (`--pd-min-uncached-tokens`, default) chooses between disaggregation and local prefill.

The same four worker processes serve both pools (roles live in the picker, and any `trtllm-mock` serves
context-only, generation-only and aggregated requests), so the timing model and capacity are identical by
construction; every run starts from empty worker caches with a fresh picker and Envoy. Every worker charges
the KV transfer (`--disagg-transfer-ms-per-block`, only generation-only requests pay it): the default 1.5 ms
per mock block is derived in `TRANSFER_MS_PER_BLOCK`'s comment.

Per run, beside AIPerf's TTFT / ITL p50 / p90 (one AIPerf run gives both): TTFT and ITL per prompt-length
bucket (from AIPerf's per-request records, so where P/D wins and loses is visible inside one run), the
picker's `epp_pd_decisions_total{path,reason}`, the sidecars' `pd_sidecar_requests_total{route,reason}`
delta, the sidecars' own process CPU time (user+system from /proc) per request they handled, and a probe
after the trace: `PROBES` short prompts (below the decider's threshold, unseen before) and `PROBES` long ones,
sequentially, each probe's decision counted from the picker's metrics.

JSON result schema (`pd.json`), besides `bench`, `meta`, `configs`, `plan`, `mock_args`, `aiperf_command`:

    result.requests, prompt_tokens, output_tokens, working_set_blocks, buckets: {name: [lo, hi)}
    result.capacities[]: {name, blocks_per_worker, pool_blocks, working_set_over_pool}
    result.cells[]: {capacity, config, offered_rps, divisor, summary: {metric: spread | null}, runs: [run]}
        run: bench_trace's run figures, plus bucket_{name}_{ttft,itl}_{p50,p90}_ms, bucket_{name}_requests,
             pd_decisions: {"path/reason": n}, sidecar_requests: {"route/reason": n}, sidecar_cpu_s,
             sidecar_cpu_ms_per_request, probe: {short|long: {decisions: {"path/reason": n}, latency_ms_p50}}
    result.claims[]: {capacity, offered_rps, metric, median_ratio, claim}   agg/pd for latencies (> 1 = P/D
        better); claim only when the spreads of the runs do not overlap (bench/trace_stats.claim)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import bench_trace as BT
from bench import harness as H
from bench import trace_stats as S
from bench import trace_workload as T
from epp_extproc.dev import procs

CONFIGS = {"agg": "4 aggregated workers, picker KV-aware (defaults)",
           "pd": "2 prefill + 2 decode (epp-pd-sidecar, trtllm), picker KV-aware (defaults)"}

# KV transfer time per mock block, before the mock's speedup. One mock block is 32 mock tokens = 512 real
# tokens of the Llama-3.1-8B the mock's timing is calibrated to (trtllm_mock/config.py LLAMA_8B_H100; every
# other step cost is scaled the same way, x16 per mock token). Its KV cache per real token: 32 layers x 8 KV
# heads x 128 dims x 2 (K and V) x 2 bytes (BF16, the same KV format bench_trace's `h100` capacity assumes)
# = 128 KiB, so a mock block is 64 MiB. The link: TensorRT-LLM moves KV between device memories over RDMA /
# NVLink through UCX or NIXL (TensorRT-LLM docs/source/blogs/tech_blog/blog05_Disaggregated_Serving_in_TensorRT-
# LLM.md, "Cache Layout Transformation" and "Multi-backend Support", commit 22de8b3); across nodes an H100
# node has one 400 Gb/s ConnectX-7 NIC per GPU (NVIDIA DGX H100 datasheet), i.e. 50 GB/s line rate, and NIXL
# over UCX/RDMA is measured at ~93% of line rate (93.4 Gb/s on a 100 Gb/s RoCE link, a public NIXL multi-rail
# benchmark write-up), so ~46 GB/s: 67.1 MB / 46 GB/s = 1.46 ms, rounded to 1.5 ms per block. That is ~20% of
# the block's prefill time (32 x 0.0142 x 16 = 7.3 ms): a cross-node transfer, not an NVLink one (which would
# be ~10x cheaper), so P/D is not flattered.
TRANSFER_MS_PER_BLOCK = 1.5
# Prompt-length buckets in mock tokens (x16 = real tokens). `short` ends at the decider's default threshold
# (--pd-min-uncached-tokens 16): a prompt that short has an uncached suffix below it wherever it goes, so the
# picker always keeps it local (93 of the 407 sampled requests); `long` is 512 mock tokens (8k real) and up.
PD_MIN_UNCACHED_TOKENS = 16  # the picker's default, not passed: the benchmark runs the defaults
BUCKETS = {"short": (0, PD_MIN_UNCACHED_TOKENS), "mid": (PD_MIN_UNCACHED_TOKENS, 512), "long": (512, 1 << 30)}
PROBES = 10  # short and long probe requests after every run
METRICS = (*BT.METRICS, *(f"bucket_{b}_{m}" for b in BUCKETS
                          for m in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "requests")),
           "sidecar_cpu_ms_per_request")
LOWER_IS_BETTER = ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
                   *(f"bucket_{b}_{m}" for b in BUCKETS for m in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
                                                                   "itl_p90_ms")))
CLAIMED = (*LOWER_IS_BETTER, "output_tokens_per_s")


@dataclass
class PdPlan(BT.Plan):
    """bench_trace's plan (same scaling, timing model, capacities, repeats) with the KV transfer cost."""

    transfer_ms_per_block: float = TRANSFER_MS_PER_BLOCK
    prefill_workers: int = 2
    engine: str = "trtllm"

    def mock_args(self, num_blocks: int) -> list[str]:
        return [*super().mock_args(num_blocks), "--disagg-transfer-ms-per-block", f"{self.transfer_ms_per_block:g}"]


def default_plan() -> PdPlan:
    """The recorded setting: one capacity (75: where caching matters and eviction happens), a light and a
    saturating load; what fits ~15 minutes on the shared 2-core machine."""
    return PdPlan(rates=(10.0, 25.0), capacities=("75",), repeats=3)


def quick_plan() -> PdPlan:
    """--quick: does it run at all (one seed, 24 requests, both pools): about a minute."""
    return PdPlan(scale=T.TraceScale(max_requests=24), rates=(40.0,), capacities=("scarce",), repeats=1,
                  speedup=4.0, aiperf_timeout_s=60.0)


# ----------------------------------------------------------------------------- metrics text
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def labelled(text: str, name: str, keys: Sequence[str]) -> dict[str, float]:
    """``{"v1/v2": value}`` for every sample of counter ``name`` in a Prometheus text, by the labels ``keys``."""
    out: dict[str, float] = {}
    for metric, labels, value in _SAMPLE.findall(text):
        if metric != name:
            continue
        ls = dict(_LABEL.findall(labels))
        k = "/".join(ls.get(x, "") for x in keys)
        out[k] = out.get(k, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def pd_decisions(pk: H.Proc) -> dict[str, float]:
    return labelled(H.get_text(H.picker_url(pk) + "/metrics"), "epp_pd_decisions_total", ("path", "reason"))


def sidecar_requests(sidecars: Sequence[H.Proc]) -> dict[str, float]:
    out: dict[str, float] = {}
    for sc in sidecars:
        for k, v in labelled(H.get_text(sc.url + "/metrics"), "pd_sidecar_requests_total",
                             ("route", "reason")).items():
            out[k] = out.get(k, 0.0) + v
    return out


# ----------------------------------------------------------------------------- per-request figures
def _value(metrics: dict[str, Any], name: str) -> Any:
    v = metrics.get(name)
    return v.get("value") if isinstance(v, dict) else v


def records(artifacts: Path) -> list[dict[str, Any]]:
    """AIPerf's per-request records (``profile_export.jsonl``): prompt tokens, TTFT and ITL of each."""
    path = artifacts / "profile_export.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        m = json.loads(line).get("metrics") or {}
        isl = _value(m, "input_sequence_length")
        if isl is None:
            isl = _value(m, "usage_prompt_tokens")
        out.append({"isl": isl, "ttft": _value(m, "time_to_first_token"), "itl": _value(m, "inter_token_latency")})
    return out


def by_bucket(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per prompt-length bucket: how many requests, and their TTFT / ITL p50 and p90 (ms)."""
    out: dict[str, Any] = {}
    for name, (lo, hi) in BUCKETS.items():
        rs = [r for r in recs if r["isl"] is not None and lo <= r["isl"] < hi]
        out[f"bucket_{name}_requests"] = len(rs)
        for m in ("ttft", "itl"):
            xs = [r[m] for r in rs if r[m] is not None]
            out[f"bucket_{name}_{m}_p50_ms"] = H.pct(xs, 0.5)
            out[f"bucket_{name}_{m}_p90_ms"] = H.pct(xs, 0.9)
    return out


# ----------------------------------------------------------------------------- the pools
@dataclass
class Pool:
    """The processes of one capacity: four workers, the renderer and a sidecar per decode worker."""

    workers: list[H.Proc]
    renderer: H.Proc
    sidecars: list[H.Proc]
    prefill: int

    def pd_spec(self) -> str:
        """The picker's --endpoints for the P/D pool: prefill workers as they are, decode workers by their
        sidecar's address with the worker's own KV events (what `make run ARGS=--pd` names)."""
        eps = []
        for w in self.workers[: self.prefill]:
            eps.append(f"{w.name}={w.address};kv=tcp://127.0.0.1:{w.extra['kv_port']};role=prefill")
        for w, sc in zip(self.workers[self.prefill:], self.sidecars, strict=True):
            eps.append(f"{w.name}={sc.address};kv=tcp://127.0.0.1:{w.extra['kv_port']};role=decode")
        return ",".join(eps)

    def pd_addresses(self) -> list[str]:
        return [w.address for w in self.workers[: self.prefill]] + [sc.address for sc in self.sidecars]


def start_pool(st: H.Stack, plan: PdPlan, blocks: int) -> Pool:
    workers = [H.mock_worker(st, f"worker-{i}", plan.mock_args(blocks)) for i in range(plan.workers)]
    renderer = H.mock_renderer(st)
    prefillers = [w.address for w in workers[: plan.prefill_workers]]
    sidecars = [st.add(procs.pd_sidecar(st.dir, decode_url=w.url, allowed_prefillers=prefillers, engine=plan.engine,
                                        name=f"sidecar-{i}", args=["--log-level", "WARNING"]))
                for i, w in enumerate(workers[plan.prefill_workers:])]
    return Pool(workers, renderer, sidecars, plan.prefill_workers)


def start_picker(st: H.Stack, cfg: str, pool: Pool) -> H.Proc:
    """(agg) is bench_trace's (c) on all four workers; (pd) the same picker flags over the roles."""
    if cfg == "agg":
        pk = H.picker(st, H.endpoints_spec(pool.workers), "trtllm-render", pool.renderer)
        H.wait_subscribed(pk, [w.address for w in pool.workers])
    else:
        pk = H.picker(st, pool.pd_spec(), "trtllm-render", pool.renderer)
        H.wait_subscribed(pk, pool.pd_addresses())
    return pk


# ----------------------------------------------------------------------------- the probe
def _chat(url: str, text: str) -> float:
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": text}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return (time.perf_counter() - t0) * 1000


def probe(env: H.Proc, pk: H.Proc, tag: str) -> dict[str, Any]:
    """Short prompts (a few tokens, never seen: their whole suffix is uncached but below the decider's
    threshold) and long ones (~200 mock tokens, never seen), one at a time on the idle pool: the decisions
    each kind got, from the picker's counter, and their median end-to-end latency."""
    out: dict[str, Any] = {}
    for kind in ("short", "long"):
        before = pd_decisions(pk)
        lat = []
        for i in range(PROBES):
            text = f"probe {tag} {i}" if kind == "short" else " ".join(f"w{tag}x{i}y{j}" for j in range(100))
            lat.append(_chat(env.url, text))
        out[kind] = {"decisions": delta(pd_decisions(pk), before), "latency_ms_p50": statistics.median(lat)}
    return out


# ----------------------------------------------------------------------------- one run
def run_one(cfg: str, divisor: float, plan: PdPlan, pool: Pool, input_file: Path, tokenizer: Path, work: Path,
            tag: str) -> dict[str, Any]:
    """One AIPerf replay through one pool from empty caches, then the probe."""
    BT.wait_idle(pool.workers)
    for m in pool.workers:
        H.post_json(m.url + "/mock/cache/clear")
    before = BT.stats(pool.workers)
    sc_before = sidecar_requests(pool.sidecars)
    cpu_before = sum(sc.cpu_seconds() for sc in pool.sidecars)
    with H.Stack(prefix=f"epp-pd-{cfg}-") as st:
        pk = start_picker(st, cfg, pool)
        env = H.envoy(st, picker_proc=pk)
        art = work / f"aiperf-{tag}"
        shutil.rmtree(art, ignore_errors=True)
        t0 = time.monotonic()
        BT.run_aiperf(BT.aiperf_command(env.url, input_file, tokenizer, art, plan.aiperf_timeout_s),
                      plan.aiperf_timeout_s + 120, work / f"aiperf-{tag}.log")
        wall = time.monotonic() - t0
        BT.wait_idle(pool.workers)
        after = BT.stats(pool.workers)
        cpu = sum(sc.cpu_seconds() for sc in pool.sidecars) - cpu_before
        sc_delta = delta(sidecar_requests(pool.sidecars), sc_before)
        decisions = {k: int(v) for k, v in pd_decisions(pk).items()}
        picks = BT.picker_picks(pk)
        pr = probe(env, pk, tag.replace("-", "").replace(".", ""))
    served = {k: after[k]["requests_served"] - before[k]["requests_served"] for k in after}
    # per inference request of the trace (every one passes a sidecar in the P/D pool: the decode worker is
    # always the destination); the sidecars' own counter also counts the picker's metric scrapes they proxy
    n = sum(decisions.values())
    row = {"config": cfg, "divisor": divisor, **BT.aiperf_figures(art), **by_bucket(records(art)),
           "per_worker_served": served, "picker_picks": picks, "pd_decisions": decisions,
           "sidecar_requests": sc_delta, "sidecar_cpu_s": round(cpu, 3),
           "sidecar_cpu_ms_per_request": cpu * 1000 / n if n and pool.sidecars and cfg == "pd" else None, "probe": pr,
           "aiperf_wall_s": round(wall, 1), "loadavg_1m": os.getloadavg()[0]}
    return row


def print_run(cap: str, r: dict[str, Any]) -> None:
    print(f"  [{cap}] ({r['config']:>3}) {r['offered_rps']:g} req/s seed {r['seed']}: TTFT p50/p90 "
          f"{H.fmt(r['ttft_p50_ms'], '.0f')}/{H.fmt(r['ttft_p90_ms'], '.0f')} ms, ITL p50/p90 "
          f"{H.fmt(r['itl_p50_ms'], '.1f')}/{H.fmt(r['itl_p90_ms'], '.1f')} ms, cached {r['aiperf_cached_ratio']:.3f}, "
          f"errors {r['errors']}, decisions {r['pd_decisions']}, sidecar CPU "
          f"{H.fmt(r['sidecar_cpu_ms_per_request'], '.2f')} ms/req, probe {json.dumps(r['probe'])}, "
          f"load {r['loadavg_1m']:.1f}, {r['aiperf_wall_s']}s", flush=True)


def run(plan: PdPlan, configs: Sequence[str], work: Path) -> dict[str, Any]:
    wl = BT.workload(plan)
    T.build_tokenizer(work / "tokenizer")
    base_rate = T.offered_rate(wl.rows, 1.0)
    caps, runs = [], []
    for cap in plan.capacities:
        blocks = BT.capacity_blocks(cap, wl.working_set, plan.workers, wl.largest_request)
        pool_blocks = blocks * plan.workers
        caps.append({"name": cap, "blocks_per_worker": blocks, "pool_blocks": pool_blocks,
                     "working_set_over_pool": wl.working_set / pool_blocks})
        print(f"capacity {cap}: {blocks} blocks per worker", flush=True)
        with H.Stack(prefix=f"epp-pd-{cap}-") as outer:
            pool = start_pool(outer, plan, blocks)
            for rate in plan.rates:
                d = rate / base_rate
                for seed in range(plan.repeats):
                    rows = T.jitter(wl.rows, seed, wl.jitter_ms)
                    tag = f"{cap}-{rate:g}rps-s{seed}"
                    f = T.write_aiperf_input(rows, plan.scale, d * plan.speedup, work / f"trace-{tag}.jsonl")
                    for cfg in configs:
                        row = run_one(cfg, d, plan, pool, f, work / "tokenizer", work, f"{cfg}-{tag}")
                        row.update(capacity=cap, offered_rps=rate, seed=seed)
                        runs.append(row)
                        print_run(cap, row)
    lengths = [len(p) for p in wl.prompts]
    return {"capacities": caps, "cells": cells(runs), "requests": len(wl.rows), "trace_requests": wl.trace_requests,
            "prompt_tokens": sum(lengths), "output_tokens": sum(wl.outputs), "working_set_blocks": wl.working_set,
            "buckets": {k: list(v) for k, v in BUCKETS.items()},
            "requests_per_bucket": {k: sum(lo <= n < hi for n in lengths) for k, (lo, hi) in BUCKETS.items()}}


def cells(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """bench_trace's grouping, summarised over this benchmark's metrics."""
    return BT.cells(runs, METRICS)


def claims(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """(pd) against (agg) in every (capacity, load) on every claimed metric, oriented so > 1 = P/D better."""
    out = []
    cs = doc["result"]["cells"]
    for pd in (c for c in cs if c["config"] == "pd"):
        agg = next((c for c in cs if c["config"] == "agg" and c["capacity"] == pd["capacity"]
                    and c["offered_rps"] == pd["offered_rps"]), None)
        if agg is None:
            continue
        for m in CLAIMED:
            xs, bs = [r.get(m) for r in pd["runs"]], [r.get(m) for r in agg["runs"]]
            num, den = (bs, xs) if m in LOWER_IS_BETTER else (xs, bs)
            sn, sd = S.spread(num), S.spread(den)
            out.append({"capacity": pd["capacity"], "offered_rps": pd["offered_rps"], "metric": m,
                        "median_ratio": H.ratio(sn.median if sn else None, sd.median if sd else None),
                        "claim": S.claim(num, den)})
    return out


# ----------------------------------------------------------------------------- report
def _ratio(doc: dict[str, Any], c: dict[str, Any], metric: str) -> str:
    k = next((k for k in doc["claims"] if (k["capacity"], k["offered_rps"], k["metric"]) ==
              (c["capacity"], c["offered_rps"], metric)), None)
    if k is None or k["median_ratio"] is None:
        return "-"
    return f"{k['claim']:.2f}" if k["claim"] is not None else f"({k['median_ratio']:.2f})"


def _sum_runs(cell: dict[str, Any], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in cell["runs"]:
        for k, v in (r.get(key) or {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def print_report(doc: dict[str, Any]) -> None:
    res = doc["result"]
    print(f"\nMooncake trace, {res['requests']} requests ({res['requests_per_bucket']} by prompt bucket, mock "
          f"tokens {res['buckets']}), KV transfer {doc['plan']['transfer_ms_per_block']} ms/block. Each cell: "
          f"median [min..max] over {doc['plan']['repeats']} jitter seeds; agg/pd ratio > 1 = P/D better, bare = "
          "claim (spreads disjoint), in brackets = medians only (no claim).")
    rows = []
    for c in (c for c in res["cells"] if c["config"] == "pd"):
        sm = c["summary"]
        agg = next((a for a in res["cells"] if a["config"] == "agg" and a["capacity"] == c["capacity"]
                    and a["offered_rps"] == c["offered_rps"]), None)
        for m in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms",
                  *(f"bucket_{b}_{x}" for b in BUCKETS for x in ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms"))):
            rows.append([c["capacity"], f"{c['offered_rps']:g}", m,
                         S.fmt_spread(agg["summary"][m] if agg else None, ".1f"), S.fmt_spread(sm[m], ".1f"),
                         _ratio(doc, c, m)])
    print(H.table(rows, ["capacity", "req/s", "metric", "agg", "pd", "agg/pd"]))
    print("\nDecisions and sidecars (summed over seeds):")
    for c in res["cells"]:
        cpu = c["summary"].get("sidecar_cpu_ms_per_request")
        probes = {k: _sum_runs({"runs": [r["probe"][k] for r in c["runs"]]}, "decisions") for k in ("short", "long")}
        print(f"  [{c['capacity']}] {c['offered_rps']:g} req/s ({c['config']}): picker {_sum_runs(c, 'pd_decisions')}"
              f"; sidecars {_sum_runs(c, 'sidecar_requests')}; sidecar CPU {S.fmt_spread(cpu, '.2f')} ms/request; "
              f"probe decisions {probes}; errors {sum(r['errors'] for r in c['runs'])}; load "
              f"{[round(r['loadavg_1m'], 1) for r in c['runs']]}")


def chart(doc: dict[str, Any], path: Path) -> None:
    """TTFT p50/p90 and ITL p90 medians per configuration against load: overall and per prompt bucket."""
    plt = H.pyplot()
    caps = doc["result"]["capacities"]
    panels = [("ttft_p50_ms", "TTFT p50"), ("ttft_p90_ms", "TTFT p90"), ("itl_p90_ms", "ITL p90"),
              *((f"bucket_{b}_ttft_p50_ms", f"TTFT p50, {b} prompts") for b in BUCKETS)]
    fig, grid = plt.subplots(len(caps), len(panels), figsize=(4 * len(panels), 4.2 * len(caps)), squeeze=False)
    for axes, info in zip(grid, caps, strict=True):
        rows = [{"config": c["config"], "offered_rps": c["offered_rps"],
                 **{m: (c["summary"][m] or {}).get("median") for m, _ in panels}}
                for c in doc["result"]["cells"] if c["capacity"] == info["name"]]
        H.plot_by_config(axes, rows, doc["configs"], "offered_rps",
                         [(lambda r, m=m: r[m]) for m, _ in panels])
        H.label_axes(axes, [f"[{info['name']}] {t} (ms)" for _, t in panels], "offered load (req/s of simulated time)")
        axes[0].legend(fontsize=7)
    H.save_figure(fig, "Mooncake trace: P/D (2 prefill + 2 decode, sidecars) vs 4 aggregated, picker KV-aware", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "pd")
    ap.add_argument("--only", help="comma-separated subset of configurations (agg,pd)")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s of simulated time; default 10,25)")
    ap.add_argument("--speedup", type=float, help="mock speedup (wall-clock compression)")
    ap.add_argument("--repeats", type=int, help="runs per cell, one per arrival-jitter seed (default 3, quick 2)")
    ap.add_argument("--capacities", help=f"comma-separated KV capacities per worker ({','.join(BT.CAPACITIES)}; "
                                         "default 75)")
    ap.add_argument("--transfer-ms-per-block", type=float, help=f"KV transfer per mock block, before the "
                                                                 f"speedup (default {TRANSFER_MS_PER_BLOCK})")
    ap.add_argument("--prefill-workers", type=int, help="how many of the four workers are prefill workers in (pd) "
                                                         "(default 2: the issue's 2 + 2; 3 = a 3:1 split)")
    ap.add_argument("--work", help="directory for AIPerf inputs, artifacts and logs (default: a temp dir)")
    a = ap.parse_args(argv)
    plan = quick_plan() if a.quick else default_plan()
    configs = [k for k in CONFIGS if not a.only or k in a.only.split(",")]
    if a.rates:
        plan.rates = tuple(float(x) for x in a.rates.split(","))
    if a.speedup:
        plan.speedup = a.speedup
    if a.repeats:
        plan.repeats = a.repeats
    if a.capacities:
        plan.capacities = BT.parse_capacities(a.capacities)
    if a.prefill_workers is not None:
        if not 1 <= a.prefill_workers < plan.workers:
            raise SystemExit(f"--prefill-workers must be 1..{plan.workers - 1}")
        plan.prefill_workers = a.prefill_workers
        CONFIGS["pd"] = (f"{a.prefill_workers} prefill + {plan.workers - a.prefill_workers} decode (epp-pd-sidecar, "
                         "trtllm), picker KV-aware (defaults)")
    if a.transfer_ms_per_block is not None:
        plan.transfer_ms_per_block = a.transfer_ms_per_block
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="epp-pd-work-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"pd: Mooncake via AIPerf, configs {configs}, loads {plan.rates} req/s, capacities {plan.capacities}, "
          f"{plan.repeats} repeats, transfer {plan.transfer_ms_per_block} ms/block, work dir {work}", flush=True)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    result = run(plan, configs, work)
    result["loadavg_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    result["wall_s"] = round(time.monotonic() - t0, 1)
    doc = {"bench": "pd", **H.meta(a.quick), "configs": {k: CONFIGS[k] for k in configs},
           "plan": {**asdict(plan), "scale": plan.scale.describe()}, "mock_args": BT.mock_args_template(plan),
           "aiperf_command": BT.aiperf_command("http://<gateway>", Path("<trace.jsonl>"), Path("<tokenizer dir>"),
                                               Path("<artifacts>"), plan.aiperf_timeout_s)[1:],
           "result": result}
    doc["claims"] = claims(doc)
    return H.publish(doc, a.out, "pd", print_report, chart)


if __name__ == "__main__":
    main()
