"""Judge a routing default on the workload suite by the rule declared before measuring (issue 42).

    python -m bench.suite_judge DIR_OR_TRACE_JSON... [--config c] [--json OUT] [--markdown]

Reads `bench_trace` documents (`trace.json`, as `bench_suite` records them per workload, or any run with
`--workload`) and answers, per workload, capacity and load, for one configuration (default (c), the picker's
defaults) against load-only (b) and prediction-only (e):

- **loses**: on TTFT p90 (the primary metric) its median is more than 5% worse than a baseline's and the runs'
  spreads are disjoint (the claim rule of trace_stats: every run of one better than every run of the other);
  output tokens/s (the secondary metric) is judged the same way and reported beside it;
- **wins**: a claim in its favour on TTFT p90 (disjoint spreads, any margin);
- **worker share**: the smallest share of the requests any worker served, over the cell's runs; when the pool
  is loaded (at least one request in flight per worker on average, from the measured token rate and mean
  inter-token latency: Little's law) every worker must serve at least 15%.

The verdict is the issue's: the default loses no cell, wins on every workload with reuse (no-reuse is the
control: a tie there is the expected result), and leaves no worker under 15% of a loaded pool. Nothing is
measured here: it only reads what the runs recorded, so it can be re-run on old recordings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import trace_stats as S
from bench.bench_trace import compare

PRIMARY, SECONDARY = "ttft_p90_ms", "output_tokens_per_s"
LOSS_MARGIN = 0.05  # "more than 5% worse"
MIN_SHARE = 0.15  # every worker of four serves at least 15% of a loaded pool's requests
BASELINES = ("b", "e")
NO_REUSE = {"no-reuse"}


def documents(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Every trace.json named or found under the named folders."""
    out = []
    for p in map(Path, paths):
        files = sorted(p.rglob("trace.json")) if p.is_dir() else [p]
        out += [json.loads(f.read_text()) for f in files]
    return out


def _values(cell: dict[str, Any], metric: str) -> list[float]:
    return [float(r[metric]) for r in cell["runs"] if r.get(metric) is not None]


def worker_shares(cell: dict[str, Any]) -> list[float]:
    """Per run, the smallest share of the requests one worker served."""
    shares = []
    for r in cell["runs"]:
        served = list((r.get("per_worker_served") or {}).values())
        if served and sum(served) > 0:
            shares.append(min(served) / sum(served))
    return shares


def min_share(cell: dict[str, Any]) -> float | None:
    """The smallest share of the requests one worker served, in the cell's worst run (the rule is strict:
    every run of a loaded pool must use every worker)."""
    shares = worker_shares(cell)
    return min(shares) if shares else None


def in_flight_per_worker(cell: dict[str, Any]) -> float | None:
    """Requests decoding at once per worker, by Little's law on the token stream: output tokens/s x the mean
    inter-token latency (both wall time, as AIPerf measures them) over the workers, the median over the runs.
    It leaves out requests still waiting for their first token, so it understates a queued pool's load."""
    vals = []
    for r in cell["runs"]:
        tps, itl = r.get("output_tokens_per_s"), r.get("itl_avg_ms")
        served = r.get("per_worker_served") or {}
        if tps is None or itl is None or not served:
            continue
        vals.append(tps * itl / 1000 / len(served))
    return statistics.median(vals) if vals else None


def judge(docs: Sequence[dict[str, Any]], config: str = "c", also: Sequence[str] = ()) -> dict[str, Any]:
    """Every (workload, capacity, load) cell of `config` judged against the baselines present; `also`:
    configurations compared beside them without being baselines of the rule (round-robin, "a", is left out
    unless named: it is no baseline, and most recordings do not have it)."""
    rows: list[dict[str, Any]] = []
    for doc in docs:
        w = doc["result"].get("workload")
        workload = w["name"] if isinstance(w, dict) else (w or "mooncake")
        cells = doc["result"]["cells"]
        for x in (c for c in cells if c["config"] == config):
            row: dict[str, Any] = {"workload": workload, "capacity": x["capacity"], "offered_rps": x["offered_rps"],
                                   "runs": len(x["runs"]), PRIMARY: S.spread(_values(x, PRIMARY)),
                                   SECONDARY: S.spread(_values(x, SECONDARY)), "min_worker_share": min_share(x),
                                   "min_worker_share_median": (statistics.median(worker_shares(x))
                                                               if worker_shares(x) else None),
                                   "in_flight_per_worker": in_flight_per_worker(x), "against": {}}
            extra = tuple(k for k in doc["configs"] if k not in (config, *BASELINES) and (k != "a" or "a" in also))
            for base in BASELINES + extra:
                b = next((c for c in cells if c["config"] == base and c["capacity"] == x["capacity"]
                          and c["offered_rps"] == x["offered_rps"]), None)
                if b is None:
                    continue
                verdict = {}
                for m in (PRIMARY, SECONDARY):
                    k = compare(x, b, m)  # oriented: > 1 = x better; the claim only on disjoint spreads
                    ratio, claim = k["median_ratio"], k["claim"]
                    verdict[m] = {"median_ratio": ratio, "claim": claim, "base": S.spread(_values(b, m)),
                                  "loses": claim is not None and claim < 1 / (1 + LOSS_MARGIN),
                                  "wins": claim is not None and claim > 1}
                verdict["min_worker_share"] = min_share(b)
                row["against"][base] = verdict
            rows.append(row)
    rows.sort(key=lambda r: (r["workload"], r["capacity"], r["offered_rps"]))
    losses = [r for r in rows if any(v[PRIMARY]["loses"] for b, v in r["against"].items() if b in BASELINES)]
    workloads = sorted({r["workload"] for r in rows})
    wins = {w: sorted({b for r in rows if r["workload"] == w for b, v in r["against"].items()
                       if b in BASELINES and v[PRIMARY]["wins"]}) for w in workloads}
    idle = [r for r in rows if (r["in_flight_per_worker"] or 0) >= 1 and r["min_worker_share"] is not None
            and r["min_worker_share"] < MIN_SHARE]
    return {"config": config, "rule": {"primary": PRIMARY, "secondary": SECONDARY, "loss_margin": LOSS_MARGIN,
                                       "min_worker_share": MIN_SHARE, "baselines": list(BASELINES)},
            "cells": rows, "losses": [_key(r) for r in losses],
            "wins_by_workload": wins,
            "workloads_with_reuse_without_a_win": [w for w in workloads if w not in NO_REUSE and not wins[w]],
            "idle_worker_cells": [_key(r) for r in idle],
            "holds": not losses and not idle and all(wins[w] for w in workloads if w not in NO_REUSE)}


def _key(r: dict[str, Any]) -> str:
    return f"{r['workload']} {r['capacity']} {r['offered_rps']:g} req/s"


def _fmt(s: S.Spread | None, digits: int = 0) -> str:
    return "-" if s is None else f"{s.median:.{digits}f} ({s.min:.{digits}f}-{s.max:.{digits}f})"


def _mark(v: dict[str, Any]) -> str:
    if v["claim"] is None:
        return f"{v['median_ratio']:.2f}" if v["median_ratio"] is not None else "-"
    return f"**{v['claim']:.2f}**" + (" LOSS" if v["loses"] else "")


def markdown(result: dict[str, Any]) -> str:
    """The README's table: every cell, wins and losses alike (ratios > 1 = the judged config better; bold =
    claimed, spreads disjoint)."""
    others = sorted({b for r in result["cells"] for b in r["against"]})
    head = ["workload", "cap", "req/s", "n", f"({result['config']}) TTFT p90 ms", "out tok/s",
            "least-used worker's share, median (worst run)"]
    for b in others:
        head += [f"vs ({b}) TTFT p90", f"vs ({b}) tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["cells"]:
        share, med = r["min_worker_share"], r["min_worker_share_median"]
        cols = [r["workload"], r["capacity"], f"{r['offered_rps']:g}", str(r["runs"]), _fmt(r[PRIMARY]),
                _fmt(r[SECONDARY]), "-" if share is None else f"{med:.2f} ({share:.2f})"]
        for b in others:
            v = r["against"].get(b)
            cols += ["-", "-"] if v is None else [_mark(v[PRIMARY]), _mark(v[SECONDARY])]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="trace.json files or folders holding them")
    ap.add_argument("--config", default="c", help="the configuration judged (default: c, the picker's defaults)")
    ap.add_argument("--also", default="", help="comma-separated configurations compared beside the baselines, "
                    "not judged by the rule (a: round-robin)")
    ap.add_argument("--json", help="write the verdict here")
    ap.add_argument("--markdown", action="store_true", help="print the table for bench/README.md")
    a = ap.parse_args(argv)
    result = judge(documents(a.paths), a.config, tuple(x for x in a.also.split(",") if x))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2, default=lambda s: s.as_dict()))
    if a.markdown:
        print(markdown(result))
    print(f"losses: {result['losses'] or 'none'}")
    print(f"wins by workload: {result['wins_by_workload']}")
    print(f"idle-worker cells: {result['idle_worker_cells'] or 'none'}")
    print(f"holds: {result['holds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
