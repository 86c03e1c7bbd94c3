"""A real OTLP trace collector for the tests: the protocol's own `TraceService` (from the opentelemetry-proto
package) on a loopback gRPC port, keeping every span it is sent. No mock of any SDK: Envoy, the picker and
vLLM export to it as they would to an OpenTelemetry Collector. Used by tests/integration/test_tracing_envoy.py
and the real-engine suite tests/e2e/test_vllm_tracing_e2e.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector: every span it is sent, flattened with its service's name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                                 for a in s.attributes}
                        self.spans.append({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                           "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                           "kind": s.kind, "scope": ss.scope.name, "attrs": attrs})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def wait(self, trace_id: str, want: set[tuple[str, str]], timeout: float = 30.0) -> list[dict[str, Any]]:
        """The trace once it holds a span of each (service, name) wanted (Envoy flushes every 5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.trace(trace_id)
            if want <= {(s["service"], s["name"]) for s in got}:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: wanted {sorted(want)}, got "
                                     f"{sorted({(s['service'], s['name']) for s in got})}")
            time.sleep(0.2)


def serve() -> tuple[Receiver, int, grpc.Server]:
    """A started receiver, its loopback port and its server (stop it with `server.stop(0)`)."""
    r = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return r, port, server


@contextlib.contextmanager
def http_bodies() -> Iterator[tuple[int, list[tuple[str, bytes]]]]:
    """OTLP/HTTP's side: a loopback HTTP server that answers every POST 200 and keeps (path, body); yields its
    port and that list, and stops when the block ends."""
    got: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            got.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], got
    finally:
        server.shutdown()
