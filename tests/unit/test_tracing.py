"""Tracing without a socket: the real edge, picker and Director, with spans kept in memory (the SDK's own
in-memory exporter; the OTLP wire is tested through a real Envoy in tests/integration/test_tracing_envoy.py)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import opentelemetry.sdk.trace as sdk_trace
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from epp_extproc import tracing as tracing_pkg
from epp_extproc.config import Config
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.flow_queue import Ticket
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.plan import Plan
from epp_extproc.core.request import RequestContext
from epp_extproc.dev import envoy_config
from epp_extproc.envoy.extproc import ExtProcServicer
from epp_extproc.gaie import DEST_HEADER
from epp_extproc.metrics import PickerMetrics
from epp_extproc.tracing import spans
from epp_extproc.tracing.logs import TraceIds
from epp_extproc.tracing.spans import CountingExporter, SpanQueue, Tracing
from tests.scheduling_fakes import ADDRS, FakeKv, FakeRenderer, build_decider

Mode = processing_mode_pb2.ProcessingMode
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
UNSAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-00"
TRACEPARENT_KEY = "traceparent"
BODY = b'{"model":"m","messages":[{"role":"user","content":"secret prompt text"}]}'


class Context:
    """The servicer context as the edge reads it: the stream's initial metadata (where Envoy puts its span)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: object, details: str) -> None:
        raise RuntimeError(details)


def memory_tracing(sampler: Any = None) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    queue = SpanQueue(exporter, Resource.create({"service.name": "test"}), immediate=True)
    return Tracing(queue, sampler or ParentBased(ALWAYS_ON)), exporter


def servicer(tr: Tracing | None, admission: Any = None) -> ExtProcServicer:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(ADDRS)])
    metrics = PickerMetrics()
    renderer = FakeRenderer()
    renderer.base_url = "http://10.1.2.3:8001"
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://10.1.2.3:8001")
    d = build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=renderer, kv=FakeKv(),
                      admission=admission, tracing=tr)
    picker = Picker(d.director, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24),
                    lean=LeanSignals(d.load, metrics))
    return ExtProcServicer(picker, allowed_modes=("FULL_DUPLEX_STREAMED",), body_timeout_s=5, tracing=tr)


def request(headers: dict[str, str] | None = None, body: bytes = BODY) -> list[pb.ProcessingRequest]:
    hs = [base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
          base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
    hs += [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in (headers or {}).items()]
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs)))
    first.protocol_config.request_body_mode = Mode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
    return [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


async def run(svc: ExtProcServicer, msgs: list[pb.ProcessingRequest], metadata: tuple[tuple[str, str], ...] = ()
              ) -> list[pb.ProcessingResponse]:
    async def feed() -> AsyncIterator[pb.ProcessingRequest]:
        for m in msgs:
            yield m

    return [r async for r in svc.Process(feed(), Context(metadata))]  # type: ignore[arg-type]


def set_headers(resp: pb.ProcessingResponse) -> dict[str, str]:
    m = resp.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in m.set_headers}


def by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {s.name: s for s in exporter.get_finished_spans()}


# ------------------------------------------------------------------------------------------ off
@pytest.fixture
def span_count(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every span object the process makes, recording (SDK) or not (API)."""
    made = [0]
    for cls in (sdk_trace.ReadableSpan, NonRecordingSpan):
        original = cls.__init__

        def counting(self: Any, *a: Any, _original: Any = original, **kw: Any) -> None:
            made[0] += 1
            _original(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", counting)
    yield made


async def test_tracing_off_makes_no_span_object_on_a_request(span_count: list[int]) -> None:
    out = await run(servicer(None), request({"traceparent": SAMPLED}), (("traceparent", SAMPLED),))
    assert out[0].WhichOneof("response") == "request_headers"
    assert "traceparent" not in set_headers(out[0])  # off: the picker passes nothing on
    assert span_count[0] == 0
    tr, _ = memory_tracing()  # the counter does count: the same request with tracing on makes spans
    await run(servicer(tr), request(), ())
    assert span_count[0] >= 4


def test_off_unless_an_endpoint_is_set_and_then_the_sdk_is_never_imported() -> None:
    assert not tracing_pkg.enabled_by({})
    assert not tracing_pkg.enabled_by({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"})
    assert tracing_pkg.enabled_by({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert tracing_pkg.enabled_by({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    assert not tracing_pkg.enabled_by({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_pkg.enabled_by({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"})
    code = ("import sys, os\n"
            "for k in list(os.environ):\n"
            "    k.startswith('OTEL_') and os.environ.pop(k)\n"
            "from epp_extproc.app import PickerApp\n"
            "from epp_extproc.config import Config\n"
            "app = PickerApp(Config(endpoints='127.0.0.1:9'))\n"
            "assert app.tracing is None\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ on
async def test_envoys_span_in_the_stream_metadata_is_the_parent_and_the_worker_gets_no_header() -> None:
    tr, exporter = memory_tracing()
    out = await run(servicer(tr), request({"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}),
                    (("traceparent", SAMPLED),))
    assert "traceparent" not in set_headers(out[0])  # Envoy traces: its router injects its own context
    spans_ = by_name(exporter)
    ex = spans_[spans.EXCHANGE_SPAN]
    assert ex.kind is SpanKind.SERVER
    assert format(ex.context.trace_id, "032x") == TRACE_ID  # the gateway's, not the client's header
    assert format(ex.parent.span_id, "016x") == PARENT_ID
    assert ex.attributes["rpc.system"] == "grpc"
    assert ex.attributes["epp.trace.parent"] == "gateway"
    assert ex.attributes["gen_ai.request.model"] == "m"
    assert ex.attributes["epp.endpoint"] in ADDRS
    for name in ("POST", spans.KV_LOOKUP_SPAN, spans.SCHEDULE_SPAN):
        s = spans_[name]
        assert s.context.trace_id == ex.context.trace_id
    assert spans_["POST"].parent.span_id == ex.context.span_id
    assert spans_[spans.KV_LOOKUP_SPAN].parent.span_id == spans_[spans.SCHEDULE_SPAN].context.span_id


async def test_the_decision_span_says_what_decided_and_no_span_carries_the_prompt() -> None:
    tr, exporter = memory_tracing()
    await run(servicer(tr), request(), (("traceparent", SAMPLED),))
    spans_ = by_name(exporter)
    d = spans_[spans.SCHEDULE_SPAN].attributes
    assert d["epp.candidates"] == 2
    assert d["epp.endpoint"] in ADDRS
    assert d["epp.route"] == "kv"
    assert "epp.pd.path" not in d  # no prefill workers: no P/D verdict to explain
    assert isinstance(d["epp.cost"], float)
    assert d["epp.predicted_cached_tokens"] in (0, 64)  # FakeKv: 2 blocks of 32 on the first worker
    assert d["epp.scheduling.handler"] in ("single-profile-handler", "pd-profile-handler")
    assert all("/" in p for p in d["epp.scheduling.plugins"].split(","))
    assert d["gen_ai.usage.input_tokens"] == 100
    render = spans_["POST"]
    assert render.kind is SpanKind.CLIENT
    assert render.attributes["server.address"] == "10.1.2.3" and render.attributes["server.port"] == 8001
    assert render.attributes["url.full"] == "http://10.1.2.3:8001/v1/chat/completions/render"
    assert render.attributes["http.response.status_code"] == 200
    dump = json.dumps([dict(s.attributes) for s in exporter.get_finished_spans()])
    assert "secret prompt text" not in dump and "[0, 1, 2" not in dump


async def test_a_client_traceparent_is_honoured_and_passed_on_to_the_worker_when_envoy_does_not_trace() -> None:
    tr, exporter = memory_tracing()
    out = await run(servicer(tr), request({"traceparent": SAMPLED}))
    ex = by_name(exporter)[spans.EXCHANGE_SPAN]
    assert format(ex.context.trace_id, "032x") == TRACE_ID
    assert ex.attributes["epp.trace.parent"] == "client"
    sent = set_headers(out[0])["traceparent"]
    assert sent[:53] == f"00-{TRACE_ID}-{format(ex.context.span_id, '016x')}-"  # the engine's parent: our span
    assert int(sent[53:], 16) & 1  # sampled


async def test_without_any_context_the_picker_starts_the_trace_and_passes_it_on() -> None:
    tr, exporter = memory_tracing()
    out = await run(servicer(tr), request())
    ex = by_name(exporter)[spans.EXCHANGE_SPAN]
    assert ex.parent is None and ex.attributes["epp.trace.parent"] == "none"
    assert set_headers(out[0])["traceparent"].split("-")[1] == format(ex.context.trace_id, "032x")


async def test_an_unsampled_gateway_trace_costs_no_stage_span_and_exports_nothing(span_count: list[int]) -> None:
    tr, exporter = memory_tracing()
    await run(servicer(tr), request(), (("traceparent", UNSAMPLED),))
    assert exporter.get_finished_spans() == ()
    assert span_count[0] == 0  # an unsampled parent, followed: no span object at all


def test_envoys_unsampled_context_is_read_in_one_pass_up_to_its_traceparent() -> None:
    """Envoy's tracer puts a fresh `traceparent` (and an empty `tracestate`) in every ext_proc stream's metadata;
    for the 90% it does not sample, the picker reads no further than the `traceparent` (no `tracestate` scan)."""

    class Metadata(list):  # type: ignore[type-arg]
        def __init__(self, items: list[tuple[str, str]]) -> None:
            super().__init__(items)
            self.read: list[str] = []

        def __iter__(self) -> Any:
            for k, v in super().__iter__():
                self.read.append(k)
                yield k, v

    tr, _ = memory_tracing()
    md = Metadata([("x-forwarded-for", "192.0.2.2"), ("traceparent", UNSAMPLED), ("tracestate", ""),
                   ("x-envoy-internal", "true")])
    assert tr.exchange(Context(md), {}, "POST", "/v1/chat/completions") == (None, ())  # type: ignore[arg-type]
    assert md.read == ["x-forwarded-for", "traceparent"]
    md = Metadata([("traceparent", SAMPLED), ("tracestate", "k=v")])
    span, sent = tr.exchange(Context(md), {}, "POST", "/v1/chat/completions")  # type: ignore[arg-type]
    assert isinstance(span, spans.ExchangeSpan) and span._state == "k=v"  # a sampled one keeps its tracestate
    assert sent == []  # Envoy traces: its router passes the context on


def test_h2grpcs_call_is_asked_for_the_traceparent_alone_and_the_answer_is_the_same() -> None:
    """h2grpc's context gives one metadata field without building the tuple (`metadata_value`): the same
    decision, span and parent as from `invocation_metadata()`; the tracestate is read only for a sampled one."""
    import types

    from h2grpc.call import Call

    class Watched:
        def __init__(self, call: Call) -> None:
            self.call = call
            self.asked: list[str] = []

        def metadata_value(self, key: str) -> str | None:
            self.asked.append(key)
            return self.call.metadata_value(key)

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            self.asked.append("*")
            return self.call.invocation_metadata()

    conn = types.SimpleNamespace(peer_initial_window=65_535, window_shift=0, stream_window=65_535,
                                 loop=types.SimpleNamespace(time=lambda: 0.0))
    tr, _ = memory_tracing()
    for tp, state in ((UNSAMPLED, ""), (SAMPLED, "k=v"), (None, "")):
        fields = [(":method", "POST"), (":path", "/p"), ("x-forwarded-for", "192.0.2.2")]
        if tp is not None:
            fields += [("traceparent", tp), ("tracestate", state)]
        call = Call(conn, 1, "/p", None, fields)  # type: ignore[arg-type]
        watched = Watched(call)
        got = tr.exchange(watched, {}, "POST", "/p")
        want = tr.exchange(Context(call.invocation_metadata()), {}, "POST", "/p")
        asked = watched.asked
        if tp == UNSAMPLED:
            assert got == want == (None, ()) and asked == ["traceparent"]
        elif tp == SAMPLED:
            assert got[0] is not None and want[0] is not None and asked == ["traceparent", "*"]
            assert (got[0].trace_id, got[0].parent_id, got[0]._state, got[1]) == \
                (want[0].trace_id, want[0].parent_id, "k=v", [])
        else:  # no context: the picker starts a trace (always_on: sampled) and passes it on
            assert got[0] is not None and got[0].parent_id is None and asked == ["traceparent"]
            assert got[1] == [("traceparent", f"00-{got[0].trace_id:032x}-{got[0].span_id:016x}-01")]


def test_a_trace_the_picker_starts_unsampled_gets_valid_distinct_ids_from_one_draw(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The 90% a 10% root ratio does not sample: a fresh `traceparent` for the worker (flags 02: not sampled,
    random trace id), its ids from one 192-bit draw: 32 and 16 lower-case hex digits, never all zero, the
    sampling rule read from the trace id's low 64 bits as TraceIdRatioBased reads it."""
    tr, _ = memory_tracing(ParentBased(TraceIdRatioBased(0.1)))
    bound = round(0.1 * (1 << 64))
    shape = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-02")
    seen = set()
    for _ in range(2000):
        span, sent = tr.exchange(Context(), {}, "POST", "/p")
        if span is not None:
            assert span.trace_id & ((1 << 64) - 1) < bound and sent[0][1].endswith("-01")
            continue
        (name, value), = sent
        m = shape.fullmatch(value)
        assert name == "traceparent" and m is not None, value
        trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
        assert trace_id & ((1 << 64) - 1) >= bound  # not sampled by the ratio's rule
        assert trace_id and span_id
        seen.add(value)
        seen.add(m.group(1))
    assert len(seen) > 2 * 1700  # every traceparent and every trace id its own
    # the draw: the top 128 bits are the trace id, the low 64 the span id; a zero part becomes 1
    high = 0xFFFF_FFFF_FFFF_FFF0  # low 64 bits of a trace id over the bound: not sampled
    for drawn, want in (((5 << 64 | high) << 64 | 7, f"00-{5 << 64 | high:032x}-{7:016x}-02"),
                        ((0xAB << 64 | high) << 64, f"00-{0xAB << 64 | high:032x}-{1:016x}-02")):
        monkeypatch.setattr(spans, "_getrandbits", lambda bits, v=drawn: v)
        assert tr.exchange(Context(), {}, "POST", "/p") == (None, [("traceparent", want)])
    for drawn, ids in ((3, (1, 3)), (0, (1, 1))):  # trace id 1: under the bound, sampled
        monkeypatch.setattr(spans, "_getrandbits", lambda bits, v=drawn: v)
        span, sent = tr.exchange(Context(), {}, "POST", "/p")
        assert span is not None and (span.trace_id, span.span_id) == ids
        assert sent == [("traceparent", f"00-{ids[0]:032x}-{ids[1]:016x}-01")]


async def test_unsampled_requests_beside_a_sampled_one_waiting_on_its_render_call_record_nothing_into_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage wrappers skip the context lookup while no sampled request is attached anywhere (`_attached`);
    while one is (here: waiting on its render call), every wrapper asks its own task's context: the unsampled
    requests beside it record nothing, the sampled one records each of its stages once, and the count is back
    to 0 after, a refused request's included."""
    import asyncio

    class Counting:
        def __init__(self) -> None:
            self.gets = 0

        def get(self) -> Any:
            self.gets += 1
            return spans.CURRENT.get()

        def set(self, value: Any) -> Any:
            return spans.CURRENT.set(value)

        def reset(self, token: Any) -> None:
            spans.CURRENT.reset(token)

    gate = asyncio.Event()
    real = FakeRenderer.render

    async def render(self: FakeRenderer, kind: str, body: bytes, *, count: bool = True) -> Any:
        if spans.CURRENT.get() is not None:  # the sampled request waits here, attached
            await gate.wait()
        return await real(self, kind, body, count=count)

    monkeypatch.setattr(FakeRenderer, "render", render)
    lookups = Counting()
    monkeypatch.setattr(spans, "_CURRENT", lookups)
    tr, exporter = memory_tracing()
    svc = servicer(tr)
    await run(svc, request(), (("traceparent", UNSAMPLED),))
    assert lookups.gets == 0 and spans._attached == 0  # nothing attached: no lookup at all
    sampled = asyncio.create_task(run(svc, request(), (("traceparent", SAMPLED),)))
    for _ in range(100):
        await asyncio.sleep(0)
        if spans._attached:
            break
    assert spans._attached == 1  # the sampled one waits on its render call, attached
    for _ in range(3):
        out = await run(svc, request(), (("traceparent", UNSAMPLED),))
        assert out[0].WhichOneof("response") == "request_headers"
    assert lookups.gets > 0 and exporter.get_finished_spans() == ()
    gate.set()
    await sampled
    assert spans._attached == 0
    names = sorted(s.name for s in exporter.get_finished_spans())
    assert names == sorted([spans.EXCHANGE_SPAN, "POST", spans.KV_LOOKUP_SPAN, spans.SCHEDULE_SPAN])
    assert {format(s.context.trace_id, "032x") for s in exporter.get_finished_spans()} == {TRACE_ID}
    await run(svc, request(body=b"{"), (("traceparent", SAMPLED),))  # refused: attached for its log line
    assert spans._attached == 0


async def test_a_client_unsampled_traceparent_goes_on_unchanged_and_costs_no_span(span_count: list[int]) -> None:
    tr, exporter = memory_tracing()
    out = await run(servicer(tr), request({"traceparent": UNSAMPLED}))
    assert "traceparent" not in set_headers(out[0])  # the client's own header reaches the worker as it is
    assert span_count[0] == 0 and exporter.get_finished_spans() == ()


async def test_at_a_10_percent_root_ratio_the_picker_samples_one_in_ten_and_passes_every_decision_on(
        span_count: list[int]) -> None:
    tr, exporter = memory_tracing(ParentBased(TraceIdRatioBased(0.1)))
    svc = servicer(tr)
    sent = []
    for _ in range(400):
        out = await run(svc, request())
        sent.append(set_headers(out[0])["traceparent"])
    sampled = [h for h in sent if int(h[-2:], 16) & 1]
    assert 15 <= len(sampled) <= 75  # 40 expected
    exchanges = [s for s in exporter.get_finished_spans() if s.name == spans.EXCHANGE_SPAN]
    assert {format(s.context.trace_id, "032x") for s in exchanges} == {h.split("-")[1] for h in sampled}
    assert len({h.split("-")[1] for h in sent}) == 400  # every request its own trace, sampled or not
    # the unsampled ones made none, a sampled one only its spans (on the exporter's side)
    assert span_count[0] == len(exporter.get_finished_spans())


async def test_a_sampler_of_another_kind_is_asked_and_tracestate_goes_on_with_the_context() -> None:
    tr, exporter = memory_tracing(ALWAYS_OFF)  # not parent-based: it decides even under a sampled parent
    out = await run(servicer(tr), request({"traceparent": SAMPLED}))
    assert exporter.get_finished_spans() == () and "traceparent" not in set_headers(out[0])
    tr, exporter = memory_tracing(ALWAYS_ON)
    out = await run(servicer(tr), request({"traceparent": UNSAMPLED, "tracestate": "vendor=abc"}))
    sent = set_headers(out[0])
    assert sent["traceparent"].split("-")[1] == TRACE_ID and sent["tracestate"] == "vendor=abc"
    future = f"01-{TRACE_ID}-{PARENT_ID}-01-more"  # a later version: the specification's propagator reads it
    await run(servicer(tr), request({"traceparent": future}))
    assert {format(s.context.trace_id, "032x") for s in exporter.get_finished_spans()} == {TRACE_ID}


def test_the_worker_headers_wire_entries_are_the_messages_append_would_make() -> None:
    """The trace context's headers go into the header mutation as wire bytes (`_set_header_wire`, merged):
    the same message, field for field and in order, as appending HeaderValueOption messages made."""
    from epp_extproc.envoy import extproc

    class Routed:
        address, prefill = "10.0.0.1:8000", None

    overwrite = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    long_state = ",".join(f"v{i}=" + "x" * 20 for i in range(20))  # over 127 and 255 bytes: two-byte lengths
    cases = [[], [("traceparent", SAMPLED)], [("traceparent", UNSAMPLED), ("tracestate", "vendor=abc")],
             [("traceparent", SAMPLED), ("tracestate", long_state)], [("tracestate", "")],
             [("x-" + "k" * 130, "v\u00e9\u4e2d")]]
    for extra in cases:
        for _ in range(2):  # the second time from the prefix kept
            got = extproc._header_mutation(Routed(), ["x-drop"], 12, extra)  # type: ignore[arg-type]
            want = pb.HeaderMutation(remove_headers=["x-drop"])
            want.set_headers.append(base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=extproc.DEST_HEADER, raw_value=b"10.0.0.1:8000")))
            want.set_headers.append(base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-length", raw_value=b"12")))
            for k, v in extra:
                want.set_headers.append(base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=overwrite))
            assert got == want
            assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


async def test_the_workers_traceparent_is_the_last_header_set_in_every_body_mode() -> None:
    """The trace context is merged into the built response's own header mutation (not copied in with it): in
    FULL_DUPLEX_STREAMED (the headers response), BUFFERED (the body response, after content-length) and for a
    request without a body (the headers response), once, last, overwriting a client's copy."""
    from epp_extproc.conformance.protocol import request_messages

    tr, exporter = memory_tracing(ParentBased(ALWAYS_OFF))  # the picker starts every trace, unsampled
    base = servicer(tr)
    svc = ExtProcServicer(base.picker, allowed_modes=("FULL_DUPLEX_STREAMED", "BUFFERED"), body_timeout_s=5,
                          tracing=tr)
    first, rest = request_messages("BUFFERED", BODY)
    bodiless = pb.ProcessingRequest()
    bodiless.CopyFrom(request()[0])
    bodiless.request_headers.end_of_stream = True
    overwrite = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    for msgs, which in ((request(), "request_headers"), ([first, *rest], "request_body"),
                        ([bodiless], "request_headers")):
        out = await run(svc, msgs)
        decided = [r for r in out if r.WhichOneof("response") in ("request_headers", "request_body")
                   and r.request_headers.response.clear_route_cache | r.request_body.response.clear_route_cache]
        assert len(decided) == 1 and decided[0].WhichOneof("response") == which
        mutation = getattr(decided[0], which).response.header_mutation
        keys = [h.header.key for h in mutation.set_headers]
        assert keys.count("traceparent") == 1 and keys[-1] == "traceparent", keys
        assert keys[0] == DEST_HEADER
        if which == "request_body":
            assert keys[-2] == "content-length"
        last = mutation.set_headers[-1]
        assert last.append_action == overwrite and re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-02",
                                                                last.header.raw_value.decode())
    assert exporter.get_finished_spans() == ()


def test_an_unsampled_parent_matched_without_a_parse_is_decided_as_the_parse_decides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Envoy's unsampled `traceparent` is recognised by one regex (`_UNSAMPLED_V00`), not parsed: for every
    shape, valid or not, the exchange decides what the parse alone decides (followed, or a trace of its own)."""
    odd = [UNSAMPLED, UNSAMPLED.upper().replace("X", "x"), f"00-{'0' * 32}-{PARENT_ID}-00",
           f"00-{TRACE_ID}-{'0' * 16}-00", f"00-{TRACE_ID}-{PARENT_ID}-02", f"00-{TRACE_ID[:-1]}_-{PARENT_ID}-00",
           f"00-{TRACE_ID}-{PARENT_ID}-00-x", f"01-{TRACE_ID}-{PARENT_ID}-00", f"00-{TRACE_ID}-{PARENT_ID}-0",
           f"00-+{TRACE_ID[1:]}-{PARENT_ID}-00", f"00-{TRACE_ID}-{PARENT_ID}-00 ", SAMPLED, "garbage-00"]

    def decide(tr: Tracing, sampler: Any, tp: str, where: str) -> tuple[Any, ...]:
        md, hs = (((TRACEPARENT_KEY, tp),), {}) if where == "gateway" else ((), {"traceparent": [tp]})
        span, sent = tr.exchange(Context(md), hs, "POST", "/p")
        if span is None:  # followed (nothing sent), or a trace of its own, unsampled (fresh random ids)
            return ("followed",) if not sent else ("root",)
        if span.parent_id is None:  # a trace of its own, sampled (at ratio 0.5, by its random id)
            return ("root",) if sampler is ratio else ("root", "sampled")
        return "span", span.trace_id, span.parent_id, [k for k, _ in sent]

    ratio = ParentBased(TraceIdRatioBased(0.5))

    for sampler in (ParentBased(ALWAYS_ON), ratio, ALWAYS_ON):
        tr, _ = memory_tracing(sampler)
        for where in ("gateway", "client"):
            for tp in odd:
                fast = decide(tr, sampler, tp, where)
                monkeypatch.setattr(spans, "_UNSAMPLED_V00", lambda value: None)  # every one parsed
                parsed = decide(tr, sampler, tp, where)
                monkeypatch.undo()
                assert fast == parsed, (tp, where, sampler)
    assert spans._UNSAMPLED_V00(UNSAMPLED) is not None  # the fast path is taken for Envoy's shape


def test_traceparent_fast_parse_accepts_only_version_00() -> None:
    assert spans._parse_traceparent(SAMPLED) == (int(TRACE_ID, 16), int(PARENT_ID, 16), 1)
    assert spans._parse_traceparent(UNSAMPLED) == (int(TRACE_ID, 16), int(PARENT_ID, 16), 0)
    for bad in ("", "garbage", SAMPLED.replace("00-", "01-", 1), f"00-{'0' * 32}-{PARENT_ID}-01",
                f"00-{TRACE_ID}-{'0' * 16}-01", f"00-{'x' * 32}-{PARENT_ID}-01", SAMPLED + "-extra"):
        assert spans._parse_traceparent(bad) is None


async def test_a_refused_request_is_an_error_span_with_the_reason() -> None:
    tr, exporter = memory_tracing()
    out = await run(servicer(tr), request(body=b"{"), (("traceparent", SAMPLED),))
    assert out[-1].WhichOneof("response") == "immediate_response"
    ex = by_name(exporter)[spans.EXCHANGE_SPAN]
    assert ex.status.status_code is StatusCode.ERROR
    assert ex.attributes["error.type"] == Problem.BAD_REQUEST.value


async def test_the_flow_control_wait_is_a_span() -> None:
    async def admit(ctx: RequestContext) -> Ticket:
        return Ticket(None, waited_s=0.25)

    async def drop(ctx: RequestContext) -> Ticket:
        raise PickError(Problem.FLOW_TTL_EXPIRED, "waited too long")

    tr, exporter = memory_tracing()
    await run(servicer(tr, admission=admit), request(), (("traceparent", SAMPLED),))
    wait = by_name(exporter)[spans.FLOW_WAIT_SPAN]
    assert wait.attributes["epp.flow_control.waited_s"] == 0.25
    exporter.clear()
    await run(servicer(tr, admission=drop), request(), (("traceparent", SAMPLED),))
    wait = by_name(exporter)[spans.FLOW_WAIT_SPAN]
    assert wait.status.status_code is StatusCode.ERROR and "error.type" in wait.attributes


# ------------------------------------------------------------------------------------------ setup, logs
def test_a_collector_that_fails_is_a_counted_error() -> None:
    class Broken(InMemorySpanExporter):
        def export(self, spans_: Any) -> SpanExportResult:
            return SpanExportResult.FAILURE

    class Raising(InMemorySpanExporter):
        def export(self, spans_: Any) -> SpanExportResult:
            raise ConnectionError("collector gone")

    registry = CollectorRegistry()
    from prometheus_client import Counter

    errors = Counter("errs", "test", registry=registry)
    assert CountingExporter(Broken(), errors).export([]) is SpanExportResult.FAILURE
    assert CountingExporter(Raising(), errors).export([]) is SpanExportResult.FAILURE
    assert CountingExporter(InMemorySpanExporter(), errors).export([]) is SpanExportResult.SUCCESS
    assert registry.get_sample_value("errs_total") == 2


def test_the_standard_variables_choose_exporter_sampler_and_service() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    t = Tracing.from_env(base, CollectorRegistry())
    try:
        assert t.resource.attributes["service.name"] == "epp-extproc"
        assert "parentbased" in t.sampler.get_description().lower()
        assert isinstance(t.queue.exporter.inner, Grpc)
    finally:
        t.shutdown()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",  # http/protobuf: the specification's default
           "OTEL_SERVICE_NAME": "picker-a", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    t = Tracing.from_env(env, CollectorRegistry())
    try:
        attrs = t.resource.attributes
        assert attrs["service.name"] == "picker-a" and attrs["deployment.environment"] == "test"
        assert "0.1" in t.sampler.get_description()
        exp = t.queue.exporter.inner
        assert isinstance(exp, Http) and exp._endpoint == "http://127.0.0.1:4318/v1/traces"
    finally:
        t.shutdown()
    with pytest.raises(ValueError):
        Tracing.from_env({**base, "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"})


async def test_json_log_lines_carry_the_trace_while_a_request_is_decided() -> None:
    from pythonjsonlogger.json import JsonFormatter

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep()
    handler.setFormatter(JsonFormatter("%(levelname)s %(name)s %(message)s"))
    handler.addFilter(TraceIds())
    logger = logging.getLogger("epp_extproc")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        tr, exporter = memory_tracing()
        await run(servicer(tr), request(), (("traceparent", SAMPLED),))  # the decision's debug line
        await run(servicer(tr), request(body=b"{"), (("traceparent", SAMPLED),))  # the rejection's info line
        logging.getLogger("epp_extproc.test").info("outside any request")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    docs = [json.loads(line) for line in lines]
    decision = [d for d in docs if d["message"].startswith("-> ")]
    rejected = [d for d in docs if d["message"].startswith("rejected")]
    assert decision and rejected
    for d in decision + rejected:
        assert d["trace_id"] == TRACE_ID and len(d["span_id"]) == 16
    assert "trace_id" not in docs[-1]


def test_plan_says_why_a_request_is_routed_by_load() -> None:
    assert Plan().load_reason == "not_rendered"
    assert Plan(kind="chat").load_reason == "render_failed"
    assert Plan(kind="chat", tokens=[1]).load_reason == "no_kv_index"
    assert Plan(kind="chat", salted_load_only=True).load_reason == "salted_load_only"
    assert Plan(tokens=[1], prompt=object()).load_reason is None  # type: ignore[arg-type]


def test_envoy_config_turns_envoys_opentelemetry_tracer_on() -> None:
    assert "tracing" not in json.dumps(envoy_config.to_dict(envoy_config.EnvoyOptions()))
    opts, _ = envoy_config.options_from_args(["--tracing-otlp", "127.0.0.1:4317", "--tracing-sample-percent", "10"])
    doc = envoy_config.to_dict(opts)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["tracing"]["random_sampling"]["value"] == 10.0
    assert hcm["tracing"]["provider"]["name"] == "envoy.tracers.opentelemetry"
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    sock = clusters["otlp_collector"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert sock["socket_address"] == {"address": "127.0.0.1", "port_value": 4317}
    with pytest.raises(ValueError):
        envoy_config.to_dict(envoy_config.EnvoyOptions(tracing_otlp="no-port"))


async def test_spans_reach_an_otlp_http_collector_the_default_protocol() -> None:
    """The exporter the standard variables choose by default (OTLP/HTTP) against a real receiver of the
    protocol's own protobuf (the gRPC one is exercised through Envoy: tests/integration/test_tracing_envoy.py)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from tests.otlp_receiver import http_bodies

    with http_bodies() as (port, bodies):
        tr = Tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, CollectorRegistry())
        await run(servicer(tr), request(), (("traceparent", SAMPLED),))
        tr.shutdown()  # flushes
    got = [(path, s.trace_id.hex()) for path, body in bodies
           for rs in trace_service_pb2.ExportTraceServiceRequest.FromString(body).resource_spans
           for ss in rs.scope_spans for s in ss.spans]
    assert len(got) == 4 and set(got) == {("/v1/traces", TRACE_ID)}


def test_the_export_queue_batches_on_its_thread_bounds_what_waits_and_flushes_at_shutdown() -> None:
    exporter = InMemorySpanExporter()
    registry = CollectorRegistry()
    from prometheus_client import Counter

    dropped = Counter("dropped", "test", registry=registry)
    queue = SpanQueue(exporter, Resource.create({}), max_queue=3, delay_s=60, batch=100, dropped=dropped)
    record = (int(TRACE_ID, 16), "", 7, 0, 1, 2, {"a": 1}, None, (("child", SpanKind.CLIENT.value, 8, 7, 1, 2, {}, "bad"),))
    for _ in range(5):
        queue.put(record)  # type: ignore[arg-type]
    assert queue.dropped == 2 and exporter.get_finished_spans() == ()  # nothing exported on the caller's thread
    assert registry.get_sample_value("dropped_total") == 2
    queue.shutdown()
    spans_ = exporter.get_finished_spans()
    assert len(spans_) == 6
    child = next(s for s in spans_ if s.name == "child")
    assert child.parent.span_id == 7 and child.status.status_code is StatusCode.ERROR and child.kind is SpanKind.CLIENT


def test_tracing_stays_off_with_one_error_when_the_otlp_protos_are_xds_protos_older_copy(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """xds-protos and opentelemetry-proto both ship `opentelemetry/proto`; a fresh install may leave the older
    copy, and the exporters cannot load: the picker serves without tracing and says how to repair it."""
    import epp_extproc.dev.otel_protos as protos
    from epp_extproc import tracing

    monkeypatch.setattr(protos, "intact", lambda: False)
    with caplog.at_level("ERROR", logger="epp_extproc.tracing"):
        assert tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) is None
    assert "pip install --force-reinstall --no-deps opentelemetry-proto==" in caplog.text


def test_the_installed_otlp_protos_are_opentelemetry_protos_own() -> None:
    """`make install` repairs what a fresh install may leave (epp_extproc/dev/otel_protos.py)."""
    from epp_extproc.dev.otel_protos import intact

    assert intact()
