"""One trace from the client to the worker, through a real Envoy with its OpenTelemetry tracer on, the picker
exporting over OTLP/gRPC, and a real OTLP receiver here (the protocol's own `TraceService`, from the
opentelemetry-proto package, tests/otlp_receiver.py; no mock of the SDK)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from epp_extproc.dev import envoy_config
from epp_extproc.tracing import spans
from tests.gateway_client import request
from tests.harness import EnvoyProcess
from tests.otlp_receiver import Receiver, serve
from tests.stack import GatewayStack

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int, grpc.Server]]:
    r, port, server = serve()
    yield r, port, server
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver: tuple[Receiver, int, grpc.Server]) -> Iterator[GatewayStack]:
    _, port, _ = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1000", "OTEL_SERVICE_NAME": "epp-extproc"}
    with pytest.MonkeyPatch.context() as mp:  # the picker reads them when it is built, in start()
        for k, v in env.items():
            mp.setenv(k, v)
        s = GatewayStack(workers=2, envoy_opts={"tracing_otlp": f"127.0.0.1:{port}"}).start()
    yield s
    s.stop()


def chat(url: str, text: str, headers: dict[str, str] | None = None) -> Any:
    body = {"model": "mock-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return request(url, body=json.dumps(body).encode(), headers=headers)


def worker_traceparent(stack: GatewayStack, reply: Any) -> str:
    name = reply.headers["x-trtllm-mock-worker"]
    mock = next(m for m in stack.mocks if m.name == name)
    r = request(mock.url, method="GET", path="/mock/last-request")
    return r.headers.get("x-trtllm-mock-traceparent", "")


PICKER_SPANS = {("epp-extproc", spans.EXCHANGE_SPAN), ("epp-extproc", "POST"), ("epp-extproc", spans.SCHEDULE_SPAN),
                ("epp-extproc", spans.KV_LOOKUP_SPAN)}


def test_one_trace_holds_envoys_span_the_pickers_spans_and_the_workers_request(
        stack: GatewayStack, receiver: tuple[Receiver, int, grpc.Server]) -> None:
    rec = receiver[0]
    r = chat(stack.url, "one trace through the gateway " * 8)
    assert r.status == 200
    parent = worker_traceparent(stack, r)
    assert parent, "Envoy's router put no traceparent on the worker's request"
    trace_id = parent.split("-")[1]
    got = rec.wait(trace_id, PICKER_SPANS | {("epp-gateway", "ingress")})
    names = {s["name"]: s for s in got if s["service"] == "epp-extproc"}
    exchange = names[spans.EXCHANGE_SPAN]
    assert exchange["attrs"]["epp.trace.parent"] == "gateway"  # read from the ext_proc stream's metadata
    # Envoy's gRPC client spawns a span for the ext_proc stream under the request's and injects it into the
    # stream's initial metadata: the picker's exchange hangs under it
    stream = {s["span_id"]: s for s in got if s["service"] == "epp-gateway"}[exchange["parent"]]
    assert stream["name"] == "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"
    ingress = next(s for s in got if s["service"] == "epp-gateway" and s["name"] == "ingress")
    assert stream["parent"] == ingress["span_id"] and parent.split("-")[2] == ingress["span_id"]
    decision = names[spans.SCHEDULE_SPAN]["attrs"]
    assert decision["epp.candidates"] == 2
    assert decision["epp.endpoint"] == exchange["attrs"]["epp.endpoint"]
    assert decision["epp.route"] == "kv" and "epp.predicted_cached_tokens" in decision
    assert names["POST"]["attrs"]["http.response.status_code"] == 200
    assert names["POST"]["parent"] == exchange["span_id"]


def test_a_client_traceparent_is_honoured(stack: GatewayStack, receiver: tuple[Receiver, int, grpc.Server]) -> None:
    rec = receiver[0]
    r = chat(stack.url, "a client that traces " * 8, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"})
    assert r.status == 200
    assert worker_traceparent(stack, r).split("-")[1] == CLIENT_TRACE
    got = rec.wait(CLIENT_TRACE, PICKER_SPANS | {("epp-gateway", "ingress")})
    gateway = [s for s in got if s["service"] == "epp-gateway" and s["parent"] == CLIENT_PARENT]
    assert gateway, "Envoy did not continue the client's trace"


def test_without_envoys_tracer_the_picker_passes_the_trace_on_to_the_worker(
        stack: GatewayStack, receiver: tuple[Receiver, int, grpc.Server]) -> None:
    rec = receiver[0]
    assert stack.app is not None
    plain = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=stack.app.grpc_port)).start()
    try:
        trace_id = os.urandom(16).hex()
        r = chat(plain.url, "no tracer in this gateway " * 8, {"traceparent": f"00-{trace_id}-{CLIENT_PARENT}-01"})
        assert r.status == 200
        sent = worker_traceparent(stack, r).split("-")
    finally:
        plain.stop()
    assert sent[1] == trace_id
    got = rec.wait(trace_id, PICKER_SPANS)
    exchange = next(s for s in got if s["name"] == spans.EXCHANGE_SPAN)
    assert exchange["attrs"]["epp.trace.parent"] == "client" and exchange["parent"] == CLIENT_PARENT
    assert sent[2] == exchange["span_id"]  # the engine's spans will hang under the picker's
    assert not [s for s in got if s["service"] == "epp-gateway"]


def test_grpcios_transport_reads_envoys_context_too(receiver: tuple[Receiver, int, grpc.Server]) -> None:
    """--extproc-transport grpcio: the stream's metadata comes from grpc.aio's servicer context."""
    rec, port, _ = receiver
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        mp.setenv("OTEL_SERVICE_NAME", "epp-extproc-grpcio")
        s = GatewayStack(workers=1, picker={"extproc_transport": "grpcio"},
                         envoy_opts={"tracing_otlp": f"127.0.0.1:{port}"}).start()
    try:
        r = chat(s.url, "through grpcio " * 8)
        assert r.status == 200
        trace_id = worker_traceparent(s, r).split("-")[1]
        got = rec.wait(trace_id, {("epp-extproc-grpcio", spans.EXCHANGE_SPAN), ("epp-gateway", "ingress")})
    finally:
        s.stop()  # after the wait: Envoy ships its spans every 5 s
    exchange = next(x for x in got if x["name"] == spans.EXCHANGE_SPAN)
    assert exchange["attrs"]["epp.trace.parent"] == "gateway"


def test_a_broken_collector_costs_only_a_counted_export_error(
        stack: GatewayStack, receiver: tuple[Receiver, int, grpc.Server]) -> None:
    receiver[2].stop(0).wait()  # the collector is gone (last test of the module)
    before = stack.picker_metric("epp_trace_export_errors_total")
    for i in range(5):
        assert chat(stack.url, f"collector down {i} " * 8).status == 200
    deadline = time.monotonic() + 20
    while stack.picker_metric("epp_trace_export_errors_total") <= before:
        assert time.monotonic() < deadline, "no export error counted"
        time.sleep(0.2)
    assert chat(stack.url, "still routing").status == 200
