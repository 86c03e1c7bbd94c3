"""Out-of-band traffic for bench_trace (issue 42 item 3): a share of the schedule reaches the workers through
another gateway the picker does not see.

A configuration named ``X-oobNN`` (``c-oob10``, ``e-oob30``, ...) runs configuration ``X`` with NN% of the
schedule's requests taken out of AIPerf's input and sent by :class:`Replayer` straight to a worker, at their
scheduled times, bypassing Envoy and the picker. What stays the same as the other configurations: the
requests, their prompts (the same ``text_input``) and their schedule; the workers still publish the KV events
of every request, so a KV-aware picker sees the out-of-band requests' blocks and a prediction-only one does not.

* **Which requests** (:func:`indices`): a seeded permutation of the schedule's indices 1..n-1, the first
  round(share x n) of it. The seed is the plan's ``oob_seed`` (not the arrival-jitter seed), so the subset is
  the same in every configuration and every repeat of a cell, and the 10% subset is part of the 30% one.
  Request 0 always stays in band: it is the replayer's clock (below). A share is of requests, not sessions: a
  conversation's turns may go through either gateway, as they would behind a DNS or L4 balancer.
* **Which worker** (:func:`split`): the other gateway is a plain round-robin one: the k-th out-of-band request
  in arrival order goes to worker k mod n, the same in every configuration.
* **When**: AIPerf's fixed schedule starts with its first request (``--fixed-schedule-auto-offset``), and that
  request (index 0) is in band, so the replayer takes as its time 0 the moment Envoy counts its first
  downstream request (its admin ``http.gateway.downstream_rq_total``, polled every 2 ms) and sends each request
  at its own offset from there. How late that clock started against AIPerf's first credit is measured after
  the run from AIPerf's per-record export (``sync_lag_ms``), so a replay that drifted shows in the row.
* **What is measured**: AIPerf's figures (TTFT, ITL, tokens/s, cached ratio) cover the picker-routed requests
  only; the replayer records each out-of-band request's TTFT (to the first content chunk, as AIPerf measures
  it) and errors, and the row adds ``all_ttft_{p50,p90}_ms`` over both sets and ``oob_ttft_p90_ms``. The
  workers' figures (``per_worker_served``, ``workers_cached_ratio``) cover every request, so
  ``routed_without_picker`` (served minus the picker's picks) is the out-of-band count.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import trace_workload as T

NAME = re.compile(r"^(?P<base>[a-z][a-z0-9]*)-oob(?P<pct>\d{1,2})$")
# the configurations an out-of-band share cannot be put beside: a restart replaces the picker mid-run, and
# the clairvoyant plan places every request of the schedule
NO_OOB = ("rs", "rs2", "rsz", "rsn", "cv")
START_STAT = r"^http\.gateway\.downstream_rq_total$"  # envoy_config's HTTP connection manager stat prefix
POLL_S = 0.002


def parse(cfg: str) -> tuple[str, float] | None:
    """``c-oob10`` -> ("c", 0.1); None for a configuration without out-of-band traffic."""
    m = NAME.match(cfg)
    if m is None or int(m["pct"]) == 0:
        return None
    return m["base"], int(m["pct"]) / 100


def base_config(cfg: str) -> str:
    p = parse(cfg)
    return p[0] if p else cfg


def name(base: str, share: float) -> str:
    return f"{base}-oob{round(share * 100)}"


def indices(n: int, share: float, seed: int = 0) -> frozenset[int]:
    """The out-of-band requests of an n-request schedule: round(share x n) of indices 1..n-1, seeded (module
    docstring); for one seed and n, a smaller share's set is part of a larger one's."""
    order = list(range(1, n))
    random.Random(f"oob-{seed}").shuffle(order)
    return frozenset(order[:min(len(order), round(share * n))])


@dataclass(frozen=True)
class Request:
    """One out-of-band request: its offset from the schedule's first arrival (wall ms), the worker it goes to."""

    index: int
    offset_ms: float
    text: str
    output_tokens: int
    worker: int


def split(records: Sequence[dict[str, Any]], chosen: frozenset[int], workers: int) -> tuple[
        list[dict[str, Any]], list[Request]]:
    """AIPerf's records (bench.trace_workload.aiperf_records) into the in-band ones, in order and with their
    timestamps unchanged, and the out-of-band requests, the k-th to worker k mod ``workers``."""
    assert 0 not in chosen, "request 0 is the replayer's clock: it stays in band"
    inband = [r for i, r in enumerate(records) if i not in chosen]
    oob = [Request(i, float(r["timestamp"]), r["text_input"], int(r["output_length"]), k % workers)
           for k, i in enumerate(sorted(chosen))
           for r in (records[i],)]
    return inband, oob


@dataclass
class Part:
    """One schedule split at one share: AIPerf's in-band input file and the replayer's requests."""

    share: float
    file: Path
    requests: list[Request]


def write_part(records: Sequence[dict[str, Any]], share: float, seed: int, workers: int, path: Path) -> Part:
    inband, oob = split(records, indices(len(records), share, seed), workers)
    return Part(share, T.write_jsonl(inband, path), oob)


def _pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default, as AIPerf reports)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Replayer(threading.Thread):
    """Sends the out-of-band requests straight to the workers, on AIPerf's clock (module docstring)."""

    def __init__(self, requests: Sequence[Request], worker_urls: Sequence[str], envoy_admin_url: str,
                 timeout_s: float, model: str = "mock-model") -> None:
        super().__init__(daemon=True, name="oob-replayer")
        self.requests, self.urls, self.admin = list(requests), list(worker_urls), envoy_admin_url
        self.timeout_s, self.model = timeout_s, model
        self.t0_ns: int | None = None
        self.results: list[dict[str, Any]] = []
        self.error: str | None = None
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # noqa: BLE001 - reported in the row: a failed replay must not pass silently
            self.error = repr(e)

    async def _main(self) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
            if not await self._wait_start(http):
                return
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            self.t0_ns = time.time_ns()
            self.results = list(await asyncio.gather(*(self._one(http, r, t0) for r in self.requests)))

    async def _wait_start(self, http: Any) -> bool:
        """Until Envoy has counted AIPerf's first request (False if cancelled or timed out first)."""
        deadline = time.monotonic() + self.timeout_s
        while not self._cancel.is_set() and time.monotonic() < deadline:
            async with http.get(self.admin + "/stats", params={"filter": START_STAT}) as resp:
                text = await resp.text()
            if any(int(line.rsplit(":", 1)[1]) > 0 for line in text.splitlines() if ":" in line):
                return True
            await asyncio.sleep(POLL_S)
        self.error = "AIPerf's first request never reached Envoy"
        return False

    async def _one(self, http: Any, r: Request, t0: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        due = t0 + r.offset_ms / 1000
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        start = loop.time()
        out: dict[str, Any] = {"index": r.index, "worker": r.worker, "sched_lag_ms": (start - due) * 1000,
                               "ttft_ms": None, "error": None, "cached_tokens": None}
        if self._cancel.is_set():
            out["error"] = "cancelled"
            return out
        # AIPerf's chat payload (aiperf.endpoints.openai_chat: one user message, streaming with usage)
        body = {"messages": [{"role": "user", "content": r.text}], "model": self.model, "stream": True,
                "max_completion_tokens": r.output_tokens, "stream_options": {"include_usage": True}}
        try:
            async with http.post(self.urls[r.worker] + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    out["error"] = f"HTTP {resp.status}"
                    return out
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if out["ttft_ms"] is None and b'"content"' in line:
                        delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                        if delta.get("content"):
                            out["ttft_ms"] = (loop.time() - start) * 1000
                    elif b'"usage": {' in line or b'"usage":{' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except Exception as e:  # noqa: BLE001 - counted as this request's error
            out["error"] = repr(e)
        if out["ttft_ms"] is None and out["error"] is None:
            out["error"] = "no content"
        return out

    def summary(self, aiperf_first_credit_ns: int | None) -> dict[str, Any]:
        """The row's ``oob`` entry: how many went where, their errors and TTFT, and how well the clocks met."""
        ttfts = [x["ttft_ms"] for x in self.results if x["ttft_ms"] is not None]
        sent = [0] * len(self.urls)
        for r in self.requests:
            sent[r.worker] += 1
        lags = [x["sched_lag_ms"] for x in self.results]
        return {"requests": len(self.requests), "completed": len(ttfts), "sent_per_worker": sent,
                "errors": len(self.requests) - len(ttfts), "error": self.error,
                "ttft_p50_ms": _pct(ttfts, 50), "ttft_p90_ms": _pct(ttfts, 90),
                "sched_lag_p99_ms": _pct(lags, 99),
                "sync_lag_ms": (self.t0_ns - aiperf_first_credit_ns) / 1e6
                if self.t0_ns is not None and aiperf_first_credit_ns is not None else None}

    def ttfts(self) -> list[float]:
        return [x["ttft_ms"] for x in self.results if x["ttft_ms"] is not None]


def profiling_records(artifacts: Path) -> tuple[list[dict[str, Any]], int | None]:
    """AIPerf's per-record export (``profile_export.jsonl``): the profiling phase's records, and its first
    credit's time (epoch ns), the schedule's time 0 on the machine's clock."""
    records: list[dict[str, Any]] = []
    first: int | None = None
    path = artifacts / "profile_export.jsonl"
    if not path.exists():
        return records, first
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta = rec.get("metadata") or {}
        if meta.get("benchmark_phase", "profiling") != "profiling":
            continue
        c = meta.get("credit_issued_ns")
        if c is not None:
            first = c if first is None else min(first, c)
        records.append(rec)
    return records, first


def aiperf_records(artifacts: Path) -> tuple[list[float], int | None]:
    """AIPerf's per-request TTFTs (ms) of the profiling phase and its first credit's time (epoch ns)."""
    records, first = profiling_records(artifacts)
    ttfts = [float(v) for rec in records
             if (v := ((rec.get("metrics") or {}).get("time_to_first_token") or {}).get("value")) is not None]
    return ttfts, first


def figures(replayer: Replayer, artifacts: Path) -> dict[str, Any]:
    """The row's out-of-band figures: ``oob`` (Replayer.summary) and the TTFT percentiles over every request
    (AIPerf's picker-routed ones and the out-of-band ones together)."""
    inband, first = aiperf_records(artifacts)
    oob = replayer.ttfts()
    both = inband + oob
    return {"oob": replayer.summary(first), "oob_requests": len(replayer.requests),
            "oob_ttft_p90_ms": _pct(oob, 90), "all_ttft_p50_ms": _pct(both, 50), "all_ttft_p90_ms": _pct(both, 90)}
