"""Render once: TTFT and worker CPU with prompt passthrough (the worker skips templating + tokenizing) vs without.

    python -m bench.bench_passthrough [--quick] [--out DIR]

Four `trtllm-mock` workers with the routing benchmark's timing model (0.5 ms per uncached prompt token, 30 ms
per output token, speedup 2, batch 4) and a render cost: every prompt a server must template and tokenize
itself costs `RENDER_US_PER_CHAR` microseconds of real CPU per character (divided by the speedup like every
simulated time; 0.2 us/char effective, ~1.2 us per mock token, the order of a Python chat template plus a
fast tokenizer), paid on one render thread per worker, on which the mock's own tokenizer pass then runs too.
The mock renderer pays the same per-character cost (two render threads, as a renderer deployment scales
out), in both configurations: the picker always renders to route.

Two pickers run side by side on the same workers, renderer and prompts, each behind its own Envoy:

  (off)  --prompt-passthrough off: the worker gets the original body and renders it again
  (auto) --prompt-passthrough auto: the worker gets `prompt_token_ids` and skips its render

Prompts:
  short: 200-token chats, every one different (prefill dominates: little to gain, reported as such);
  long:  8k-token chats sharing one of 8 long prefixes (a multi-turn / agent shape: the prefix is cached on
         the worker the picker routes it to, so prefill is only the new tokens, while rendering must still
         template and tokenize all 8k tokens on every request).

Loads: concurrency 1 (closed loop) and the routing benchmark's saturating rate (40 req/s Poisson, open
loop). TTFT = time to the first SSE chunk (the mock sends it right after prefill). For every request index
both configurations send the same body; the generated text and token counts must be identical. Worker CPU:
the mock's own render accounting (`/mock/stats` render CPU seconds) and, independently, the worker
processes' user+system CPU from /proc, per request.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness as H

CONFIGS = {"off": "--prompt-passthrough off", "auto": "--prompt-passthrough auto"}
RENDER_US_PER_CHAR = 0.4  # before the speedup of 2: 0.2 us per character of prompt


@dataclass
class Workload:
    workers: int = 4
    short_tokens: int = 200
    long_tokens: int = 8192
    long_groups: int = 8
    question_tokens: int = 40
    max_tokens: int = 8
    c1_requests: int = 40
    rate: float = 40.0
    seconds: float = 8.0
    prefill_ms: float = 0.5
    decode_ms: float = 30.0
    speedup: float = 2.0
    max_batch: int = 4
    num_blocks: int = 4096
    repeats: int = 2  # each (prompt, load) pair this often, the two configs in alternating order

    def mock_args(self) -> list[str]:
        return ["--prefill-ms-per-token", str(self.prefill_ms), "--decode-ms-per-token", str(self.decode_ms),
                "--speedup", str(self.speedup), "--max-batch-size", str(self.max_batch), "--num-blocks",
                str(self.num_blocks), "--max-seq-len", "32768", "--render-us-per-char", str(RENDER_US_PER_CHAR)]


QUICK = Workload(workers=2, long_tokens=2048, long_groups=2, c1_requests=4, rate=20.0, seconds=1.0,
                 speedup=20.0, repeats=1)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(20000)}" for _ in range(n))  # one mock token per word


def make_bodies(w: Workload, shape: str, n: int, seed: int) -> list[bytes]:
    """`n` streaming chat bodies of one shape, deterministic in (shape, seed): both configs send these."""
    rng = random.Random(seed)
    prefixes = [words(random.Random(7000 + g), w.long_tokens - w.question_tokens) for g in range(w.long_groups)]
    out = []
    for i in range(n):
        if shape == "short":
            msgs = [{"role": "user", "content": f"q{i} " + words(rng, w.short_tokens - 8)}]
        else:
            msgs = [{"role": "system", "content": prefixes[i % w.long_groups]},
                    {"role": "user", "content": f"q{i} " + words(rng, w.question_tokens - 8)}]
        out.append(json.dumps({"model": "mock-model", "messages": msgs, "max_tokens": w.max_tokens,
                               "stream": True, "stream_options": {"include_usage": True}}).encode())
    return out


def worker_stats(workers: list[H.Proc]) -> dict[str, Any]:
    render = [H.get_json(m.url + "/mock/stats")["render"] for m in workers]
    return {"render_cpu_s": sum(r["render_cpu_seconds_total"] for r in render),
            "render_wall_s": sum(r["render_wall_seconds_total"] for r in render),
            "rendered": sum(r["rendered_requests"] for r in render),
            "pretokenized": sum(r["pretokenized_requests"] for r in render),
            "proc_cpu_s": sum(m.cpu_seconds() for m in workers)}


def wait_idle(workers: list[H.Proc], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((s := H.get_json(m.url + "/mock/stats"))["running"] == 0 and s["waiting"] == 0 for m in workers):
            return
        time.sleep(0.05)


def wait_passthrough_ready(pk: H.Proc, timeout: float = 20) -> None:
    """Until the (auto) picker has read every worker's fingerprint: /debug/score says ids would go to each."""
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "ready?"}]}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        doc = H.post_json(H.picker_url(pk) + "/debug/score", body)
        if doc["workers"] and all(x.get("prompt_passthrough", {}).get("forwarded") == "tokens"
                                  for x in doc["workers"]):
            return
        time.sleep(0.1)
    raise TimeoutError(f"passthrough not ready: {doc}")


def passthrough_counts(pk: H.Proc) -> dict[str, float]:
    text = H.get_text(H.picker_url(pk) + "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epp_prompt_passthrough_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("epp_prompt_passthrough_total"):]] = float(value)
    return out


async def c1(url: str, bodies: list[bytes]) -> tuple[list[H.Result], float]:
    return await H.closed_loop(url, lambda i: bodies[i], concurrency=1, max_requests=len(bodies),
                               max_seconds=120, stream=True)


async def saturating(url: str, bodies: list[bytes], rate: float, seconds: float) -> tuple[list[H.Result], float]:
    arrivals = H.poisson_arrivals(rate, len(bodies), random.Random(42))
    return await H.open_loop(url, arrivals, lambda i: bodies[i], max_seconds=seconds + 2, stream=True,
                             limit=2000)


def run(w: Workload) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    identical: dict[str, Any] = {}
    with H.Stack() as st:
        workers = [H.mock_worker(st, f"worker-{i}", w.mock_args()) for i in range(w.workers)]
        renderer = H.mock_renderer(st, ["--render-us-per-char", str(RENDER_US_PER_CHAR), "--speedup",
                                        str(w.speedup), "--render-threads", "2"])
        spec = H.endpoints_spec(workers)
        urls: dict[str, str] = {}
        pickers: dict[str, H.Proc] = {}
        for cfg, flags in CONFIGS.items():
            pk = H.picker(st, spec, "trtllm-render", renderer, extra=flags.split())
            H.wait_subscribed(pk, [m.address for m in workers])
            pickers[cfg] = pk
            urls[cfg] = H.envoy(st, picker_proc=pk).url + "/v1/chat/completions"
        wait_passthrough_ready(pickers["auto"])
        n_sat = int(w.rate * w.seconds)
        warm = make_bodies(w, "long", w.long_groups, seed=999)
        for shape, load, repeat in [(s, ld, k) for s in ("short", "long") for ld in ("c1", "saturating")
                                    for k in range(w.repeats)]:
                n = w.c1_requests if load == "c1" else n_sat
                bodies = make_bodies(w, shape, n, seed=zlib.crc32(f"{shape}/{load}/{repeat}".encode()))
                texts: dict[str, dict[int, tuple[str, int, int]]] = {}
                for cfg in list(CONFIGS)[:: 1 if repeat % 2 == 0 else -1]:  # neither always goes first
                    # the same starting state for both: empty caches (the picker's index follows through
                    # AllBlocksCleared), then, for long prompts, each prefix cached where this picker puts it
                    wait_idle(workers)
                    for m in workers:
                        H.post_json(m.url + "/mock/cache/clear")
                    time.sleep(0.3)
                    if shape == "long":
                        asyncio.run(c1(urls[cfg], warm))
                        wait_idle(workers)
                    before, pt_before = worker_stats(workers), passthrough_counts(pickers[cfg])
                    if load == "c1":
                        res, el = asyncio.run(c1(urls[cfg], bodies))
                    else:
                        res, el = asyncio.run(saturating(urls[cfg], bodies, w.rate, w.seconds))
                    wait_idle(workers)
                    after, pt_after = worker_stats(workers), passthrough_counts(pickers[cfg])
                    ok = [r for r in res if r.ok]
                    texts[cfg] = {i: (r.text, r.prompt_tokens, r.completion_tokens)
                                  for i, r in enumerate(res) if r.ok} if load == "c1" else {}
                    row = {"shape": shape, "load": load, "repeat": repeat, "config": cfg, **H.summarize(res, el),
                           "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0,
                           "worker_rendered": after["rendered"] - before["rendered"],
                           "worker_pretokenized": after["pretokenized"] - before["pretokenized"],
                           "worker_render_cpu_ms_per_req": 1e3 * (after["render_cpu_s"] - before["render_cpu_s"])
                           / max(len(ok), 1),
                           "worker_render_wall_ms_per_req": 1e3 * (after["render_wall_s"] - before["render_wall_s"])
                           / max(len(ok), 1),
                           "worker_proc_cpu_ms_per_req": 1e3 * (after["proc_cpu_s"] - before["proc_cpu_s"])
                           / max(len(ok), 1),
                           "picker_passthrough": {k: v - pt_before.get(k, 0.0) for k, v in pt_after.items()
                                                  if v - pt_before.get(k, 0.0) > 0}}
                    rows.append(row)
                    print(f"  {shape:5} {load:10} #{repeat} ({cfg:4}) TTFT p50 {H.fmt(row.get('ttft_p50_ms'))} p90 "
                          f"{H.fmt(row.get('ttft_p90_ms'))} ms, errors {row['errors']}, worker render CPU "
                          f"{row['worker_render_cpu_ms_per_req']:.2f} ms/req, proc CPU "
                          f"{row['worker_proc_cpu_ms_per_req']:.2f} ms/req, {row['picker_passthrough']}",
                          flush=True)
                if load == "c1":
                    same = texts["off"] == texts["auto"] and len(texts["off"]) == len(bodies)
                    prev = identical.get(shape, {"requests": 0, "identical": True})
                    identical[shape] = {"requests": prev["requests"] + len(bodies),
                                        "identical": prev["identical"] and same,
                                        "compared": "generated text, prompt_tokens, completion_tokens per "
                                                    "request index"}
    return {"rows": rows, "identical_outputs": identical, "ratios": ratios(rows)}


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(off) over (auto) per shape, load and repeat: > 1 means passthrough is faster / cheaper."""
    out = []
    for shape, load, repeat in sorted({(r["shape"], r["load"], r["repeat"]) for r in rows},
                                      key=lambda k: (k[0] != "short", k[1] != "c1", k[2])):
        key = (shape, load, repeat)
        off = next((r for r in rows if (r["shape"], r["load"], r["repeat"], r["config"]) == (*key, "off")), None)
        on = next((r for r in rows if (r["shape"], r["load"], r["repeat"], r["config"]) == (*key, "auto")), None)
        if off is None or on is None:
            continue
        out.append({"shape": shape, "load": load, "repeat": repeat,
                    "ttft_p50_off_over_auto": H.ratio(off.get("ttft_p50_ms"), on.get("ttft_p50_ms")),
                    "ttft_p90_off_over_auto": H.ratio(off.get("ttft_p90_ms"), on.get("ttft_p90_ms")),
                    "worker_render_cpu_saved_ms_per_req": off["worker_render_cpu_ms_per_req"]
                    - on["worker_render_cpu_ms_per_req"],
                    "worker_proc_cpu_saved_ms_per_req": off["worker_proc_cpu_ms_per_req"]
                    - on["worker_proc_cpu_ms_per_req"]})
    return out


def print_report(doc: dict[str, Any]) -> None:
    res = doc["result"]
    print("\nPrompt passthrough: (off) worker renders again, (auto) worker gets prompt_token_ids")
    print(H.table([[r["shape"], r["load"], r["repeat"], r["config"], r["requests"], r["errors"], r.get("ttft_p50_ms"),
                    r.get("ttft_p90_ms"), r["worker_rendered"], r["worker_pretokenized"],
                    r["worker_render_wall_ms_per_req"], r["worker_render_cpu_ms_per_req"],
                    r["worker_proc_cpu_ms_per_req"]] for r in res["rows"]],
                  ["prompt", "load", "#", "cfg", "reqs", "err", "TTFT p50", "TTFT p90", "w.render", "w.ids",
                   "render ms/req (in TTFT)", "render CPU ms/req", "proc CPU ms/req"]))
    print("\nRatios (off / auto; CPU: off - auto)")
    print(H.table([[x["shape"], x["load"], x["repeat"], x["ttft_p50_off_over_auto"], x["ttft_p90_off_over_auto"],
                    x["worker_render_cpu_saved_ms_per_req"], x["worker_proc_cpu_saved_ms_per_req"]]
                   for x in res["ratios"]],
                  ["prompt", "load", "#", "p50 off/auto", "p90 off/auto", "render CPU saved ms", "proc CPU saved ms"]))
    print("\nIdentical outputs:", json.dumps(res["identical_outputs"]))


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["result"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = [(s, ld) for s in ("short", "long") for ld in ("c1", "saturating")]
    x = range(len(keys))
    for k, (cfg, color) in enumerate((("off", "tab:red"), ("auto", "tab:green"))):
        p90 = [next((r.get("ttft_p90_ms") for r in rows if (r["shape"], r["load"], r["config"], r["repeat"])
                     == (*key, cfg, 0)), None) or 0 for key in keys]
        cpu = [next((r["worker_proc_cpu_ms_per_req"] for r in rows
                     if (r["shape"], r["load"], r["config"], r["repeat"]) == (*key, cfg, 0)), 0) for key in keys]
        axes[0].bar([i + 0.4 * k for i in x], p90, 0.4, color=color, label=f"({cfg})")
        axes[1].bar([i + 0.4 * k for i in x], cpu, 0.4, color=color, label=f"({cfg})")
    for ax, title in zip(axes, ("TTFT p90 (ms)", "worker process CPU per request (ms)"), strict=True):
        ax.set_xticks([i + 0.2 for i in x], [f"{s}\n{ld}" for s, ld in keys])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    H.save_figure(fig, "Render once: worker re-renders (off) vs gets prompt_token_ids (auto)", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = H.bench_parser(__doc__, "passthrough").parse_args(argv)
    w = QUICK if a.quick else Workload()
    print("passthrough: TTFT and worker CPU with and without prompt passthrough", flush=True)
    result = run(w)
    doc = {"bench": "passthrough", **H.meta(a.quick), "configs": CONFIGS, "workload": w.__dict__,
           "mock_args": w.mock_args(), "render_us_per_char_effective": RENDER_US_PER_CHAR / w.speedup,
           "result": result}
    return H.publish(doc, a.out, "passthrough", print_report, chart)


if __name__ == "__main__":
    main()
