"""One flooding KV-event publisher against the real picker process, with its defaults (issue 43 item 2).

    python -m bench.bench_flood [--quick] [--out DIR] [--repeats 3] [--seconds 8] [--tokens 8192]
                                [--flood-rate 2000] [--pin]

The picker as a user runs it (`bench.picker_host`: the product plus timing probes, trtllm-render against the
mock renderer, every other flag at its default) over 8 simulated workers (`bench.kvpub`: real ZMQ PUB sockets,
TensorRT-LLM's wire form, 10 batches/s each). Requests are scored through the ext_proc port (4 concurrent
clients) for `--seconds`, then again while worker 0 also sends fresh 64-block chains as fast as its process can
(`kvpub`'s `flood`, `--flood-rate` batches/s: 2,000 x 64 blocks = 128k blocks/s, about a hundred times what
an engine publishes). The figure is decisions/s flooded over unflooded, with the round trip p99 beside it.
`--pin` puts the picker (every thread) on CPU 0 and everything else (the publisher, the renderer, this
client, an `apart` picker's shard) on CPU 1: on a 2-core machine the flooding process otherwise takes the
picker's core, and the figure measures the machine rather than the picker.

Configurations, each a separate picker process, their order rotated from repeat to repeat (the first run of a
machine's session is often faster):
  default    the defaults: in-process ingest, each worker paced to `--kv-ingest-worker-cpu-share` (0.1)
  unpaced    `--kv-ingest-worker-cpu-share 1000`: no effective budget (what the default did before stop 50)
  apart      `--kv-ingest apart` (one ingest shard, paced there)

Target (the hostile issue's acceptance test): with the defaults, a flood keeps >= 80% of the unflooded
throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.bench_ingest_apart import _pin as pin
from bench.bench_scale import DOC_BLOCKS, bodies_for, score_loop
from bench.kvpub import make_doc

CONFIGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "unpaced": ("--kv-ingest-worker-cpu-share", "1000"),
    "apart": ("--kv-ingest", "apart"),
}
WORKERS = 8
CONCURRENCY = 4


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def run_one(name: str, seconds: float, tokens: int, flood_rate: float, pinned: bool) -> dict[str, Any]:
    doc = make_doc(DOC_BLOCKS, 1)
    bodies = bodies_for(doc, tokens, 8, random.Random(7))
    with H.Stack() as st:
        pub = H.kv_publisher(st, WORKERS, rate=10.0, doc_blocks=DOC_BLOCKS, cap=512)
        spec, addrs = H.fake_worker_spec(pub)
        rend = H.mock_renderer(st)
        pk = H.picker(st, spec, "trtllm-render", rend, extra=(*H.SIMULATED_WORKER_FLAGS, *CONFIGS[name]),
                      argv0=[sys.executable, "-m", "bench.picker_host"])
        H.wait_subscribed(pk, addrs, timeout=60)
        H.wait_warm(pk, addrs, H.kvpub_command(pub, "go")["warm"], timeout=60, poll=0.2)
        if pinned and (2 <= (os.cpu_count() or 1)):
            for p in (pub, rend):
                if p.pid is not None:
                    pin(p.pid, 1)
            for c in children(pk.pid or 0):
                pin(c, 1)
            pin(os.getpid(), 1)
            pin(pk.pid or 0, 0)
        time.sleep(0.5)
        row: dict[str, Any] = {"config": name, "flags": list(CONFIGS[name])}
        for phase in ("unflooded", "flooded"):
            if phase == "flooded":
                H.kvpub_command(pub, f"flood {flood_rate:g}")
                time.sleep(0.5)
            cpu0, t0 = pk.cpu_seconds(), time.monotonic()
            rtt, el, rejected = asyncio.run(score_loop(pk.port, bodies, CONCURRENCY, 10_000_000, seconds))
            row[phase] = {"decisions": len(rtt), "rejected": rejected, "per_s": round(len(rtt) / el, 1),
                          "round_trip": H.pcts_ms(rtt),
                          "picker_cpu_util": round((pk.cpu_seconds() - cpu0) / (time.monotonic() - t0), 3)}
        row["flood_batches_sent"] = H.kvpub_command(pub, "calm")["flooded"]
        w0 = H.get_json(H.picker_url(pk) + "/debug/kv")["workers"].get(addrs[0], {})
        row["flooder_throttled"] = w0.get("ingest_throttled")
        row["flooder_blocks_indexed"] = w0.get("blocks_indexed")
        row["throughput_ratio"] = round(row["flooded"]["per_s"] / row["unflooded"]["per_s"], 3)
        p99 = (row["flooded"]["round_trip"]["p99_ms"], row["unflooded"]["round_trip"]["p99_ms"])
        row["p99_ratio"] = H.ratio(*p99)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "flood")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="per phase (unflooded, flooded)")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length of the scored requests")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which of: " + ", ".join(CONFIGS))
    ap.add_argument("--flood-rate", type=float, default=2000.0, help="flood batches/s (0: as fast as it can)")
    ap.add_argument("--pin", action="store_true", help="the picker on CPU 0, everything else on CPU 1")
    a = ap.parse_args(argv)
    names = a.configs.split(",")
    repeats, seconds = (1, 1.5) if a.quick else (a.repeats, a.seconds)
    rows: list[dict[str, Any]] = []
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            row = run_one(name, seconds, a.tokens, a.flood_rate, a.pin)
            row["repeat"] = r
            rows.append(row)
            print(f"  repeat {r} {name:>8}: {row['unflooded']['per_s']:.0f} -> {row['flooded']['per_s']:.0f} "
                  f"decisions/s = {row['throughput_ratio']:.3f}, p99 x{row['p99_ratio']}, flood batches sent "
                  f"{row['flood_batches_sent']}, flooder throttled {row['flooder_throttled']}, picker CPU "
                  f"{row['unflooded']['picker_cpu_util']:.2f} -> {row['flooded']['picker_cpu_util']:.2f}", flush=True)
    summary = {}
    for name in names:
        ratios = [x["throughput_ratio"] for x in rows if x["config"] == name]
        summary[name] = {"throughput_ratio_median": statistics.median(ratios), "min": min(ratios),
                         "max": max(ratios), "runs": len(ratios)}
    doc = {"bench": "flood", **H.meta(a.quick), "workers": WORKERS, "concurrency": CONCURRENCY,
           "seconds": seconds, "prompt_tokens": a.tokens, "flood_rate": a.flood_rate, "pinned": a.pin, "rows": rows, "summary": summary,
           "target": "default throughput_ratio >= 0.8"}
    H.write_json(Path(a.out) / "flood.json", doc)
    for name, s in summary.items():
        print(f"{name:>8}: flooded / unflooded decisions/s median {s['throughput_ratio_median']:.3f} "
              f"({s['min']:.3f}-{s['max']:.3f}, {s['runs']} runs)")
    return doc


if __name__ == "__main__":
    main()
