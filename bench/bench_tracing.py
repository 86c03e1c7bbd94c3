"""The picker's CPU per request with tracing off and on at 10% sampling, measured in the same run.

    PYTHONPATH=. python -m bench.bench_tracing [--bursts 12] [--requests 600] [--pin] [--out FILE]

Same mock workers, renderer and OTLP receiver (a real `TraceService` server in this process) for every
configuration; each configuration has its own picker process and Envoy, all started at once, and the
requests go in short bursts to one configuration after another, in an order that turns burst to burst, so
that a busy machine weighs on all alike (on a shared machine, figures from separate runs differ by more
than the 5% this measures):

  - `off`: no OTEL_* variable (the baseline: no span object is made);
  - `picker10`: the picker exports to the receiver (OTLP/HTTP, the default) and starts the traces itself with
    `parentbased_traceidratio` 0.1 (Envoy does not trace; the picker passes `traceparent` on to every worker);
  - `envoy10`: Envoy's OpenTelemetry tracer samples 10% (`--tracing-sample-percent 10`) and the picker follows
    its decision (parent-based, its default).

The picker's CPU per request is its process CPU time over the requests answered at c=32 (bench/compare_trees'
figure), over all its bursts, with each traced configuration's ratio to `off` (and the bursts' medians).
Each configuration's Envoy CPU per request is recorded beside it (what Envoy's tracer costs Envoy). Also each
picker's CPU over the whole measurement, from after the warm-up to 6 s after the last burst (`whole_*`): a
traced picker exports on a 5 s timer, so part of its export work lands between bursts or in another
configuration's burst, where the per-burst figure does not count it; the whole-measurement figure counts all
of it, and every picker's idle work (health checks, metrics) alike.

What the harness does so that it weighs on every configuration alike, not on the traced ones:

- The OTLP receiver keeps each export's bytes as they came (gRPC with no deserializer, HTTP the body) and
  parses them to count spans per service only after the last burst. It used to parse every export with
  protobuf as it arrived, in this process's threads, beside the load generator's loop (the GIL) and on the
  same two cores as the pickers: a collector's work that in production runs elsewhere, and that landed in
  whichever burst was running when an exporter's 5 s timer fired.
- `--pin` (Linux): the pickers on CPU 0, everything else (Envoys, workers, renderer, this process with its
  load generator and receiver) on CPU 1, for every configuration. A picker then shares its core with no other
  process of the stack, so Envoy's tracer (which costs Envoy CPU on every request, sampled or not) does not
  take the picker's core in the traced configurations only. Without it every process shares both cores, as
  in the runs before it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from bench import harness as H
from bench.bench_overhead import FAST_MOCK, make_bodies
from epp_extproc.dev import envoy_config, procs

CONFIGS = ("off", "picker10", "envoy10")
# also: `idle` (on, nothing sampled), `picker10grpc` (picker10 exporting over gRPC instead of HTTP) and
# `envoyonly` (Envoy samples 10%, the picker's tracing is off: what Envoy's part alone costs the picker)


EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Receiver:
    """Keeps every OTLP export's bytes as they came (OTLP/gRPC and OTLP/HTTP alike) and counts the spans per
    service only when asked (`count`, after the last burst): no protobuf parsing while a burst runs."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        with self.lock:
            self.raw.append(body)

    def export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.take(request)
        return b""  # an empty ExportTraceServiceResponse

    def count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self.lock:
            raw = list(self.raw)
        for body in raw:
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                svc = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                out[svc] = out.get(svc, 0) + sum(len(ss.spans) for ss in rs.scope_spans)
        return out

    def grpc_handler(self) -> grpc.GenericRpcHandler:
        service, method = EXPORT_METHOD.strip("/").split("/")
        return grpc.method_handlers_generic_handler(service, {method: grpc.unary_unary_rpc_method_handler(
            self.export, request_deserializer=None, response_serializer=None)})


class HttpReceiver(BaseHTTPRequestHandler):
    """OTLP/HTTP (`POST /v1/traces`, protobuf): kept by the same receiver."""

    receiver: Receiver
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

    def do_POST(self) -> None:  # noqa: N802
        self.receiver.take(self.rfile.read(int(self.headers.get("content-length", "0"))))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        return None


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` (and those it starts later) on CPU `cpu`."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)


def start_config(st: H.Stack, cfg: str, workers: list[procs.Proc], renderer: procs.Proc, otlp_port: int,
                 http_port: int, pinned: bool) -> tuple[procs.Proc, procs.Proc, str]:
    """One configuration's picker process and Envoy (pinned: the picker on CPU 0); its requests' URL."""
    p = procs.picker(st.dir, endpoints=H.endpoints_spec(workers), protocol="trtllm-render", renderer_url=renderer.url,
                     name=f"picker-{cfg}",
                     args=["--log-level", "WARNING", "--max-inflight-requests", str(H.PICKER_MAX_INFLIGHT)])
    if not cfg.startswith("off") and cfg != "envoyonly":  # `off2`: a second baseline, the measurement's spread
        p.env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http_port}", "OTEL_SERVICE_NAME": f"epp-{cfg}"}
        if cfg == "picker10grpc":
            p.env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
                      "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        if cfg.startswith("picker10"):
            p.env |= {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
        if cfg == "idle":  # on, but nothing ever sampled: what being on costs by itself
            p.env |= {"OTEL_TRACES_SAMPLER": "always_off"}
        p.env |= {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}  # e.g. OTEL_BSP_SCHEDULE_DELAY
    pk = st.add(p)
    if pinned and pk.proc is not None:
        pin(pk.proc.pid, 0)
    H.wait_subscribed(pk, [w.address for w in workers])
    opts = envoy_config.EnvoyOptions(listen_port=H.free_port(), admin_port=H.free_port(), picker_port=pk.port or 0,
                                     picker_max_inflight=H.PICKER_MAX_INFLIGHT)
    if cfg in ("envoy10", "envoyonly"):  # envoyonly: Envoy traces, the picker does not (what Envoy's part costs)
        opts.tracing_otlp = f"127.0.0.1:{otlp_port}"
        opts.tracing_sample_percent = 10.0
    env = st.add(procs.envoy(st.dir, opts, name=f"envoy-{cfg}"), timeout=60)
    return pk, env, env.url + "/v1/chat/completions"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of process `pid` (/proc): where a configuration's extra CPU goes."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            parts = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=12, help="bursts per configuration, interleaved")
    ap.add_argument("--requests", type=int, default=600, help="requests per burst")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"among {', '.join(CONFIGS)}, idle; off first")
    ap.add_argument("--pin", action="store_true", help="pickers on CPU 0, everything else on CPU 1 (Linux)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    configs = tuple(a.configs.split(","))
    if a.pin:  # before any thread or child: they all inherit CPU 1; each picker is moved to CPU 0
        os.sched_setaffinity(0, {1})
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((rec.grpc_handler(),))
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    HttpReceiver.receiver = rec
    http = ThreadingHTTPServer(("127.0.0.1", 0), HttpReceiver)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    http_port = http.server_address[1]
    make = make_bodies(120)
    per_burst: dict[str, list[float]] = {c: [] for c in configs}
    whole: dict[str, float] = {}
    threads: dict[str, dict[str, float]] = {}
    cpu = dict.fromkeys(configs, 0.0)
    envoy_cpu = dict.fromkeys(configs, 0.0)
    answered = dict.fromkeys(configs, 0)
    try:
        with H.Stack() as st:
            workers = [H.mock_worker(st, f"worker-{i}", FAST_MOCK) for i in range(2)]
            renderer = H.mock_renderer(st)
            started = {c: start_config(st, c, workers, renderer, otlp_port, http_port, a.pin) for c in configs}
            for _, _, url in started.values():  # warm every path before any is measured
                asyncio.run(H.closed_loop(url, make, concurrency=8, max_requests=300, max_seconds=10))
            time.sleep(6)  # the warm-up's spans exported (a 5 s timer) before the whole measurement starts
            whole0 = {c: pk.cpu_seconds() for c, (pk, _, _) in started.items()}
            for b in range(a.bursts):
                k = b % len(configs)
                for cfg in configs[k:] + configs[:k]:
                    pk, env, url = started[cfg]
                    cpu0, env0 = pk.cpu_seconds(), env.cpu_seconds()
                    res, el = asyncio.run(H.closed_loop(url, make, concurrency=32, max_requests=a.requests,
                                                        max_seconds=60))
                    row = H.summarize(res, el)
                    if row["errors"]:
                        raise RuntimeError(f"{cfg}: {row['errors']} errors")
                    used = pk.cpu_seconds() - cpu0
                    envoy_cpu[cfg] += env.cpu_seconds() - env0
                    cpu[cfg] += used
                    answered[cfg] += row["requests"]
                    per_burst[cfg].append(used / max(1, row["requests"]) * 1e6)
                print(f"burst {b + 1}: " + ", ".join(f"{c} {per_burst[c][-1]:.0f} us" for c in configs), flush=True)
            time.sleep(6)  # the last burst's spans exported: counted in the whole measurement
            whole = {c: pk.cpu_seconds() - whole0[c] for c, (pk, _, _) in started.items()}
            threads = {c: thread_cpu(pk.proc.pid) for c, (pk, _, _) in started.items() if pk.proc is not None}
    finally:
        server.stop(0)
        http.shutdown()
    mean = {c: cpu[c] / max(1, answered[c]) * 1e6 for c in configs}
    med = {c: statistics.median(v) for c, v in per_burst.items()}
    doc: dict[str, Any] = {"bursts": a.bursts, "requests_per_burst": a.requests,
                           "cpu_us_per_request": mean, "ratio_to_off": {c: mean[c] / mean["off"] for c in configs},
                           "burst_median_cpu_us": med,
                           "burst_median_ratio_to_off": {c: med[c] / med["off"] for c in configs},
                           "envoy_cpu_us_per_request": {c: envoy_cpu[c] / max(1, answered[c]) * 1e6 for c in configs},
                           "whole_cpu_us_per_request": {c: whole[c] / max(1, answered[c]) * 1e6 for c in configs},
                           "whole_ratio_to_off": {c: whole[c] / answered[c] * answered["off"] / whole["off"]
                                                  for c in configs},
                           "pinned": a.pin, "per_burst_cpu_us": per_burst,
                           "spans_received": rec.count(),
                           "thread_cpu_s_whole_run": threads}
    print(json.dumps(doc, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
