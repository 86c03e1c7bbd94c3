"""Shedding under attack and overload, through a real Envoy (issue 31 items 1 and 3).

    python -m bench.bench_shedding [--quick] [--out DIR]

Two scenarios, each with its baseline measured in the same run:

  slow clients   the picker's in-flight cap is CAP (64); 10 x CAP clients open a request through Envoy
                 (FULL_DUPLEX_STREAMED), send their headers and a few body bytes, and stall. Normal clients'
                 success rate and throughput are measured before (unattacked) and during the stall; the
                 stalled clients must end with 408 at --request-body-timeout-ms.
  overload       150 clients in a closed loop against the same cap, on workers slow enough that requests
                 pile up: every answer must be 200, 429 or 503 (an OpenAI-shaped body, and retry-after on
                 503); a 500 means some layer shed the load by failing the ext_proc stream.

The benchmark uses the project's own harness; it runs on any checkout whose `bench.harness` has the same
builders, so the same file measures an older picker (`PYTHONPATH=<old checkout> <old venv>/bin/python
bench/bench_shedding.py`), which is how the before/after figures in bench/README.md were taken.
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H

CAP = 64
BODY_TIMEOUT_MS = 6000
SLOW_WORKER = ["--speedup", "1", "--decode-ms-per-token", "8"]  # ~0.2 s a request: 150 clients pile up
BODY = json.dumps({"model": "mock-model", "max_tokens": 24,
                   "messages": [{"role": "user", "content": "a question that is short"}]}).encode()


def stall(port: int) -> socket.socket:
    """A client that sends its headers and 10 of 1,000 announced body bytes, then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=BODY_TIMEOUT_MS / 1000 + 30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 1000\r\n\r\n" + b'{"model":"')
    return s


def status_of(s: socket.socket) -> int:
    try:
        head = s.recv(64)
    except OSError:
        return 0
    finally:
        s.close()
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def closed(url: str, concurrency: int, seconds: float, max_requests: int) -> dict[str, Any]:
    res, el = asyncio.run(H.closed_loop(url, lambda i: BODY, concurrency=concurrency, max_requests=max_requests,
                                        max_seconds=seconds))
    statuses = collections.Counter(r.status if not r.error or r.status else "error" for r in res)
    ok = sum(1 for r in res if r.ok)
    return {"sent": len(res), "ok": ok, "success": ok / max(len(res), 1), "ok_per_s": ok / el,
            "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)}, "seconds": round(el, 2),
            "errors": [r.error for r in res if r.status not in (200, 429, 503)][:3]}


def slow_clients(quick: bool) -> dict[str, Any]:
    secs = 4.0 if quick else 10.0
    stalled_n = 10 * CAP
    with H.Stack() as st:
        workers = [H.mock_worker(st, f"worker-{i}", SLOW_WORKER) for i in range(2)]
        pk = H.picker(st, H.endpoints_spec(workers), extra=["--request-body-timeout-ms", str(BODY_TIMEOUT_MS)])
        env = H.envoy(st, picker_proc=pk)
        url = env.url + "/v1/chat/completions"
        closed(url, 8, 1.0, 50)  # warm-up
        base = closed(url, 8, secs, 100_000)
        t0 = time.monotonic()
        socks = [stall(env.port) for _ in range(stalled_n)]
        time.sleep(0.5)
        attacked = closed(url, 8, secs, 100_000)
        ends = collections.Counter()
        end_s: list[float] = []
        for s in socks:
            ends[status_of(s)] += 1
            end_s.append(time.monotonic() - t0)
        return {"cap": CAP, "stalled_clients": stalled_n, "body_timeout_s": BODY_TIMEOUT_MS / 1000,
                "unattacked": base, "attacked": attacked,
                "success_ratio": round(attacked["success"] / max(base["success"], 1e-9), 3),
                "throughput_ratio": round(attacked["ok_per_s"] / max(base["ok_per_s"], 1e-9), 3),
                "stalled_ended": {str(k): v for k, v in ends.items()},
                "stalled_last_end_s": round(max(end_s), 2) if end_s else None}


def overload(quick: bool) -> dict[str, Any]:
    secs = 5.0 if quick else 20.0
    with H.Stack() as st:
        workers = [H.mock_worker(st, f"worker-{i}", SLOW_WORKER) for i in range(2)]
        pk = H.picker(st, H.endpoints_spec(workers))
        env = H.envoy(st, picker_proc=pk)
        url = env.url + "/v1/chat/completions"
        res = closed(url, 150, secs, 1_000_000)
        res["clients"] = 150
        res["cap"] = CAP
        res["other_than_200_429_503"] = sum(v for k, v in res["statuses"].items() if k not in ("200", "429", "503"))
        return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "shedding")
    a = ap.parse_args(argv)
    H.PICKER_MAX_INFLIGHT = CAP  # the picker's cap, and the Envoy breaker the project's config derives from it
    print("slow clients:", flush=True)
    sc = slow_clients(a.quick)
    print(json.dumps(sc, indent=1), flush=True)
    print("overload:", flush=True)
    ov = overload(a.quick)
    print(json.dumps(ov, indent=1), flush=True)
    doc = {"bench": "shedding", **H.meta(a.quick), "slow_clients": sc, "overload": ov,
           "targets": {"normal_success_under_10x_stall_ge_0.9": {"measured": sc["success_ratio"],
                                                                  "met": sc["success_ratio"] >= 0.9},
                       "stalled_end_with_408": {"measured": sc["stalled_ended"],
                                                "met": set(sc["stalled_ended"]) == {"408"}},
                       "overload_only_200_429_503": {"measured": ov["other_than_200_429_503"],
                                                     "met": ov["other_than_200_429_503"] == 0}}}
    H.write_json(Path(a.out) / "shedding.json", doc)
    H.print_targets(doc)
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
