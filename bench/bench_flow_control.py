"""Flow control at twice the pool's capacity (issue 18).

    python -m bench.bench_flow_control [--quick] [--out DIR]

Two `trtllm-mock` worker processes, each a batch of 8 (the mock does not slow down with batch size, so the
batch cap is its compute limit), 0.5 ms per uncached prompt token and 10 ms per output token; every request
has its own prompt of 300-900 tokens (uniform; no cache hits, so the prefill alone is 150-450 ms) and asks
for 2-6 output tokens, so the pool's nominal capacity is C = 2 x 8 / ~0.34 s ~ 47 req/s. No scheduler can start a request before a
batch slot frees: at saturation a high-priority request waits on average for the next of C slot releases
per second (~1/C = 21 ms) on top of its prefill, which is why the prefill is long against 1/C here, as it
is on real engines whose batches are far larger than the mock's 8. Poisson arrivals mix two priority bands: 25%
high (objective `premium`, priority 10) and 75% low (objective `standard`, 0) split between two tenants
(`x-gateway-inference-fairness-id`) in a 10:1 request ratio. Streaming requests; TTFT = first SSE chunk.

  (q) the picker with flow control (`--flow-control --queue-depth-threshold 0`: a worker counts as
      saturated once its batch is full, so nothing waits inside an engine, where a high-priority request
      could not overtake), default TTL and queue bound, worker metrics every 50 ms
  (n) today's picker at the same load: no queue, no worker metrics (every request goes straight to the
      least-loaded worker and queues in its engine)

Each at half the capacity (0.5 C) and at twice it (2 C). Reported: high-band TTFT p90 at 2 C over its value
at 0.5 C (target <= 1.5); requests neither served nor answered 429 with an `x-llm-d-request-dropped-reason`
(target 0); and, sampling GET /debug/flow every 20 ms, each low-band tenant's share of the low band's
dispatches over the intervals that start with both tenants queued (target 40-60% each).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import harness as H

OBJECTIVES = "premium: 10\nstandard: 0\n"
CLASSES = ("high", "tenant-a", "tenant-b")
HEADERS = {
    "high": {"x-gateway-inference-objective": "premium", "x-gateway-inference-fairness-id": "premium-users"},
    "tenant-a": {"x-gateway-inference-objective": "standard", "x-gateway-inference-fairness-id": "tenant-a"},
    "tenant-b": {"x-gateway-inference-objective": "standard", "x-gateway-inference-fairness-id": "tenant-b"},
}
CONFIGS = {"q": "picker + flow control", "n": "picker, no queue (today)"}
DROPPED = "x-llm-d-request-dropped-reason"


@dataclass
class Workload:
    workers: int = 2
    batch: int = 8
    prompt_tokens: int = 600
    prefill_ms: float = 0.5
    decode_ms: float = 10.0
    max_tokens: int = 4
    high_share: float = 0.25
    tenant_ratio: tuple[int, int] = (10, 1)
    loads: tuple[float, ...] = (0.5, 2.0)
    seconds: float = 60.0
    drain_s: float = 60.0
    sample_s: float = 0.02
    seed: int = 18

    @property
    def capacity(self) -> float:
        service_s = (self.prompt_tokens * self.prefill_ms + self.max_tokens * self.decode_ms) / 1000
        return self.workers * self.batch / service_s

    def mock_args(self) -> list[str]:
        return ["--max-batch-size", str(self.batch), "--prefill-ms-per-token", str(self.prefill_ms),
                "--decode-ms-per-token", str(self.decode_ms), "--num-blocks", "16384"]


QUICK = Workload(seconds=3.0, drain_s=15.0)


@dataclass
class Outcome:
    cls: str
    sent: float
    status: int = 0
    ttft: float | None = None
    reason: str | None = None
    error: str = ""
    done: float = 0.0


def body(i: int, w: Workload, rng: random.Random) -> bytes:
    """A prompt of its own (no cache hits) whose length and answer length vary around the means, as real
    traffic does: with identical requests the mock's deterministic timing would finish every batch slot
    filled at the same moment at the same moment again, forever, and slots would free in clumps."""
    n = rng.randint(w.prompt_tokens // 2, w.prompt_tokens * 3 // 2) - 12
    words = " ".join(f"w{rng.randrange(20000)}" for _ in range(n))
    max_tokens = rng.randint(max(1, w.max_tokens // 2), w.max_tokens * 3 // 2)
    return json.dumps({"model": "mock-model", "max_tokens": max_tokens, "stream": True,
                       "messages": [{"role": "user", "content": f"request {i} {words}"}]}).encode()


async def one(s: aiohttp.ClientSession, url: str, data: bytes, o: Outcome) -> None:
    headers = {"content-type": "application/json", **HEADERS[o.cls]}
    try:
        async with s.post(url, data=data, headers=headers) as r:
            o.status = r.status
            o.reason = r.headers.get(DROPPED)
            if r.status != 200:
                await r.read()
            else:
                async for line in r.content:
                    if line.startswith(b"data: ") and o.ttft is None:
                        o.ttft = time.perf_counter() - o.sent
                    if line.startswith(b"data: [DONE]"):
                        break
    except (aiohttp.ClientError, TimeoutError) as e:
        o.error = f"{type(e).__name__}: {e}"
    o.done = time.perf_counter()


async def sampler(url: str, every: float, out: list[tuple[float, dict[str, Any]]], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                async with s.get(url + "/debug/flow") as r:
                    out.append((time.perf_counter(), (await r.json())["queue"]))
            except (aiohttp.ClientError, TimeoutError, KeyError, TypeError):
                pass
            await asyncio.sleep(every)


async def drive(w: Workload, envoy_url: str, picker_url: str | None, load: float) -> dict[str, Any]:
    rng = random.Random(w.seed)
    rate = load * w.capacity
    n = int(rate * w.seconds)
    arrivals = H.poisson_arrivals(rate, n, rng)
    a, b = w.tenant_ratio
    classes = ["high" if rng.random() < w.high_share else ("tenant-a" if rng.random() < a / (a + b) else "tenant-b")
               for _ in range(n)]
    bodies = [body(i, w, rng) for i in range(n)]
    outcomes: list[Outcome] = []
    samples: list[tuple[float, dict[str, Any]]] = []
    stop = asyncio.Event()
    sample_task = asyncio.create_task(sampler(picker_url, w.sample_s, samples, stop)) if picker_url else None
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=w.seconds + w.drain_s)) as s:
        t0 = time.perf_counter()

        async def later(i: int) -> None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            o = Outcome(classes[i], time.perf_counter())
            outcomes.append(o)
            await one(s, envoy_url + "/v1/chat/completions", bodies[i], o)

        tasks = [asyncio.ensure_future(later(i)) for i in range(n)]
        _, pending = await asyncio.wait(tasks, timeout=w.seconds + w.drain_s + 5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - t0
    stop.set()
    waits = None
    if sample_task is not None:
        await sample_task
        async with aiohttp.ClientSession() as s, s.get(picker_url + "/metrics") as r:
            waits = queue_waits(await r.text())
    row = summarize(w, load, rate, outcomes, elapsed, samples)
    row["picker_queue_wait"] = waits
    row["high_ttft_by_10s"] = windows([o for o in outcomes if o.cls == "high"], t0, 10.0)
    return row


def windows(outcomes: list[Outcome], t0: float, width: float) -> list[dict[str, Any]]:
    """High-band TTFT per window of send time: shows whether a bad p90 is the whole run or one stall (on a
    shared machine another process can take the cores for seconds, and the backlog then takes a while to
    drain)."""
    by: dict[int, list[float]] = {}
    for o in outcomes:
        if o.ttft is not None:
            by.setdefault(int((o.sent - t0) // width), []).append(o.ttft)
    return [{"from_s": k * width, "n": len(v), **H.pcts_ms(v)} for k, v in sorted(by.items())]


_WAIT = re.compile(r'^epp_flow_control_queue_wait_seconds_bucket\{([^}]*)\} (\S+)$', re.M)


def queue_waits(text: str) -> dict[str, Any]:
    """Per band, p50/p90 of the time dispatched requests spent in the picker's queue (its own histogram)."""
    per: dict[str, dict[float, float]] = {}
    for labels, v in _WAIT.findall(text):
        lab = dict(x.split("=", 1) for x in labels.split(","))
        lab = {k: val.strip('"') for k, val in lab.items()}
        if lab.get("outcome") != "dispatched":
            continue
        le = math.inf if lab["le"] == "+Inf" else float(lab["le"])
        per.setdefault(lab["priority"], {})[le] = float(v)
    return {p: H.hist_summary_ms(h) for p, h in per.items()}


def summarize(w: Workload, load: float, rate: float, outcomes: list[Outcome], elapsed: float,
              samples: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for cls in CLASSES:
        os_ = [o for o in outcomes if o.cls == cls]
        served = [o for o in os_ if o.status == 200 and not o.error and o.ttft is not None]
        per[cls] = {"sent": len(os_), "served": len(served),
                    "rejected_429": sum(1 for o in os_ if o.status == 429),
                    **{f"ttft_{k}": v for k, v in H.pcts_ms([o.ttft for o in served if o.ttft]).items()}}
    with_reason = sum(1 for o in outcomes if o.status in (429, 503) and o.reason)
    served = sum(1 for o in outcomes if o.status == 200 and not o.error)
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.reason:
            reasons[o.reason] = reasons.get(o.reason, 0) + 1
    lost = [o for o in outcomes if not (o.status == 200 and not o.error) and not (o.status == 429 and o.reason)]
    statuses: dict[str, int] = {}
    for o in lost:
        k = str(o.status) if not o.error else o.error.split(":")[0]
        statuses[k] = statuses.get(k, 0) + 1
    return {"load": load, "rate": rate, "requests": len(outcomes), "elapsed_s": round(elapsed, 2),
            "served": served, "served_rps": served / elapsed if elapsed else 0.0, "answered_with_reason": with_reason,
            "reasons": reasons, "lost": len(lost), "lost_by_status": statuses, "per_class": per,
            "fairness": fairness(samples)}


def fairness(samples: list[tuple[float, dict[str, Any]]]) -> dict[str, Any] | None:
    """Dispatch shares of the two low-band tenants over the sampling intervals that begin with both queued."""
    if len(samples) < 2:
        return None
    got = {"tenant-a": 0, "tenant-b": 0}
    backlogged_s = 0.0

    def counts(q: dict[str, Any]) -> dict[str, int]:
        return {d["flow"]: d["dispatched"] for d in q.get("dispatched", ()) if d["priority"] == 0}

    for (t0, q0), (t1, q1) in zip(samples, samples[1:], strict=False):
        flows = (q0.get("bands", {}).get("0") or {}).get("flows", {})
        if not (flows.get("tenant-a") and flows.get("tenant-b")):
            continue
        c0, c1 = counts(q0), counts(q1)
        if any(f not in c1 or c1[f] < c0.get(f, 0) for f in got if f in c0):
            continue  # a counter was evicted: skip the interval rather than guess
        backlogged_s += t1 - t0
        for f in got:
            got[f] += c1.get(f, 0) - c0.get(f, 0)
    total = sum(got.values())
    return {"backlogged_s": round(backlogged_s, 2), "dispatches": got,
            "share_b": got["tenant-b"] / total if total else None,
            "share_a": got["tenant-a"] / total if total else None}


def run_config(w: Workload, cfg: str, load: float, objectives: Path) -> dict[str, Any]:
    with H.Stack(prefix="epp-bench-flow-") as st:
        workers = [H.mock_worker(st, f"w{i}", w.mock_args(), kv=False) for i in range(w.workers)]
        flags = (["--flow-control", "--queue-depth-threshold", "0", "--worker-metrics-interval-ms", "50",
                  "--inference-objectives-file", str(objectives)] if cfg == "q"
                 else ["--worker-metrics-interval-ms", "0"])
        pk = H.picker(st, H.endpoints_spec(workers), "none", extra=flags)
        env = H.envoy(st, picker_proc=pk)
        row = asyncio.run(drive(w, env.url, H.picker_url(pk) if cfg == "q" else None, load))
    row["config"] = cfg
    hi = row["per_class"]["high"]
    fair = row["fairness"] or {}
    print(f"  ({cfg}) {load:>4}x C = {row['rate']:.0f} req/s: served {row['served']}/{row['requests']} "
          f"({row['served_rps']:.1f}/s), high TTFT p50/p90 {H.fmt(hi.get('ttft_p50_ms'))}/"
          f"{H.fmt(hi.get('ttft_p90_ms'))} ms, 429 with reason {row['reasons']}, lost {row['lost']} "
          f"{row['lost_by_status']}, tenant-b share {H.fmt(fair.get('share_b'))}", flush=True)
    return row


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def get(cfg: str, load: float) -> dict[str, Any] | None:
        return next((r for r in rows if r["config"] == cfg and r["load"] == load), None)

    lo, hi = min(r["load"] for r in rows), max(r["load"] for r in rows)
    q_lo, q_hi, n_hi = get("q", lo), get("q", hi), get("n", hi)
    out: dict[str, Any] = {}
    if q_lo and q_hi:
        ratio = H.ratio(q_hi["per_class"]["high"].get("ttft_p90_ms"), q_lo["per_class"]["high"].get("ttft_p90_ms"))
        out["high_ttft_p90_2x_over_half"] = {"q": ratio, "target": 1.5, "met": ratio is not None and ratio <= 1.5}
        if n_hi:
            out["high_ttft_p90_2x_over_half"]["n"] = H.ratio(n_hi["per_class"]["high"].get("ttft_p90_ms"),
                                                             q_lo["per_class"]["high"].get("ttft_p90_ms"))
        out["no_request_lost"] = {"q_lost": q_hi["lost"], "n_lost": n_hi["lost"] if n_hi else None,
                                  "met": q_hi["lost"] == 0}
        f = q_hi["fairness"] or {}
        sb, sa = f.get("share_b"), f.get("share_a")
        out["backlogged_tenants_share_40_60"] = {
            "share_a": sa, "share_b": sb, "backlogged_s": f.get("backlogged_s"),
            "met": sa is not None and sb is not None and 0.4 <= sa <= 0.6 and 0.4 <= sb <= 0.6}
    return out


def print_report(doc: dict[str, Any]) -> None:
    rows = doc["result"]["rows"]
    base = next((r for r in rows if r["config"] == "q" and r["load"] == min(x["load"] for x in rows)), None)
    b90 = base["per_class"]["high"].get("ttft_p90_ms") if base else None
    print(f"\nFlow control, nominal capacity C = {doc['workload']['capacity']:.1f} req/s "
          "(ratio = high-band TTFT p90 over (q) at the lowest load)")
    print(H.table([[r["config"], r["load"], round(r["rate"]), r["requests"], r["served"],
                    r["per_class"]["high"].get("ttft_p50_ms"), r["per_class"]["high"].get("ttft_p90_ms"),
                    H.ratio(r["per_class"]["high"].get("ttft_p90_ms"), b90),
                    r["per_class"]["tenant-a"]["served"], r["per_class"]["tenant-b"]["served"],
                    sum(r["reasons"].values()), r["lost"],
                    (r["fairness"] or {}).get("share_b")] for r in rows],
                  ["cfg", "xC", "req/s", "sent", "served", "hi p50", "hi p90", "p90 ratio", "A served",
                   "B served", "429+reason", "lost", "B share"]))
    for r in rows:
        if r["config"] == "q" and r["load"] > 1:
            print(f"\n({r['config']}) at {r['load']}x C, high-band TTFT p90 per 10 s of send time (ms):",
                  [round(x["p90_ms"]) for x in r["high_ttft_by_10s"] if x.get("p90_ms") is not None])
    H.print_targets(doc)


def chart(doc: dict[str, Any], path: Path) -> None:
    plt = H.pyplot()
    rows = doc["result"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    H.plot_by_config(axes, rows, CONFIGS, "load", (lambda r: r["per_class"]["high"].get("ttft_p90_ms"),
                                                   lambda r: r["served_rps"]))
    axes[0].set_yscale("log")
    H.label_axes(axes, ("high-band TTFT p90 (ms, log)", "served req/s"), "offered load (x nominal capacity)")
    axes[0].legend(fontsize=8)
    H.save_figure(fig, "Two priority bands at half and twice the pool's capacity", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "flow_control")
    a = ap.parse_args(argv)
    w = QUICK if a.quick else Workload()
    print(f"flow_control: 2 workers, nominal capacity {w.capacity:.1f} req/s", flush=True)
    rows = []
    with H.Stack(prefix="epp-bench-flow-obj-") as st:
        objectives = st.dir / "objectives.yaml"
        objectives.write_text(OBJECTIVES)
        for load in w.loads:
            for cfg in CONFIGS:
                rows.append(run_config(w, cfg, load, objectives))
    doc = {"bench": "flow_control", **H.meta(a.quick), "configs": CONFIGS,
           "workload": {**asdict(w), "capacity": w.capacity}, "mock_args": w.mock_args(), "result": {"rows": rows}}
    doc["targets"] = targets(rows)
    return H.publish(doc, a.out, "flow_control", print_report, chart)


if __name__ == "__main__":
    main()
