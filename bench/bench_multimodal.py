"""Routing image conversations: round-robin, text-prefix credit, exact image credit (issue 29, the benchmark).

    python -m bench.bench_multimodal [--quick] [--out DIR] [--rates 4,8,12] [--repeats 3] [--only a,t,x]

Workload: multimodal chat conversations on four `trtllm-mock --multimodal` workers (Qwen2/2.5-VL-like placeholder
expansion, vLLM's `extra_keys` KV events, vLLM's render answers, vision-encoder time per uncached image on, at the
mock's default calibration). Every conversation is one user with ONE image of its own: a real PNG (IHDR + IDAT,
zlib, CRC) of one of several sizes, sent as a `data:` URI, so each image expands to the size-dependent number of
placeholder tokens the mock computes (64 for 224x224 up to 1,225 for 1024x1024). All conversations share one
system prompt. The first turn is the image and a question; 3-4 follow-up turns each re-send the whole
conversation (the image, every earlier question and answer). Requests arrive open-loop at Poisson times (a
follow-up leaves at its arrival time, or when the answer it follows arrives, whichever is later); each arrival
is the next turn of an open conversation with probability 1 - 1/mean turns, else a new conversation.

  (a) Envoy round-robin, no ext_proc (baseline)
  (t) Envoy + picker, vllm-render, --media-credit text-prefix: the tokens before the first image are credited
      (what the picker did before issue 29; here that is the shared system prompt, the same on every warm worker)
  (x) Envoy + picker, vllm-render, --media-credit exact (the default): text, image and later blocks credited from
      the render's mm_hashes / mm_placeholders and the workers' extra_keys events
  (d) offline figures on the cached-token ratio, from the very prompts (x) sent, in send order and at their send
      times, each block keyed by its tokens AND the image items overlapping it, as the mock keys it
      (``image_chain``): `infinite` (one cache holding every earlier prompt: an upper bound on any placement's
      reuse) and `clairvoyant` (bench/clairvoyant.py: future knowledge, Belady eviction, the workers' real capacity
      and batch limit; its placement prefers a worker that can admit a request now over one that holds its image,
      so once the workers' slots are full it is no bound: bench/README.md says so with the figures). On reuse only,
      not on TTFT.

KV capacity (`--num-blocks` per worker) is set so a saturating run's conversations do not all fit in the pool (the
clairvoyant replay's `clairvoyant_evicted_blocks` shows it must evict even knowing the future).

Method: every (rate, seed) runs the three configurations back to back from empty worker caches (POST
/mock/cache/clear, which also empties the pickers' indexes through AllBlocksCleared and the encoder caches), on the
same arrival schedule; `--repeats` seeds per cell; each cell is reported as median [min..max] and a ratio between
two configurations is claimed only when their spreads do not overlap (bench/trace_stats.claim). TTFT is the time to
the first SSE data chunk; the cached ratio is the workers' own `usage.prompt_tokens_details.cached_tokens` over
`usage.prompt_tokens` (image placeholder tokens included), cross-checked with the /mock/stats deltas. The 1-minute
load average is recorded per run: the machine this was written on is shared.

JSON (`multimodal.json`): common keys, `configs`, `workload`, `mock_args`, and
    result.runs[]:  {config, rate, seed, requests, errors, ttft_p50_ms, ttft_p90_ms, ttft_p99_ms,
                     first_turn_ttft_p{50,90}_ms, follow_up_ttft_p{50,90}_ms, first_turn_requests, follow_up_requests,
                     cached_ratio, prompt_tokens, mock_stats_cached_ratio, images_encoded, encoder_ms_total, per_worker,
                     media_scored (picker: epp_media_requests_total deltas by labels), picker_predicted_cached_tokens,
                     picker_observed_cached_tokens, picker_usage_reports, loadavg_1m_start, loadavg_1m_end, wall_s}
    result.cells[]: {config, rate, summary: {metric: {median, min, max, n} | null}}
    result.bounds[]: {rate, seed, infinite, clairvoyant, clairvoyant_waited_requests, clairvoyant_evicted_blocks}
    claims[]: {rate, metric, config, baseline, median_ratio, claim}   (> 1 = config better; claim null = overlap)
    targets: {x_ttft_p90_2x_below_t_at_saturation: {...}}
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import clairvoyant as CV
from bench import harness as H
from bench import trace_stats as S

CONFIGS = {"a": "envoy round-robin", "t": "picker, text-prefix image credit", "x": "picker, exact image credit"}
PICKER_ARGS = {"t": ["--media-credit", "text-prefix"], "x": ["--media-credit", "exact"]}
BS = 32  # the workers' --tokens-per-block (epp_extproc.dev.procs.mock_worker)
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "first_turn_ttft_p90_ms", "follow_up_ttft_p90_ms",
           "follow_up_ttft_p50_ms", "cached_ratio", "mock_stats_cached_ratio", "errors",
           "images_encoded", "loadavg_1m_end")
LOWER_IS_BETTER = ("ttft_p50_ms", "ttft_p90_ms", "follow_up_ttft_p90_ms")
CLAIMED = (*LOWER_IS_BETTER, "cached_ratio")
PAIRS = (("x", "t"), ("x", "a"), ("t", "a"))
# Image sizes (width, height) a user's picture is drawn from: Qwen2-VL placeholder counts 64, 192, 391, 625, 1225.
IMAGE_SIZES = ((224, 224), (448, 336), (640, 480), (700, 700), (1024, 1024))


@dataclass
class Workload:
    system_words: int = 300
    question_words: int = 30
    max_tokens: int = 8
    turns: tuple[int, ...] = (4, 5)  # 1 + 3..4 follow-ups, drawn per conversation
    rates: tuple[float, ...] = (4.0, 7.0, 10.0)
    seconds: float = 14.0
    repeats: int = 3
    workers: int = 4
    # mock timing (independent scheduler: each request sleeps per UNCACHED prompt token, then per output token)
    prefill_ms: float = 2.0
    decode_ms: float = 10.0
    speedup: float = 1.0
    max_batch: int = 2
    num_blocks: int = 220
    encoder_ms_per_patch: float | None = None  # None: the mock's calibrated default (docs/mock-vision.md)

    def mock_args(self) -> list[str]:
        args = ["--multimodal", "--event-dialect", "vllm", "--render-dialect", "vllm",
                "--prefill-ms-per-token", str(self.prefill_ms), "--decode-ms-per-token", str(self.decode_ms),
                "--speedup", str(self.speedup), "--max-batch-size", str(self.max_batch),
                "--num-blocks", str(self.num_blocks), "--max-seq-len", "32768"]
        if self.encoder_ms_per_patch is not None:
            args += ["--encoder-ms-per-patch", str(self.encoder_ms_per_patch)]
        return args

    def engine_model(self) -> CV.EngineModel:
        """The mock's independent timing as the clairvoyant router's step model: one prefill step (no token
        budget), no step base or context cost, so a life is uncached x prefill + (out - 1) x decode (simulated ms;
        the mock's first output token is one more decode step, which this leaves out: a shorter life)."""
        return CV.EngineModel(workers=self.workers, num_blocks=self.num_blocks, block_tokens=BS,
                              max_batch=self.max_batch, max_num_tokens=1 << 30, step_base_ms=0.0,
                              prefill_ms_per_token=self.prefill_ms, decode_ms_per_token=self.decode_ms,
                              kv_read_ms_per_token=0.0)


QUICK = Workload(system_words=120, question_words=12, rates=(6.0,), seconds=3.0, repeats=2, speedup=4.0,
                 num_blocks=160)


# ----------------------------------------------------------------------------- real PNG bytes
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width: int, height: int, seed: int) -> bytes:
    """A valid 8-bit RGB PNG of this size whose pixels depend on ``seed`` (one seeded row repeated: compresses
    to a few KB whatever the size, and any two seeds give different bytes)."""
    row = b"\x00" + random.Random(seed).randbytes(3 * width)  # filter type 0, then the row's pixels
    raw = zlib.compress(row * height, 6)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", raw) + _chunk(b"IEND", b"")


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


# ----------------------------------------------------------------------------- schedule
@dataclass
class Turn:
    conv: int
    turn: int
    question: str


@dataclass
class Conversation:
    image: str  # data URI
    size: tuple[int, int]
    turns: int
    history: list[dict[str, Any]] = field(default_factory=list)


def schedule(w: Workload, rate: float, seed: int) -> tuple[list[float], list[Turn], list[Conversation]]:
    """Poisson arrivals and, per arrival, which conversation and turn it is; deterministic per (rate, seed)."""
    rng = random.Random(seed * 7919 + int(rate * 1000))
    arrivals = H.poisson_arrivals(rate, max(1, int(rate * w.seconds)), rng)
    mean_turns = sum(w.turns) / len(w.turns)
    convs: list[Conversation] = []
    done_turns: list[int] = []
    open_: list[int] = []
    turns: list[Turn] = []
    for _ in arrivals:
        if open_ and rng.random() >= 1.0 / mean_turns:
            c = rng.choice(open_)
        else:
            c = len(convs)
            size = rng.choice(IMAGE_SIZES)
            convs.append(Conversation(data_uri(png(*size, seed=rng.randrange(1 << 30))), size, rng.choice(w.turns)))
            done_turns.append(0)
            open_.append(c)
        done_turns[c] += 1
        turns.append(Turn(c, done_turns[c], H.words(rng, w.question_words)))
        if done_turns[c] >= convs[c].turns:
            open_.remove(c)
    return arrivals, turns, convs


def system_prompt(w: Workload) -> str:
    return "You are a careful visual assistant. " + H.words(random.Random(4242), w.system_words)


# ----------------------------------------------------------------------------- one run
async def run_rate(url: str, w: Workload, rate: float,
                   seed: int) -> tuple[list[H.Result], float, list[bytes], list[Turn]]:
    arrivals, turns, convs = schedule(w, rate, seed)
    system = system_prompt(w)
    loop = asyncio.get_running_loop()
    futs = {(t.conv, t.turn): loop.create_future() for t in turns}
    bodies: list[bytes] = [b""] * len(turns)

    async def make(i: int) -> bytes:
        t = turns[i]
        c = convs[t.conv]
        if t.turn > 1:
            c.history.append({"role": "assistant", "content": await futs[(t.conv, t.turn - 1)]})
            c.history.append({"role": "user", "content": t.question})
        else:  # the image first, then the question: the text before the image is the shared system prompt
            c.history.append({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": c.image}}, {"type": "text", "text": t.question}]})
        body = json.dumps({"model": "mock-model", "messages": [{"role": "system", "content": system}, *c.history],
                           "max_tokens": w.max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        bodies[i] = body
        return body

    def done(i: int, r: H.Result | None) -> None:
        f = futs[(turns[i].conv, turns[i].turn)]
        if not f.done():
            f.set_result(r.text if r is not None and r.ok and r.text else "(no answer)")

    res, el = await H.open_loop(url, arrivals, make, max_seconds=w.seconds + 3, stream=True, on_done=done,
                                limit=2000)
    return res, el, bodies, turns


def stats(workers: Sequence[H.Proc]) -> dict[str, dict[str, Any]]:
    return {m.name: H.get_json(m.url + "/mock/stats") for m in workers}


def wait_idle(workers: Sequence[H.Proc], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats(workers).values()):
            return
        time.sleep(0.1)


def media_scored(pk: H.Proc | None) -> dict[str, float] | None:
    """The picker's `epp_media_requests_total` by (scored, reason): how it scored the image requests."""
    if pk is None:
        return None
    out: dict[str, float] = {}
    for line in H.get_text(H.picker_url(pk) + "/metrics").splitlines():
        if line.startswith("epp_media_requests_total{"):
            labels, _, value = line.rpartition(" ")
            out[labels[len("epp_media_requests_total"):]] = float(value)
    return out


_SUMS = ("epp_predicted_cached_tokens_sum", "dynamo_epp_cached_tokens_sum", "dynamo_epp_cached_tokens_count")


def picker_cached(pk: H.Proc | None) -> dict[str, float] | None:
    """Sums of the picker's predicted cached tokens and of the cached tokens the workers reported to it."""
    if pk is None:
        return None
    out = dict.fromkeys(_SUMS, 0.0)
    for line in H.get_text(H.picker_url(pk) + "/metrics").splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in out:
            out[name] += float(line.rpartition(" ")[2])
    return out


def _delta(after: dict[str, float] | None, before: dict[str, float] | None) -> dict[str, float] | None:
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0.0) for k, v in after.items() if v - (before or {}).get(k, 0.0)}


def measure(results: list[H.Result], elapsed: float, before: dict[str, Any], after: dict[str, Any],
            turns: Sequence[Turn]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out = H.summarize(results, elapsed)
    # first turns carry an image no worker has seen (no routing can reuse it); follow-ups are what routing decides
    for name, sel in (("first_turn", lambda t: t == 1), ("follow_up", lambda t: t > 1)):
        xs = [r.ttft for r in ok if r.ttft is not None and sel(turns[r.tag].turn)]
        for q in (0.5, 0.9):
            v = H.pct(xs, q)
            out[f"{name}_ttft_p{int(q * 100)}_ms"] = None if v is None else v * 1e3
        out[f"{name}_requests"] = len(xs)
    prompt = sum(r.prompt_tokens for r in ok)
    out["cached_ratio"] = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
    out["prompt_tokens"] = prompt
    dp = sum(after[k]["prompt_tokens_total"] - before[k]["prompt_tokens_total"] for k in after)
    dc = sum(after[k]["cached_tokens_total"] - before[k]["cached_tokens_total"] for k in after)
    out["mock_stats_cached_ratio"] = dc / dp if dp else 0.0
    vis = [(after[k].get("vision") or {}, before[k].get("vision") or {}) for k in after]
    out["images_encoded"] = sum(a.get("images_encoded", 0) - b.get("images_encoded", 0) for a, b in vis)
    out["encoder_ms_total"] = sum(a.get("encoder_ms_total", 0.0) - b.get("encoder_ms_total", 0.0) for a, b in vis)
    out["per_worker"] = {}
    for r in ok:
        out["per_worker"][r.worker] = out["per_worker"].get(r.worker, 0) + 1
    return out


def prediction(d: dict[str, float] | None) -> dict[str, Any]:
    """What the picker predicted its picks would reuse against what the workers reported (both summed over the
    run's requests): under exact credit they should agree closely; under text-prefix the prediction stops at the
    image, so the workers reuse more than predicted."""
    if d is None:
        return {"picker_predicted_cached_tokens": None, "picker_observed_cached_tokens": None}
    return {"picker_predicted_cached_tokens": int(d.get(_SUMS[0], 0)),
            "picker_observed_cached_tokens": int(d.get(_SUMS[1], 0)),
            "picker_usage_reports": int(d.get(_SUMS[2], 0))}


# ----------------------------------------------------------------------------- offline bounds
def image_chain(body: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt token ids, block chain) of a chat body as the mock worker keys it: each full block's hash covers
    its parent, its tokens and the image items overlapping it (identity and offset, `VisionPrompt.block_keys`),
    so the same placeholder tokens of another image, or of the same image elsewhere, are other blocks."""
    from trtllm_mock.config import MockConfig
    from trtllm_mock.vision import parse_image_size, vision_prompt

    cfg = MockConfig()
    vp = vision_prompt(body, cfg.chat_template, parse_image_size(cfg.url_image_size))
    chain, h = [], 0
    for b, keys in enumerate(vp.block_keys(BS)):
        h = hash((h, tuple(vp.token_ids[b * BS:(b + 1) * BS]), tuple(k.hash_key() for k in keys)))
        chain.append(h)
    return vp.token_ids, chain


def bounds(w: Workload, results: Sequence[H.Result], bodies: Sequence[bytes]) -> dict[str, Any]:
    """Reuse bounds of what (x) sent, in its send order and at its send times (simulated ms = wall ms x speedup)."""
    sent = sorted((r.sent, r.tag) for r in results)
    if not sent:
        return {"infinite": None, "clairvoyant": None}
    t0 = sent[0][0]
    prompts, chains, arrivals = [], [], []
    for ts, i in sent:
        toks, chain = image_chain(json.loads(bodies[i]))
        prompts.append(toks)
        chains.append(chain)
        arrivals.append((ts - t0) * 1000.0 * w.speedup)
    seen: set[int] = set()
    cached = total = 0
    for toks, chain in zip(prompts, chains, strict=True):
        k = 0
        while k < (len(toks) - 1) // BS and chain[k] in seen:
            k += 1
        cached += k * BS
        total += len(toks)
        seen.update(chain)
    cv = CV.route(prompts, [w.max_tokens] * len(prompts), arrivals, w.engine_model(), chains=chains)
    return {"infinite": cached / total if total else None, "clairvoyant": cv["cached_ratio"],
            "clairvoyant_waited_requests": cv["waited_requests"], "clairvoyant_evicted_blocks": cv["evicted_blocks"]}


# ----------------------------------------------------------------------------- the runs
def start_configs(st: H.Stack, configs: Sequence[str], workers: list[H.Proc],
                  renderer: H.Proc) -> dict[str, tuple[H.Proc, H.Proc | None]]:
    """Every configuration's Envoy (and picker) at once, all over the same workers; one is driven at a time."""
    out: dict[str, tuple[H.Proc, H.Proc | None]] = {}
    for cfg in configs:
        if cfg == "a":
            out[cfg] = (H.envoy(st, upstreams=[m.address for m in workers]), None)
            continue
        pk = H.picker(st, H.endpoints_spec(workers), "vllm-render", renderer, extra=PICKER_ARGS[cfg])
        H.wait_subscribed(pk, [m.address for m in workers])
        out[cfg] = (H.envoy(st, picker_proc=pk), pk)
    return out


def run(w: Workload, configs: Sequence[str]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    bnds: list[dict[str, Any]] = []
    with H.Stack(prefix="epp-bench-mm-") as st:
        workers = [H.mock_worker(st, f"worker-{i}", w.mock_args()) for i in range(w.workers)]
        renderer = H.mock_renderer(st, ["--multimodal", "--render-dialect", "vllm"])
        stacks = start_configs(st, configs, workers, renderer)
        for seed in range(w.repeats):
            for rate in w.rates:
                for cfg in configs:
                    env, pk = stacks[cfg]
                    wait_idle(workers)
                    for m in workers:
                        H.post_json(m.url + "/mock/cache/clear")
                    time.sleep(0.3)  # the AllBlocksCleared events reach the pickers
                    before, mb, pb = stats(workers), media_scored(pk), picker_cached(pk)
                    load0, t0 = os.getloadavg()[0], time.monotonic()
                    res, el, bodies, turns = asyncio.run(run_rate(env.url + "/v1/chat/completions", w, rate, seed))
                    wait_idle(workers)
                    time.sleep(0.5)  # the picker reads each answer's usage after its stream ended
                    row = {"config": cfg, "rate": rate, "seed": seed,
                           **measure(res, el, before, stats(workers), turns),
                           "media_scored": _delta(media_scored(pk), mb), **prediction(_delta(picker_cached(pk), pb)),
                           "loadavg_1m_start": load0,
                           "loadavg_1m_end": os.getloadavg()[0], "wall_s": round(time.monotonic() - t0, 1)}
                    runs.append(row)
                    print(f"  ({cfg}) {rate:g} req/s seed {seed}: TTFT p50/p90 {H.fmt(row.get('ttft_p50_ms'), '.0f')}"
                          f"/{H.fmt(row.get('ttft_p90_ms'), '.0f')} ms, cached {row['cached_ratio']:.3f} (stats "
                          f"{row['mock_stats_cached_ratio']:.3f}), images encoded {row['images_encoded']}, errors "
                          f"{row['errors']}, per worker {row['per_worker']}, load {row['loadavg_1m_end']:.1f}",
                          flush=True)
                    if cfg == "x":
                        bnds.append({"rate": rate, "seed": seed, **bounds(w, res, bodies)})
    return {"runs": runs, "cells": cells(runs), "bounds": bnds}


def cells(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    keys: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        keys.setdefault((r["config"], r["rate"]), []).append(r)
    return [{"config": c, "rate": rate, "summary": S.summarize(rs, METRICS)} for (c, rate), rs in keys.items()]


# ----------------------------------------------------------------------------- claims and targets
def _values(doc: dict[str, Any], cfg: str, rate: float, metric: str) -> list[float | None]:
    return [r.get(metric) for r in doc["result"]["runs"] if r["config"] == cfg and r["rate"] == rate]


def claims(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each pair of PAIRS at each rate on each claimed metric, oriented so > 1 means `config` is better."""
    out = []
    present = {r["config"] for r in doc["result"]["runs"]}
    for rate in sorted({r["rate"] for r in doc["result"]["runs"]}):
        for x, base in PAIRS:
            if x not in present or base not in present:
                continue
            for m in CLAIMED:
                xs, bs = _values(doc, x, rate, m), _values(doc, base, rate, m)
                num, den = (bs, xs) if m in LOWER_IS_BETTER else (xs, bs)
                sn, sd = S.spread(num), S.spread(den)
                out.append({"rate": rate, "metric": m, "config": x, "baseline": base,
                            "median_ratio": H.ratio(sn.median if sn else None, sd.median if sd else None),
                            "claim": S.claim(num, den)})
    return out


def saturating_rate(doc: dict[str, Any]) -> float | None:
    """The first rate at which round-robin's median TTFT p90 is >= 3x its value at the lowest rate (else the top
    rate): where (a) has saturated (the rule bench_trace uses)."""
    rates = sorted({r["rate"] for r in doc["result"]["runs"] if r["config"] == "a"})
    if not rates:
        return None
    med = {rate: (S.spread(_values(doc, "a", rate, "ttft_p90_ms")) or S.Spread(0, 0, 0, 0)).median for rate in rates}
    return next((rate for rate in rates if med[rate] >= 3 * med[rates[0]]), rates[-1])


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    sat = saturating_rate(doc)
    k = next((c for c in doc["claims"] if (c["rate"], c["metric"], c["config"], c["baseline"])
              == (sat, "ttft_p90_ms", "x", "t")), None)
    if k is None:
        return {}
    return {"x_ttft_p90_2x_below_t_at_saturation": {"saturating_rate": sat, **k, "target": 2.0,
                                                    "met": k["claim"] is not None and k["claim"] >= 2.0}}


# ----------------------------------------------------------------------------- report
def _cell(doc: dict[str, Any], cfg: str, rate: float) -> dict[str, Any] | None:
    return next((c for c in doc["result"]["cells"] if c["config"] == cfg and c["rate"] == rate), None)


def _bound(doc: dict[str, Any], rate: float, key: str) -> dict[str, Any] | None:
    s = S.spread([b[key] for b in doc["result"]["bounds"] if b["rate"] == rate])
    return s.as_dict() if s else None


def print_report(doc: dict[str, Any]) -> None:
    print("\nMultimodal conversations: median [min..max] over seeds")
    rows = []
    for c in doc["result"]["cells"]:
        s = c["summary"]
        rows.append([c["config"], c["rate"], S.fmt_spread(s["ttft_p50_ms"]), S.fmt_spread(s["ttft_p90_ms"]),
                     S.fmt_spread(s["first_turn_ttft_p90_ms"]), S.fmt_spread(s["follow_up_ttft_p90_ms"]),
                     S.fmt_spread(s["cached_ratio"], ".3f"), S.fmt_spread(s["images_encoded"]),
                     S.fmt_spread(s["errors"]), S.fmt_spread(s["loadavg_1m_end"], ".1f")])
    print(H.table(rows, ["cfg", "rate", "TTFT p50 ms", "TTFT p90 ms", "1st turn p90", "follow-up p90",
                         "cached ratio", "images encoded", "errors", "load 1m"]))
    for rate in sorted({b["rate"] for b in doc["result"]["bounds"]}):
        print(f"  (d) {rate:g} req/s: infinite {S.fmt_spread(_bound(doc, rate, 'infinite'), '.3f')}, clairvoyant "
              f"{S.fmt_spread(_bound(doc, rate, 'clairvoyant'), '.3f')}")
    print("\nClaims (> 1 = config better; in brackets: ratio of medians, spreads overlap, no claim)")
    for k in doc["claims"]:
        txt = f"{k['claim']:.2f}" if k["claim"] is not None else (
            f"({k['median_ratio']:.2f})" if k["median_ratio"] is not None else "-")
        print(f"  {k['rate']:g} req/s {k['metric']}: ({k['config']}) vs ({k['baseline']}) {txt}")
    H.print_targets(doc)


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    for cfg, label in doc["configs"].items():
        cs = sorted((c for c in doc["result"]["cells"] if c["config"] == cfg), key=lambda c: c["rate"])
        x = [c["rate"] for c in cs]
        for ax, m in zip(axes, ("ttft_p50_ms", "ttft_p90_ms", "follow_up_ttft_p90_ms", "cached_ratio"),
                         strict=True):
            s = [c["summary"][m] for c in cs]
            med = [v["median"] if v else float("nan") for v in s]
            err = [[v["median"] - v["min"] if v else 0 for v in s], [v["max"] - v["median"] if v else 0 for v in s]]
            ax.errorbar(x, med, yerr=err, fmt="o-", capsize=3, label=f"({cfg}) {label}")
    rates = sorted({b["rate"] for b in doc["result"]["bounds"]})
    for key, style, what in (("infinite", "k:", "infinite cache: upper bound"),
                             ("clairvoyant", "k--", "clairvoyant heuristic: no bound once saturated")):
        ys = [(_bound(doc, r, key) or {}).get("median", float("nan")) for r in rates]
        axes[3].plot(rates, ys, style, label=f"(d) {what} ((x)'s prompts)")
    for ax in axes[:3]:
        ax.set_yscale("log")
    H.label_axes(axes, ("TTFT p50 (ms, log)", "TTFT p90 (ms, log)", "follow-up turns' TTFT p90 (ms, log)",
                        "cached-token ratio (engine usage)"), "offered load (req/s, Poisson)")
    axes[0].legend(fontsize=8)
    axes[3].legend(fontsize=7)
    H.save_figure(fig, f"Image conversations on {doc['workload']['workers']} mock vision workers, median and "
                       "min..max over seeds (shared 2-core machine)", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "multimodal")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s) instead of the default ladder")
    ap.add_argument("--repeats", type=int, help="arrival seeds per cell (default 3; --quick 2)")
    ap.add_argument("--seconds", type=float, help="arrival window per run")
    ap.add_argument("--only", help="comma-separated subset of the configurations a,t,x")
    ap.add_argument("--name", default="multimodal", help="results file stem (default multimodal)")
    a = ap.parse_args(argv)
    w = QUICK if a.quick else Workload()
    if a.rates:
        w.rates = tuple(float(x) for x in a.rates.split(","))
    if a.repeats:
        w.repeats = a.repeats
    if a.seconds:
        w.seconds = a.seconds
    configs = [c for c in CONFIGS if not a.only or c in a.only.split(",")]
    print(f"multimodal: {len(configs)} configs x {len(w.rates)} rates x {w.repeats} seeds", flush=True)
    t0 = time.monotonic()
    result = run(w, configs)
    doc = {"bench": "multimodal", **H.meta(a.quick), "configs": {c: CONFIGS[c] for c in configs},
           "workload": {**w.__dict__, "image_sizes": IMAGE_SIZES}, "mock_args": w.mock_args(), "result": result,
           "wall_s": round(time.monotonic() - t0, 1), "shared_machine": True}
    doc["claims"] = claims(doc)
    doc["targets"] = targets(doc)
    return H.publish(doc, a.out, a.name, print_report, chart)


if __name__ == "__main__":
    main()
