"""Routing quality on a workload with prefixes to reuse (issue 7 section 2).

    python -m bench.bench_routing [--quick] [--out DIR]

A shared-prefix workload in the style of llm-d's capacity benchmark, scaled to the mock: G groups that each
share a long system prompt, several users per group asking different questions, multi-turn follow-ups (a
follow-up carries the conversation so far and leaves only after the previous answer arrived), Poisson
arrivals at several rates up to and past saturation. Four `trtllm-mock` worker processes with a 70B-like
timing model (0.5 ms per UNCACHED prompt token, 30 ms per output token, so prefilling a cold 2k-token prompt
costs ~4x the whole 8-token answer) and a KV capacity that holds only a few groups per worker.

  (a) Envoy round-robin, no ext_proc (baseline)
  (b) Envoy + picker, load only (--tokenizer-protocol none)
  (c) Envoy + picker, trtllm-render + KV-aware scoring
  (c1) the same with Dynamo's default DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT=1 (full runs only): at the
      saturating rate credit 1 is bistable (cached ratio 0.41-0.88 across repeated runs) where the picker's
      default of 2 held 0.84-0.90
  (d) oracle bound on the cached-token ratio, computed from the very prompts (c) sent, in send order:
      `infinite` = one cache holding every earlier prompt (no placement can reuse more);
      `affinity_lru` = every group pinned to one worker, each worker an LRU cache of the real capacity.

Every (config, rate) run starts from empty caches (POST /mock/cache/clear, which also clears the picker's
index through the AllBlocksCleared event) and replays the same schedule. TTFT is measured with streaming
requests: time to the first SSE data chunk. Output tokens/s and the cached-token ratio come from the usage
the workers report (`usage.prompt_tokens_details.cached_tokens`), cross-checked with GET /mock/stats.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.prefix_oracle import block_chain, cached_tokens, lru_store

CONFIGS = {"a": "envoy round-robin", "b": "picker, load only", "c": "picker, KV-aware",
           "s": "picker, KV-aware + session affinity"}
PICKER_ARGS: dict[str, list[str]] = {"a": [], "b": [], "c": [], "s": []}
AFFINITY = "s"  # each conversation opts in (x-session-token) and sends back the token its last answer carried
TUNED = ("c1", "picker, KV-aware, Dynamo's overlap credit 1", ["--kv-overlap-score-credit", "1"])
BS = 32


@dataclass
class Workload:
    groups: int = 12
    users_per_group: int = 4
    system_tokens: int = 2000
    question_tokens: int = 60
    max_tokens: int = 8
    followup_prob: float = 0.4
    max_turns: int = 3
    rates: tuple[float, ...] = (8, 16, 24, 32, 40)
    seconds: float = 12.0
    # mock timing / capacity
    prefill_ms: float = 0.5
    decode_ms: float = 30.0
    speedup: float = 2.0
    max_batch: int = 4
    num_blocks: int = 400
    workers: int = 4

    def mock_args(self) -> list[str]:
        return ["--prefill-ms-per-token", str(self.prefill_ms), "--decode-ms-per-token", str(self.decode_ms),
                "--speedup", str(self.speedup), "--max-batch-size", str(self.max_batch), "--num-blocks",
                str(self.num_blocks), "--max-seq-len", "32768"]


QUICK = Workload(groups=4, users_per_group=2, system_tokens=600, question_tokens=20, max_tokens=4,
                 rates=(30,), seconds=1.5, speedup=20.0, num_blocks=120)


@dataclass
class Turn:
    conv: int
    group: int
    turn: int
    question: str


@dataclass
class Conversation:
    group: int
    user: int
    system: str
    history: list[dict[str, str]] = field(default_factory=list)
    answers: list[asyncio.Future[str]] = field(default_factory=list)
    token: str = ""  # session affinity: the token of the conversation's last answer


def schedule(w: Workload, rate: float, seed: int) -> tuple[list[float], list[Turn], list[str], list[tuple[int, int]]]:
    """Arrival times and, per arrival, which conversation and turn it is. Deterministic per (rate, seed)."""
    rng = random.Random(seed)
    systems = [H.words(random.Random(1000 + g), w.system_tokens) for g in range(w.groups)]
    n = int(rate * w.seconds)
    arrivals = H.poisson_arrivals(rate, n, rng)
    turns: list[Turn] = []
    convs: list[tuple[int, int]] = []  # (group, user)
    open_convs: dict[int, list[tuple[int, int]]] = {g: [] for g in range(w.groups)}  # conv -> turns so far
    for _ in range(n):
        g = rng.randrange(w.groups)
        cands = [c for c in open_convs[g] if c[1] < w.max_turns]
        if cands and rng.random() < w.followup_prob:
            conv, t = rng.choice(cands)
            open_convs[g].remove((conv, t))
            open_convs[g].append((conv, t + 1))
            turns.append(Turn(conv, g, t + 1, H.words(rng, w.question_tokens)))
        else:
            conv = len(convs)
            convs.append((g, rng.randrange(w.users_per_group)))
            open_convs[g].append((conv, 1))
            turns.append(Turn(conv, g, 1, H.words(rng, w.question_tokens)))
    return arrivals, turns, systems, convs


# ----------------------------------------------------------------------------- oracle
def oracle(prompts: list[tuple[int, list[int]]], workers: int, capacity: int) -> dict[str, float]:
    """Cached-token ratio bounds for prompts in send order ((group, token ids) each), mock reuse rules:
    full blocks only, within prompt[:-1]."""
    seen: set[int] = set()
    lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    total = inf_cached = aff_cached = 0
    for g, toks in prompts:
        chain = block_chain(toks, BS)
        total += len(toks)
        inf_cached += cached_tokens(toks, chain, seen, BS)
        seen.update(chain)
        cache = lru[g % workers]
        aff_cached += cached_tokens(toks, chain, cache, BS)
        lru_store(cache, chain, capacity)
    return {"infinite": inf_cached / total if total else 0.0,
            "affinity_lru": aff_cached / total if total else 0.0}


# ----------------------------------------------------------------------------- one run
async def run_rate(url: str, w: Workload, rate: float, seed: int, affinity: bool = False,
                   headers: dict[str, str] | None = None) -> tuple[list[H.Result], float, list[bytes]]:
    arrivals, turns, systems, conv_meta = schedule(w, rate, seed)
    loop = asyncio.get_running_loop()
    convs = [Conversation(g, u, systems[g]) for g, u in conv_meta]
    futs: dict[tuple[int, int], asyncio.Future[str]] = {}
    for t in turns:
        futs[(t.conv, t.turn)] = loop.create_future()
    bodies: list[bytes] = [b""] * len(turns)

    async def make(i: int) -> tuple[bytes, dict[str, str]]:
        t = turns[i]
        c = convs[t.conv]
        if t.turn > 1:
            answer = await futs[(t.conv, t.turn - 1)]
            c.history += [{"role": "assistant", "content": answer}]
        c.history.append({"role": "user", "content": f"user {c.user}: {t.question}"})
        msgs = [{"role": "system", "content": c.system}, *c.history]
        body = json.dumps({"model": "mock-model", "messages": msgs, "max_tokens": w.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        bodies[i] = body
        return body, {**(headers or {}), **({"x-session-token": c.token or "new"} if affinity else {})}

    def done(i: int, r: H.Result | None) -> None:
        t = turns[i]
        if r is not None and r.session_token:
            convs[t.conv].token = r.session_token  # before the next turn is let go below
        f = futs[(t.conv, t.turn)]
        if not f.done():
            f.set_result(r.text if r is not None and r.ok else "")

    res, el = await H.open_loop(url, arrivals, make, max_seconds=w.seconds + 2, stream=True, on_done=done,
                                limit=2000)
    return res, el, bodies


def measure(results: list[H.Result], elapsed: float, slo_ttft_ms: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out = H.summarize(results, elapsed)
    # inter-token latency per request: the time after the first chunk over the tokens after the first
    itl = [(r.done - r.sent - r.ttft) / (r.completion_tokens - 1) for r in ok
           if r.ttft is not None and r.completion_tokens > 1]
    out.update({f"itl_{k}": v for k, v in H.pcts_ms(itl).items()} if itl else {})
    if slo_ttft_ms is not None:  # every request sent counts: an error or a 429 misses the objective
        met = sum(1 for r in ok if r.ttft is not None and r.ttft * 1000.0 <= slo_ttft_ms)
        out["slo_ttft_ms"] = slo_ttft_ms
        out["slo_ttft_attainment"] = met / len(results) if results else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    out["cached_ratio"] = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
    span = (max(r.done for r in ok) - min(r.sent for r in ok)) if ok else 0.0
    out["output_tokens_per_s"] = sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0
    out["session_tokens"] = sum(1 for r in ok if r.session_token)  # answers carrying x-session-token
    out["per_worker"] = {}
    for r in ok:
        out["per_worker"][r.worker] = out["per_worker"].get(r.worker, 0) + 1
    return out


def clear_all(workers: list[H.Proc]) -> dict[str, dict[str, int]]:
    for m in workers:
        H.post_json(m.url + "/mock/cache/clear")
    return {m.name: H.get_json(m.url + "/mock/stats") for m in workers}


def wait_idle(workers: list[H.Proc], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((s := H.get_json(m.url + "/mock/stats"))["running"] == 0 and s["waiting"] == 0 for m in workers):
            return
        time.sleep(0.1)


def run(w: Workload, quick: bool, repeats: int = 1, slo_ttft_ms: float | None = None) -> dict[str, Any]:
    from trtllm_mock.tokenizer import prompt_ids_for_chat

    rows: list[dict[str, Any]] = []
    oracles: dict[float, dict[str, float]] = {}
    with H.Stack() as outer:
        workers = [H.mock_worker(outer, f"worker-{i}", w.mock_args()) for i in range(w.workers)]
        renderer = H.mock_renderer(outer)
        for cfg in CONFIGS:
            with H.Stack() as st:
                if cfg == "a":
                    env = H.envoy(st, upstreams=[m.address for m in workers])
                else:
                    kv = cfg != "b"
                    extra = list(PICKER_ARGS[cfg])
                    if cfg == AFFINITY:
                        keys = st.dir / "session-keys"
                        keys.write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
                        extra += ["--session-affinity-keys-file", str(keys)]
                    pk = H.picker(st, H.endpoints_spec(workers), "trtllm-render" if kv else "none",
                                  renderer if kv else None, extra=extra)
                    if kv:
                        H.wait_subscribed(pk, [m.address for m in workers])
                    env = H.envoy(st, picker_proc=pk, lean_response_headers=cfg == AFFINITY)
                url = env.url + "/v1/chat/completions"
                slo = {"x-slo-ttft-ms": f"{slo_ttft_ms:g}"} if slo_ttft_ms is not None else None
                for rate, repeat in [(r, k) for r in w.rates for k in range(repeats)]:
                    wait_idle(workers)
                    before = clear_all(workers)
                    time.sleep(0.3)  # let the AllBlocksCleared events reach the picker
                    # repeat 0 is the schedule every earlier recording used; the others draw new arrivals
                    seed = int(rate * 100) + 7919 * repeat
                    res, el, bodies = asyncio.run(run_rate(url, w, rate, seed=seed, affinity=cfg == AFFINITY,
                                                           headers=slo))
                    wait_idle(workers)
                    after = {m.name: H.get_json(m.url + "/mock/stats") for m in workers}
                    row = {"config": cfg, "rate": rate, "repeat": repeat, "seed": seed,
                           **measure(res, el, slo_ttft_ms)}
                    dp = sum(after[k]["prompt_tokens_total"] - before[k]["prompt_tokens_total"] for k in after)
                    dc = sum(after[k]["cached_tokens_total"] - before[k]["cached_tokens_total"] for k in after)
                    row["mock_stats_cached_ratio"] = dc / dp if dp else 0.0
                    rows.append(row)
                    if cfg == "c" and repeat == 0:  # the oracle replays exactly what (c) sent
                        sent = sorted((r.sent, r.tag) for r in res)
                        prompts = []
                        for _, i in sent:
                            body = json.loads(bodies[i])
                            prompts.append((_group_of(body, w), prompt_ids_for_chat(body)))
                        oracles[rate] = oracle(prompts, w.workers, w.num_blocks)
                    print(f"  ({cfg}) {rate:>5} req/s: TTFT p50 {H.fmt(row.get('ttft_p50_ms'))} p90 "
                          f"{H.fmt(row.get('ttft_p90_ms'))} ms, cached {row['cached_ratio']:.3f}, "
                          f"{row['output_tokens_per_s']:.0f} out tok/s, errors {row['errors']}, "
                          f"per worker {row['per_worker']}", flush=True)
    return {"rows": rows, "oracle": {str(k): v for k, v in oracles.items()}}


_SYSTEMS: dict[tuple[int, int], dict[str, int]] = {}


def _group_of(body: dict[str, Any], w: Workload) -> int:
    key = (w.groups, w.system_tokens)
    if key not in _SYSTEMS:
        _SYSTEMS[key] = {H.words(random.Random(1000 + g), w.system_tokens): g for g in range(w.groups)}
    return _SYSTEMS[key][body["messages"][0]["content"]]


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    """Both targets for every KV-aware configuration present ((c), and (c1) in full runs), and what session
    affinity adds over KV-aware routing alone (no target: issue 33 asks to measure it, "it may add nothing")."""
    out: dict[str, Any] = {}
    for cfg in [k for k in doc["configs"] if k.startswith("c")]:
        t = _targets_for(doc, cfg)
        if t:
            out[cfg] = t
    rows = doc["result"]["rows"]
    pairs = [(c, s) for c in rows if c["config"] == "c"
             for s in rows if s["config"] == AFFINITY and s["rate"] == c["rate"]]
    if pairs:
        out["session_affinity_over_kv_aware"] = [
            {"rate": c["rate"], "cached_c": c["cached_ratio"], "cached_s": s["cached_ratio"],
             "ttft_p90_c_ms": c.get("ttft_p90_ms"), "ttft_p90_s_ms": s.get("ttft_p90_ms"),
             "ttft_p90_c_over_s": H.ratio(c.get("ttft_p90_ms"), s.get("ttft_p90_ms"))} for c, s in pairs]
    return out


def _targets_for(doc: dict[str, Any], cfg: str) -> dict[str, Any]:
    rows = doc["result"]["rows"]
    top = max(r["rate"] for r in rows)
    a = next((r for r in rows if r["config"] == "a" and r["rate"] == top), None)
    c = next((r for r in rows if r["config"] == cfg and r["rate"] == top), None)
    if a is None or c is None:
        return {}
    gap = H.ratio(a.get("ttft_p90_ms"), c.get("ttft_p90_ms"))
    ratios = []
    for r in rows:
        if r["config"] == cfg and str(r["rate"]) in doc["result"]["oracle"]:
            o = doc["result"]["oracle"][str(r["rate"])]
            ratios.append({"rate": r["rate"], "c": r["cached_ratio"], "oracle_infinite": o["infinite"],
                           "oracle_affinity_lru": o["affinity_lru"],
                           "c_over_infinite": H.ratio(r["cached_ratio"], o["infinite"])})
    worst = min((x["c_over_infinite"] or 0.0) for x in ratios) if ratios else 0.0
    return {"ttft_p90_a_over_c_at_top_rate": {"rate": top, "a_ms": a.get("ttft_p90_ms"),
                                              "c_ms": c.get("ttft_p90_ms"), "ratio": gap, "target": 5.0,
                                              "met": gap is not None and gap >= 5.0},
            "cached_ratio_within_10pct_of_oracle": {"per_rate": ratios, "worst_c_over_oracle": worst,
                                                    "met": worst >= 0.9}}


def print_report(doc: dict[str, Any]) -> None:
    rows = doc["result"]["rows"]
    base = {r["rate"]: r for r in rows if r["config"] == "a"} or {r["rate"]: r for r in rows}
    print("\nRouting quality (ratios are TTFT p90 of (a) over this config at the same rate)")
    print(H.table([[r["config"], r["rate"], r["requests"], r["errors"], r.get("ttft_p50_ms"), r.get("ttft_p90_ms"),
                    H.ratio(base[r["rate"]].get("ttft_p90_ms"), r.get("ttft_p90_ms")), r["output_tokens_per_s"],
                    r["cached_ratio"], r["mock_stats_cached_ratio"]] for r in rows],
                  ["cfg", "rate", "reqs", "err", "TTFT p50", "TTFT p90", "a/x p90", "out tok/s", "cached",
                   "cached(stats)"]))
    print("\n(d) oracle cached-token ratio per rate:", json.dumps(doc["result"]["oracle"]))
    H.print_targets(doc)


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["result"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    H.plot_by_config(axes, rows, CONFIGS, "rate", (lambda r: r.get("ttft_p90_ms"), lambda r: r["cached_ratio"],
                                                   lambda r: r["output_tokens_per_s"]))
    orc = doc["result"]["oracle"]
    xs = sorted(float(k) for k in orc)
    axes[1].plot(xs, [orc[str(k) if str(k) in orc else str(int(k))]["infinite"] for k in xs], "k--",
                 label="(d) oracle, infinite cache")
    axes[1].plot(xs, [orc[str(k) if str(k) in orc else str(int(k))]["affinity_lru"] for k in xs], "k:",
                 label="(d) group affinity, LRU of real capacity")
    axes[0].set_yscale("log")
    H.label_axes(axes, ("TTFT p90 (ms, log)", "cached-token ratio", "output tokens/s"), "offered load (req/s, Poisson)")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=7)
    H.save_figure(fig, "Shared-prefix workload on 4 mock workers: round-robin vs load-only vs KV-aware", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "routing")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="extra KV-aware picker configuration, e.g. 'c2=--prefill-load-scale 4'")
    ap.add_argument("--only", help="comma-separated subset of configurations to run (calibration)")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s) instead of the default ladder")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per (config, rate), each with its own arrival seed (repeat 0 = the usual one)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help="send llm-d's x-slo-ttft-ms header with every request and report the share of requests "
                         "whose TTFT met it (slo_ttft_attainment); only --cost-model time reads the header")
    a = ap.parse_args(argv)
    w = QUICK if a.quick else Workload()
    if not a.quick:
        CONFIGS[TUNED[0]] = TUNED[1]
        PICKER_ARGS[TUNED[0]] = TUNED[2]
    for v in a.variant:
        name, _, flags = v.partition("=")
        CONFIGS[name] = f"picker, KV-aware, {flags}"
        PICKER_ARGS[name] = flags.split()
    if a.only:
        for k in [k for k in CONFIGS if k not in a.only.split(",")]:
            del CONFIGS[k]
    if a.rates:
        w.rates = tuple(float(x) for x in a.rates.split(","))
    print("routing: shared-prefix workload", flush=True)
    result = run(w, a.quick, max(a.repeats, 1), a.slo_ttft_ms)
    doc = {"bench": "routing", **H.meta(a.quick), "configs": CONFIGS, "workload": w.__dict__,
           "mock_args": w.mock_args(), "result": result}
    doc["targets"] = targets(doc)
    return H.publish(doc, a.out, "routing", print_report, chart)


if __name__ == "__main__":
    main()
