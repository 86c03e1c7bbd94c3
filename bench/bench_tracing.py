"""The picker's CPU per request with tracing off and on at 10% sampling, measured in the same run.

    PYTHONPATH=. python -m bench.bench_tracing [--rounds 5] [--requests 3000] [--out FILE]

Same mock workers, renderer and OTLP receiver (a real `TraceService` server in this process) for every
configuration; each round starts a fresh picker process and Envoy per configuration, in an order that turns
round to round so that a busy machine weighs on all alike:

  - `off`: no OTEL_* variable (the baseline: no span object is made);
  - `picker10`: the picker exports to the receiver and starts the traces itself with
    `parentbased_traceidratio` 0.1 (Envoy does not trace; the picker passes `traceparent` on to every worker);
  - `envoy10`: Envoy's OpenTelemetry tracer samples 10% (`--tracing-sample-percent 10`) and the picker follows
    its decision (parent-based, its default).

The picker's CPU per request is its process CPU time over the requests answered at c=32 (bench/compare_trees'
figure); the medians over the rounds are printed with each traced configuration's ratio to `off`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench import harness as H
from bench.bench_overhead import FAST_MOCK, make_bodies
from epp_extproc.dev import envoy_config, procs

CONFIGS = ("off", "picker10", "envoy10")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Counts the spans it is sent, per service (the sampling actually applied)."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                svc = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                self.count[svc] = self.count.get(svc, 0) + sum(len(ss.spans) for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def run_config(cfg: str, workers: list[procs.Proc], renderer: procs.Proc, otlp_port: int, n: int) -> float:
    make = make_bodies(120)
    with H.Stack() as st:
        p = procs.picker(st.dir, endpoints=H.endpoints_spec(workers), protocol="trtllm-render",
                         renderer_url=renderer.url,
                         args=["--log-level", "WARNING", "--max-inflight-requests", str(H.PICKER_MAX_INFLIGHT)])
        if cfg != "off":
            p.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
                     "OTEL_SERVICE_NAME": f"epp-{cfg}"}
            if cfg == "picker10":
                p.env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        pk = st.add(p)
        H.wait_subscribed(pk, [w.address for w in workers])
        opts = envoy_config.EnvoyOptions(listen_port=H.free_port(), admin_port=H.free_port(), picker_port=pk.port or 0,
                                         picker_max_inflight=H.PICKER_MAX_INFLIGHT)
        if cfg == "envoy10":
            opts.tracing_otlp = f"127.0.0.1:{otlp_port}"
            opts.tracing_sample_percent = 10.0
        env = st.add(procs.envoy(st.dir, opts, name="envoy"), timeout=60)
        url = env.url + "/v1/chat/completions"
        asyncio.run(H.closed_loop(url, make, concurrency=8, max_requests=300, max_seconds=5))
        cpu0 = pk.cpu_seconds()
        res, el = asyncio.run(H.closed_loop(url, make, concurrency=32, max_requests=n, max_seconds=60))
        row = H.summarize(res, el)
        if row["errors"]:
            raise RuntimeError(f"{cfg}: {row['errors']} errors")
        return (pk.cpu_seconds() - cpu0) / max(1, row["requests"]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    try:
        with H.Stack() as outer:
            workers = [H.mock_worker(outer, f"worker-{i}", FAST_MOCK) for i in range(2)]
            renderer = H.mock_renderer(outer)
            for r in range(a.rounds):
                order = CONFIGS[r % 3:] + CONFIGS[:r % 3]
                for cfg in order:
                    cpu[cfg].append(run_config(cfg, workers, renderer, otlp_port, a.requests))
                print(f"round {r + 1}: " + ", ".join(f"{c} {cpu[c][-1]:.0f} us" for c in CONFIGS), flush=True)
    finally:
        server.stop(0)
    med = {c: statistics.median(v) for c, v in cpu.items()}
    doc: dict[str, Any] = {"requests_per_round": a.requests, "rounds": a.rounds, "cpu_us_per_request": cpu,
                           "median_cpu_us": med, "ratio_to_off": {c: med[c] / med["off"] for c in CONFIGS},
                           "spans_received": rec.count}
    print(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
