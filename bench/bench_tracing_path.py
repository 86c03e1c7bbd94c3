"""Where tracing's CPU goes on the picker's request path, in-process and repeatable (bench_tracing measures
the whole picker behind a real Envoy, where two cores shared by a dozen processes make figures move by a few
percent run to run; this one counts the picker's own work per request, with nothing else running).

    PYTHONPATH=. python -m bench.bench_tracing_path [--requests 2000] [--repeats 7]      # CPU time
    PYTHONPATH=. python -m bench.bench_tracing_path --callgrind [--requests 500] [--json PATH]   # instructions

Each request is what a picker does for one ext_proc stream, minus the sockets: h2grpc's HPACK decoder reads the
stream's header block (as Envoy 1.40 sends it, captured: `:method` indexed, `:path` a Huffman literal without
indexing on every stream, the rest indexed; with Envoy's tracer on, a fresh `traceparent` with incremental
indexing and an empty `tracestate`), the context gives `invocation_metadata()` as h2grpc's `Call` does, and the
real edge (`ExtProcServicer`) and Director decide it (tests/unit/test_tracing.py's servicer: fake renderer
and KV index). A traced picker's sampled records are then written as OTLP bytes (its exporter thread's work),
inside the measurement. The cases:

  - off: tracing off, no trace context (Envoy not tracing);
  - envoyonly: tracing off, Envoy's context in the metadata (90% flags 00, 10% 01): the header block alone;
  - gw00 / gw01: tracing on (parent-based), every request's context unsampled / sampled;
  - envoy10: tracing on, Envoy samples 10% (gw00 nine times in ten, gw01 the tenth);
  - picker10: tracing on, no context, the picker samples 10% itself (`parentbased_traceidratio` 0.1);
  - picker0 / picker100: the same at a ratio of 0 / 1 (every trace the picker starts unsampled / sampled):
    picker10's two halves, whose 0.9/0.1 mix (printed) is picker10 without the draw of which requests the
    ratio samples (the trace ids are random: in 400 requests, 40 +- 6 are sampled, ~+-2k instructions).

`--callgrind` runs each case under `valgrind --tool=callgrind` twice, counting instructions only around the
measured loop (`callgrind_control -i on/off`), with `--requests` and a fifth of it: the difference over the
difference in requests is the instructions per request, the same on every run to a few hundred (about 4
minutes in all; the module `random`, which draws the trace ids, is seeded the same in every run). h2grpc's Huffman strings are decoded by its C decoder where built; `EPP_H2GRPC_PURE=1` (passed
on to the runs) decodes them in pure Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import hpack

from h2grpc import hpack_decode
from h2grpc.call import Call

CASES = ("off", "envoyonly", "gw00", "gw01", "envoy10", "picker10", "picker0", "picker100")
# Envoy 1.40's first two representations of every ext_proc stream: `:method POST` (static index 3) and `:path`
# as a literal without indexing, its value Huffman-coded (captured from its HTTP/2 codec)
ENVOY_HEAD = bytes.fromhex("8304a560b5773fa5d05b3b98855cbe5315761c8bf7657c1e525b2a1d1aec390a841ec635d8721508")
ENVOY_REST = [(":authority", "picker"), (":scheme", "http"), ("te", "trailers"), ("content-type", "application/grpc")]


def metadata(rng: random.Random, flags: str | None) -> list[tuple[str, str]]:
    out = [("x-forwarded-for", "192.0.2.2")]
    if flags is not None:
        tp = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{flags}"
        out += [("traceparent", tp), ("tracestate", "")]
    return out + [("x-envoy-internal", "true")]


def flags_of(case: str, i: int) -> str | None:
    if case in ("off", "picker10", "picker0", "picker100"):
        return None
    if case == "gw00":
        return "00"
    if case == "gw01":
        return "01"
    return "01" if i % 10 == 0 else "00"  # envoyonly, envoy10: Envoy samples one in ten


def blocks(case: str, n: int) -> list[bytes]:
    """One connection's header blocks, in order (the encoder's table carried from block to block)."""
    rng, enc = random.Random(1), hpack.Encoder()
    return [ENVOY_HEAD + enc.encode(ENVOY_REST + metadata(rng, flags_of(case, i))) for i in range(n)]


class Context:
    """The servicer context as h2grpc's `Call` is one: its metadata filtered from the decoded fields when asked,
    or one field of it (`metadata_value`, where the tree's Call has it)."""

    invocation_metadata = Call.invocation_metadata
    if hasattr(Call, "metadata_value"):
        metadata_value = Call.metadata_value

    def __init__(self, headers: list[tuple[str, str]]) -> None:
        self.headers = headers

    async def abort(self, code: object, details: str) -> None:
        raise RuntimeError(details)


class Setup:
    def __init__(self, case: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased

        from epp_extproc.tracing.spans import SpanQueue, Tracing
        from tests.unit.test_tracing import request, servicer

        class Null(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

            def shutdown(self) -> None:
                return None

        self.case = case
        self.tracing = None
        if case not in ("off", "envoyonly"):
            queue = SpanQueue(Null(), Resource.create({"service.name": "bench"}), wire=True, delay_s=3600,
                              batch=1 << 30, max_queue=1 << 30)  # never exported: encoded below, timed
            ratio = {"picker10": 0.1, "picker0": 0.0, "picker100": 1.0}.get(case)
            root = ParentBased(TraceIdRatioBased(ratio)) if ratio is not None else ParentBased(ALWAYS_ON)
            self.tracing = Tracing(queue, root)
        self.svc = servicer(self.tracing)
        self.msgs = request({"content-type": "application/json",
                             "x-request-id": "95b0f48a-a157-4d99-92fd-2ad7bfc6a03d"})

    async def run(self, sequence: list[bytes]) -> None:
        """Decode, decide and answer each stream; then write the sampled records as OTLP bytes."""
        decoder = hpack_decode.Decoder(65_536, 4_096)
        msgs = self.msgs

        async def feed() -> AsyncIterator[Any]:
            for m in msgs:
                yield m

        for block in sequence:
            context = Context(decoder.decode(block))
            async for _ in self.svc.Process(feed(), context):  # type: ignore[arg-type]
                pass
        if self.tracing is not None:
            queue = self.tracing.queue
            records = list(queue._q)
            queue._q.clear()
            if records:
                queue._encoded(records)


def cpu_us(setup: Setup, sequence: list[bytes]) -> float:
    t0 = time.process_time()
    asyncio.run(setup.run(sequence))
    return (time.process_time() - t0) / len(sequence) * 1e6


def timed(n: int, repeats: int) -> None:
    setups = {c: Setup(c) for c in CASES}
    seqs = {c: blocks(c, n) for c in CASES}
    for c in CASES:
        cpu_us(setups[c], blocks(c, 300))  # warm
    got: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(repeats):  # interleaved, the order turning
        for c in CASES[r % len(CASES):] + CASES[:r % len(CASES)]:
            got[c].append(cpu_us(setups[c], seqs[c]))
    base = statistics.median(got["off"])
    print(f"CPU per request, median of {repeats} x {n} requests (best):")
    for c in CASES:
        m = statistics.median(got[c])
        print(f"  {c:10s} {m:7.1f} us ({min(got[c]):.1f})  {m - base:+6.1f} us  x{m / base:.3f}")


def instrumented(case: str, n: int) -> None:
    """Run under callgrind with instrumentation off: on around the measured loop only."""
    random.seed(46)  # the trace ids the picker draws: the same in every run of one tree
    setup = Setup(case)
    asyncio.run(setup.run(blocks(case, 300)))  # warm
    sequence = blocks(case, n)
    subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
    asyncio.run(setup.run(sequence))
    subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True, capture_output=True)


def callgrind(n: int, json_path: str | None = None, cases: tuple[str, ...] = CASES) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed")
    small = max(50, n // 5)
    counts: dict[str, int] = {}
    for c in cases:
        got = []
        for k in (small, n):
            out = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null",
                                  sys.executable, "-m", "bench.bench_tracing_path", "--instrumented", c,
                                  "--requests", str(k)], capture_output=True, text=True, check=True).stderr
            found = re.search(r"Collected : (\d+)", out)
            if found is None:
                sys.exit(f"no count from callgrind:\n{out[-2000:]}")
            got.append(int(found.group(1)))
        counts[c] = (got[1] - got[0]) // (n - small)
        print(f"  {c:10s} {counts[c]:9,d} instructions per request  {counts[c] - counts.get('off', counts[c]):+8,d}",
              flush=True)
    base = counts["off"]
    print("over off: " + ", ".join(f"{c} x{counts[c] / base:.3f}" for c in cases))
    mix = None
    if "picker0" in counts and "picker100" in counts:
        mix = round(0.9 * counts["picker0"] + 0.1 * counts["picker100"]) - base
        print(f"picker10 as 0.9 picker0 + 0.1 picker100: {mix:+,d} over off (x{(base + mix) / base:.3f})")
    if json_path:
        try:
            from h2grpc import native
            huffman_c = native.MODULE is not None
        except ImportError:  # a tree from before h2grpc's C decoder
            huffman_c = False
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(json_path, "w") as f:
            json.dump({"requests": n, "commit": commit, "huffman_c": huffman_c,
                       "instructions_per_request": counts,
                       "over_off": {c: counts[c] - base for c in cases},
                       "picker10_mix_over_off": mix,
                       "ratio_to_off": {c: round(counts[c] / base, 4) for c in cases}}, f, indent=1)
            f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=0, help="per case and repeat (2000; 500 with --callgrind)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--callgrind", action="store_true", help="instructions per request (valgrind), repeatable")
    ap.add_argument("--json", help="with --callgrind: also write the counts to this file")
    ap.add_argument("--cases", default=",".join(CASES), help="with --callgrind: these cases only (off first)")
    ap.add_argument("--instrumented", choices=CASES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.instrumented:
        instrumented(a.instrumented, a.requests)
    elif a.callgrind:
        cases = tuple(a.cases.split(","))
        if cases[0] != "off" or not set(cases) <= set(CASES):
            sys.exit(f"--cases: off first, then any of {', '.join(CASES[1:])}")
        callgrind(a.requests or 500, a.json, cases)
    else:
        timed(a.requests or 2000, a.repeats)


if __name__ == "__main__":
    main()
