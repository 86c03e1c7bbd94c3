"""The request path before and after a change, in one run: the guide's three figures for two checkouts.

    python -m bench.compare_trees OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--requests 3000]

Each checkout must have its own `.venv` (`make install` there). Rounds alternate old and new so that a busy
machine weighs on both alike; each round measures, in that checkout's own code:

  - the c=32 throughput ratio: Envoy + picker (render + KV scoring, config c of bench_overhead) against
    Envoy round-robin without a picker (config a), same mock workers, same round;
  - the picker's CPU per request at c=32 (its process CPU time over the requests answered);
  - the in-process decision p50 (`bench_overhead`'s stubbed-render decision over 8 workers, 8k tokens).

The medians over the rounds are printed with the new/old ratio of each; the change is within the guide's
bound when every figure is within 5% (throughput ratio not lower, CPU and p50 not higher).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import asyncio, json, sys
from bench import harness as H
from bench.bench_overhead import FAST_MOCK, _inproc, make_bodies
n = int(sys.argv[1])
make = make_bodies(120)
out = {}
with H.Stack() as outer:
    workers = [H.mock_worker(outer, f"worker-{i}", FAST_MOCK) for i in range(2)]
    renderer = H.mock_renderer(outer)
    for cfg in ("a", "c"):
        with H.Stack() as st:
            pk = None
            if cfg == "a":
                env = H.envoy(st, upstreams=[w.address for w in workers])
            else:
                pk = H.picker(st, H.endpoints_spec(workers), "trtllm-render", renderer)
                H.wait_subscribed(pk, [w.address for w in workers])
                env = H.envoy(st, picker_proc=pk)
            url = env.url + "/v1/chat/completions"
            asyncio.run(H.closed_loop(url, make, concurrency=8, max_requests=300, max_seconds=5))
            cpu0 = pk.cpu_seconds() if pk else 0.0
            res, el = asyncio.run(H.closed_loop(url, make, concurrency=32, max_requests=n, max_seconds=30))
            row = H.summarize(res, el)
            ok = max(1, row["requests"] - row["errors"])
            out[cfg] = {"rps": row["rps"], "errors": row["errors"],
                        "picker_cpu_us": (pk.cpu_seconds() - cpu0) / ok * 1e6 if pk else None}
dec = asyncio.run(_inproc(8, 8192, 1000))
print("RESULT " + json.dumps({"ratio_c32": out["c"]["rps"] / out["a"]["rps"], "errors": out["c"]["errors"],
                              "picker_cpu_us": out["c"]["picker_cpu_us"],
                              "decision_p50_ms": dec["decide_without_render"]["p50_ms"]}))
"""


def one(tree: Path, requests: int) -> dict[str, float]:
    p = subprocess.run([str(tree / ".venv" / "bin" / "python"), "-c", CHILD, str(requests)], cwd=tree,
                       capture_output=True, text=True, timeout=900)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{tree}: no result\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return json.loads(line[7:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000)
    a = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(a.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for name in order:
            res = one(a.old if name == "old" else a.new, a.requests)
            runs[name].append(res)
            print(f"round {r + 1} {name}: {res}", flush=True)
    summary = {}
    for key in ("ratio_c32", "picker_cpu_us", "decision_p50_ms"):
        old = statistics.median(x[key] for x in runs["old"])
        new = statistics.median(x[key] for x in runs["new"])
        summary[key] = {"old": round(old, 4), "new": round(new, 4), "new_over_old": round(new / old, 3)}
    print(json.dumps({"runs": runs, "medians": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
