"""What one KV batch costs when it is the only thing that wakes the loop (issue 45: the in-process ingest's
"~110 us per batch, unexplained", bench_ingest_idle).

    python -m bench.bench_batch_wake [--workers 10] [--rate 60] [--seconds 6] [--loops uvloop,asyncio]
        [--repeats 2] [--out bench/results/batch_wake.json]

`bench.kvpub` workers (real ZeroMQ PUB sockets, TensorRT-LLM's wire form: each batch a chain of 1..15 fresh
32-token blocks, 8 on average) publish `--rate` batches/s each to a `KvIndex` + `SubscriberManager` in this
process, nothing else on its loop (no picker, no decisions, no HTTP). Over a steady window of `--seconds`:

* CPU per applied batch of this process, and of each of its threads (/proc: the loop thread against libzmq's
  I/O thread);
* wall time inside the descriptor callback (`SubscriberManager._wake`, which reads, decodes and applies the
  batch: the whole of the ingest's Python work on the plain path) per batch and wake-ups per batch;
* inside it, `decode_payload` and `KvIndex.apply_batch` per batch, and the same payload decoded a second time
  right after the first (`decode_again`): the same work with the caches the first call just warmed.

A slow first decode and a fast second one say the cost is the code and data of the ingest running cold, once
per wake-up, not the loop's dispatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kvindex.subscriber as KS
from kvindex.index import KvIndex

ROOT = Path(__file__).resolve().parents[1]


def thread_cpu() -> dict[str, float]:
    """CPU-seconds per thread of this process, keyed by thread name (names repeat: summed)."""
    out: dict[str, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tck
    return out


class Probe:
    """Timers around the plain path's steps (wrapping, not changing, the product's functions)."""

    def __init__(self, idx: KvIndex) -> None:
        self.t = {"wake": 0.0, "decode": 0.0, "decode_again": 0.0, "apply": 0.0}
        self.wakes = 0
        self.blocks = 0
        self.payload_bytes = 0
        wake, decode, apply = KS.SubscriberManager._wake, KS.decode_payload, idx.apply_batch

        def timed_wake(mgr: Any, sub: Any) -> None:
            t = time.perf_counter()
            wake(mgr, sub)
            self.t["wake"] += time.perf_counter() - t
            self.wakes += 1

        def timed_decode(payload: bytes, *a: Any) -> Any:
            t = time.perf_counter()
            out = decode(payload, *a)
            t1 = time.perf_counter()
            decode(payload, *a)
            self.t["decode"] += t1 - t
            self.t["decode_again"] += time.perf_counter() - t1
            self.payload_bytes += len(payload)
            self.blocks += sum(len(getattr(e, "block_hashes", ())) for e in out.events
                               if type(e).__name__ == "BlockStored")
            return out

        def timed_apply(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = apply(*a, **k)
            self.t["apply"] += time.perf_counter() - t
            return out

        KS.SubscriberManager._wake = timed_wake  # type: ignore[method-assign]
        KS.decode_payload = timed_decode  # type: ignore[assignment]
        idx.apply_batch = timed_apply  # type: ignore[method-assign]
        self._restore = (wake, decode)

    def close(self) -> None:
        KS.SubscriberManager._wake, KS.decode_payload = self._restore  # type: ignore[method-assign]

    def snap(self) -> dict[str, Any]:
        return {**self.t, "wakes": self.wakes, "blocks": self.blocks, "payload_bytes": self.payload_bytes}


async def window(workers: int, rate: float, seconds: float, probe_on: bool) -> dict[str, Any]:
    pub = subprocess.Popen([sys.executable, "-m", "bench.kvpub", "--workers", str(workers), "--rate", str(rate),
                            "--new-blocks", "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           cwd=ROOT)
    assert pub.stdin is not None and pub.stdout is not None
    idx = KvIndex(32, 1_000_000)
    probe = Probe(idx) if probe_on else None
    mgr = KS.SubscriberManager(idx, topic="")
    try:
        endpoints = json.loads(pub.stdout.readline())["endpoints"]
        names = [f"w{i}" for i in range(workers)]
        for name, ep in zip(names, endpoints, strict=True):
            await mgr.add(name, ep)
        await asyncio.sleep(1.5)
        pub.stdin.write("go\n")
        pub.stdin.flush()
        pub.stdout.readline()
        await asyncio.sleep(2.0)  # the warm prefix and the first batches are in
        b0, c0, th0 = sum(idx.stats(n).batches for n in names), time.process_time(), thread_cpu()
        p0 = probe.snap() if probe else None
        await asyncio.sleep(seconds)
        b1, c1, th1 = sum(idx.stats(n).batches for n in names), time.process_time(), thread_cpu()
        n = b1 - b0
        row: dict[str, Any] = {"loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                               "probe": probe_on, "batches": n, "batches_per_s": round(n / seconds, 1),
                               "cpu_us_per_batch": round((c1 - c0) / n * 1e6, 1),
                               "thread_cpu_us_per_batch": {k: round((th1[k] - th0.get(k, 0.0)) / n * 1e6, 1)
                                                           for k in th1}}
        if probe is not None and p0 is not None:
            p1 = probe.snap()
            d = {k: p1[k] - p0[k] for k in p1}
            row.update({f"{k}_us_per_batch": round(d[k] / n * 1e6, 1)
                        for k in ("wake", "decode", "decode_again", "apply")})
            row.update({"wakes_per_batch": round(d["wakes"] / n, 3), "blocks_per_batch": round(d["blocks"] / n, 2),
                        "payload_bytes_per_batch": round(d["payload_bytes"] / n)})
        return row
    finally:
        if probe is not None:
            probe.close()
        await mgr.close()
        pub.stdin.write("stop\n")
        pub.stdin.flush()
        pub.wait(timeout=10)


def run(loop: str, *args: Any) -> dict[str, Any]:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(window(*args))
    return asyncio.run(window(*args))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--rate", type=float, default=60.0, help="batches/s per worker")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--loops", default="uvloop,asyncio")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench/results/batch_wake.json")
    a = ap.parse_args(argv)
    rows = []
    for rep in range(a.repeats):
        for loop in a.loops.split(","):
            for probe_on in (False, True):  # the probe's own cost shows as the difference
                row = {"repeat": rep, **run(loop, a.workers, a.rate, a.seconds, probe_on)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary: dict[str, Any] = {}
    for loop in a.loops.split(","):
        plain = [r for r in rows if r["loop"] == loop and not r["probe"]]
        probed = [r for r in rows if r["loop"] == loop and r["probe"]]
        summary[loop] = {"cpu_us_per_batch": statistics.median(r["cpu_us_per_batch"] for r in plain),
                         **{k: statistics.median(r[k] for r in probed)
                            for k in ("wake_us_per_batch", "decode_us_per_batch", "decode_again_us_per_batch",
                                      "apply_us_per_batch")}}
    doc = {"bench": "batch_wake", "workers": a.workers, "rate_per_worker": a.rate, "seconds": a.seconds,
           "load_avg": os.getloadavg(), "rows": rows, "summary": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return doc


if __name__ == "__main__":
    main(sys.argv[1:])
