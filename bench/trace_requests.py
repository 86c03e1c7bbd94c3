"""Request by request: where configurations lose time against (c), pooled over the seeds of a bench_trace run.

    python -m bench.trace_requests WORK_DIR --configs r3n,c3i [--capacity 75] [--rate 5]

Reads the per-request records that `bench_trace --envoy-timings` leaves in its work dir
(``requests-<cfg>-<cap>-<rate>rps-s<seed>.jsonl``, or the same gzipped as results keep them: AIPerf's TTFT and cached tokens joined with Envoy's timing
log). The same seed replays the same requests in the same order, so each request of a configuration is paired
with the same request under (c). Routing: how many went to the same worker with the same cached tokens, and
how many got fewer cached tokens. Overhead, over the pairs with the same worker and cached tokens (equal
placement): the median difference of the TTFT and of its legs as Envoy saw them: `to_upstream` (Envoy and the
picker: the stream opened, the body sent, the decision back, the request forwarded), `worker_headers` and
`worker_first_body` (the worker from the request's first byte to its response headers / first body bytes) and
`rest` (the TTFT less those: the client's legs to and from Envoy). bench_trace's own rows carry the per-seed
medians (request_deltas); this pools the requests of every seed, which the per-seed medians cannot show.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[int, dict[str, Any]]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return {r["i"]: r for r in map(json.loads, text.splitlines()) if r.get("ttft_ms") is not None}


def legs(r: dict[str, Any]) -> dict[str, float] | None:
    """The TTFT and its legs in ms; None when Envoy did not time the request."""
    keys = ("to_upstream_us", "upstream_headers_us", "upstream_first_body_us")
    if any(r.get(k) is None for k in keys):
        return None
    up, hd, fb = (r[k] / 1000 for k in keys)
    return {"ttft": r["ttft_ms"], "to_upstream": up, "worker_headers": hd, "worker_first_body": fb,
            "rest": r["ttft_ms"] - up - fb}


def seed_of(path: Path) -> int:
    return int(path.name.split("rps-s", 1)[1].split(".", 1)[0])


def compare(work: Path, cfg: str, cap: str, rate: str, seeds: set[int] | None = None) -> dict[str, Any] | None:
    """(c) against ``cfg`` over the seeds in the work dir (only ``seeds`` when given)."""
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    used = 0
    for base_file in sorted([*work.glob(f"requests-c-{cap}-{rate}rps-s*.jsonl"),
                             *work.glob(f"requests-c-{cap}-{rate}rps-s*.jsonl.gz")]):
        other = work / base_file.name.replace("requests-c-", f"requests-{cfg}-", 1)
        if not other.exists() or (seeds is not None and seed_of(base_file) not in seeds):
            continue
        used += 1
        base, x = load(base_file), load(other)
        pairs += [(base[i], x[i]) for i in base if i in x]
    if not pairs:
        return None
    equal = [(b, x) for b, x in pairs if b["worker"] == x["worker"] and b["cached_tokens"] == x["cached_tokens"]]
    timed = [(lb, lx) for lb, lx in ((legs(b), legs(x)) for b, x in equal) if lb is not None and lx is not None]
    out: dict[str, Any] = {
        "config": cfg, "seeds": used, "requests": len(pairs), "same_worker_and_cached": len(equal),
        "same_cached": sum(1 for b, x in pairs if b["cached_tokens"] == x["cached_tokens"]),
        "less_cached": sum(1 for b, x in pairs if x["cached_tokens"] < b["cached_tokens"]),
        "more_cached": sum(1 for b, x in pairs if x["cached_tokens"] > b["cached_tokens"]),
        "ttft_p50_c_ms": statistics.median(b["ttft_ms"] for b, _ in pairs),
        "ttft_p50_ms": statistics.median(x["ttft_ms"] for _, x in pairs),
        "other_worker_dttft_ms": statistics.median(x["ttft_ms"] - b["ttft_ms"] for b, x in pairs
                                                   if b["worker"] != x["worker"]) if len(equal) < len(pairs) else None}
    for leg in ("ttft", "to_upstream", "worker_headers", "worker_first_body", "rest"):
        d = [lx[leg] - lb[leg] for lb, lx in timed]
        out[f"d_{leg}_ms"] = round(statistics.median(d), 3) if d else None
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", help="a bench_trace --envoy-timings work dir")
    ap.add_argument("--configs", required=True, help="comma-separated configurations to pair with (c)")
    ap.add_argument("--capacity", default="75")
    ap.add_argument("--rate", default="5")
    ap.add_argument("--seeds", help="comma-separated seeds to pool (default: every seed present)")
    a = ap.parse_args(argv)
    seeds = {int(x) for x in a.seeds.split(",")} if a.seeds else None
    rows = [r for r in (compare(Path(a.work), c, a.capacity, a.rate, seeds) for c in a.configs.split(",")) if r]
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    return rows


if __name__ == "__main__":
    main()
