"""Per-process CPU and context switches per request of a `bench_trace --proc-counters` run, by config.

`python bench/results/sync-issue47-share/pc_summary.py DIR/trace.json`: medians over a config's runs of
each group's CPU ms and voluntary context switches per request (picker0: the serving picker; peers: the
other pickers; workers: the four mocks), and with --envoy-timings the per-request TTFT deltas against (c).
"""

from __future__ import annotations

import json
import statistics
import sys

KEYS = ("picker0", "peers", "nats", "envoy", "workers", "renderer", "total")
DELTAS = ("vs_c_dttft_ms", "vs_c_dto_upstream_ms", "vs_c_dworker_first_body_ms", "vs_c_rest_ms")


def group(name: str) -> str:
    if name.startswith("worker"):
        return "workers"
    if name.startswith("envoy"):
        return "envoy"
    if name == "picker":
        return "picker0"
    if name.startswith("picker#"):
        return "peers"
    return name


def main(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    rows: dict[str, list[tuple[dict, dict[str, list[float]]]]] = {}
    for c in d["result"]["cells"]:
        for r in c["runs"]:
            g: dict[str, list[float]] = {}
            for k, v in (r.get("proc_counters") or {}).items():
                x = g.setdefault(group(k), [0.0, 0.0])
                x[0] += v["cpu_ms_per_req"]
                x[1] += v["vcsw_per_req"]
            g["total"] = [sum(v[i] for v in g.values()) for i in range(2)]
            rows.setdefault(c["config"], []).append((r, g))
    print("cfg | TTFT p50 | " + " | ".join(f"{k} cpu ms/req, vcsw/req" for k in KEYS))
    for cfg, runs in rows.items():
        ttft = statistics.median(r["ttft_p50_ms"] for r, _ in runs)
        cells = []
        for k in KEYS:
            cpu = [g[k][0] for _, g in runs if k in g]
            vcsw = [g[k][1] for _, g in runs if k in g]
            cells.append(f"{statistics.median(cpu):.2f}, {statistics.median(vcsw):.1f}" if cpu else "-")
        print(f"{cfg} | {ttft:.1f} | " + " | ".join(cells))
        for key in DELTAS:
            vals = [r[key] for r, _ in runs if r.get(key) is not None]
            if vals:
                print(f"   {key}: {[round(x, 2) for x in vals]} median {statistics.median(vals):.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
