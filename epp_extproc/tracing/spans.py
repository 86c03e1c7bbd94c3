"""The picker's spans, made with the OpenTelemetry SDK and shipped by its OTLP exporters (imported only when
tracing is on: see the package's docstring).

One trace per request, joined to the gateway's:

- `ExchangeSpan`: the ext_proc stream (an RPC server span). Its parent is read from the stream's initial
  metadata, where Envoy's gRPC client injects the request's active span when Envoy's tracing is on (ext_proc.cc
  `openStream()` hands the filter's active span to the async client as the stream's parent); failing that, from
  the request's own `traceparent` (a client's trace, Envoy's tracing off). In that second case Envoy's router
  will not inject anything into the upstream request, so the picker sets `traceparent` on it: the engine's
  spans join the same trace.
- the stages under it, each a wrapper around a part the Director already calls, so the Director stays as it
  is: the render call (`TracedRenderer`, an HTTP client span), the KV lookup (`TracedKv`), the scheduling
  decision (`TracedScheduler`), the flow-control wait (`traced_admission`), and a commit hook (`TraceHook`)
  that writes what only a committed decision knows onto the exchange's span.

Cheap when on: the stage wrappers make a span only under a recording (sampled) exchange span, so at 10%
sampling nine requests in ten cost one non-recording span and a context lookup or two. No prompt text and no
token ids are ever put in a span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import sampling as otel_sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter

from epp_extproc.core.contract import BookingHandle, KvLookup, PromptKey
from epp_extproc.core.decision import Stopwatch
from epp_extproc.core.director import predicted_cached_tokens
from epp_extproc.core.errors import PickError
from epp_extproc.core.flow_queue import Ticket
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.render import Rendered, Renderer, RenderError
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.result import SchedulingResult
from epp_extproc.core.scheduling.table import SchedulingRequest

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXCHANGE_SPAN = f"{EXT_PROC_SERVICE}/Process"  # the RPC semantic conventions' span name
SCHEDULE_SPAN = "epp.schedule"
KV_LOOKUP_SPAN = "epp.kv.lookup"
FLOW_WAIT_SPAN = "epp.flow_control.wait"
DEFAULT_SERVICE = "epp-extproc"
_W3C = TraceContextTextMapPropagator()


# ------------------------------------------------------------------------------------------------ setup
def _sampler(environ: Mapping[str, str]) -> otel_sampling.Sampler:
    """`OTEL_TRACES_SAMPLER` / `_ARG` as the specification names them; read from `environ` (not the process's)
    so that a test can configure one picker without touching the others. Default: parent-based, always on:
    whoever starts the trace (Envoy, with its sampling percentage, or the client) decides."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    try:
        ratio = float(arg) if arg else 1.0
    except ValueError:
        log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a number: using 1.0", arg[:40])
        ratio = 1.0
    samplers: dict[str, Callable[[], otel_sampling.Sampler]] = {
        "always_on": lambda: otel_sampling.ALWAYS_ON,
        "always_off": lambda: otel_sampling.ALWAYS_OFF,
        "traceidratio": lambda: otel_sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: otel_sampling.ParentBased(otel_sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: otel_sampling.ParentBased(otel_sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: otel_sampling.ParentBased(otel_sampling.TraceIdRatioBased(ratio)),
    }
    make = samplers.get(name)
    if make is None:
        log.warning("OTEL_TRACES_SAMPLER=%r is not supported: using parentbased_always_on", name[:40])
        make = samplers["parentbased_always_on"]
    return make()


def _pairs(text: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS)."""
    out: dict[str, str] = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out[k.strip()] = v.strip()
    return out


def _resource(environ: Mapping[str, str]) -> Resource:
    attrs: dict[str, Any] = dict(_pairs(environ.get("OTEL_RESOURCE_ATTRIBUTES", "")))
    attrs["service.name"] = environ.get("OTEL_SERVICE_NAME", "").strip() or attrs.get("service.name") \
        or DEFAULT_SERVICE
    return Resource.create(attrs)


def _exporter(environ: Mapping[str, str]) -> SpanExporter:
    """The OTLP exporter `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL` names: `grpc` (default) or `http/protobuf`."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    specific = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    general = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    headers = _pairs(environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or environ.get("OTEL_EXPORTER_OTLP_HEADERS")
                     or "") or None
    timeout_raw = environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    timeout_s = float(timeout_raw) / 1000 if timeout_raw else None  # the specification's unit: milliseconds
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        endpoint = specific or general.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint, headers=headers, timeout=timeout_s)
    if protocol != "grpc":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    endpoint = specific or general
    insecure_env = (environ.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or environ.get("OTEL_EXPORTER_OTLP_INSECURE")
                    or "").strip().lower()
    insecure = insecure_env == "true" or urlsplit(endpoint).scheme == "http"
    return GrpcExporter(endpoint=endpoint, insecure=insecure, headers=headers, timeout=timeout_s)


class CountingExporter(SpanExporter):
    """Counts what the collector did not take: an unreachable or broken collector costs the picker a counted
    error (and the exporter's own bounded retries on its own thread), never a request."""

    def __init__(self, inner: SpanExporter, errors: Counter | None) -> None:
        self.inner = inner
        self.errors = errors

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the processor's thread
            log.exception("span export failed")
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS and self.errors is not None:
            self.errors.inc()
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, "") or default)
    except ValueError:
        return default


class Tracing:
    """The picker's tracer and its exporter pipeline, and the wrappers that put spans around the stages."""

    def __init__(self, provider: TracerProvider, errors: Counter | None = None) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("epp_extproc")
        self.export_errors = errors

    @classmethod
    def from_env(cls, environ: Mapping[str, str], registry: CollectorRegistry | None = None) -> Tracing:
        errors = Counter("epp_trace_export_errors", "Span batches the OTLP collector did not take (unreachable, "
                         "refused, timed out): the spans are dropped, requests are not affected",
                         registry=registry) if registry is not None else None
        provider = TracerProvider(sampler=_sampler(environ), resource=_resource(environ))
        provider.add_span_processor(BatchSpanProcessor(
            CountingExporter(_exporter(environ), errors),
            max_queue_size=_int_env(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            schedule_delay_millis=_int_env(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000),
            max_export_batch_size=_int_env(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
            export_timeout_millis=_int_env(environ, "OTEL_BSP_EXPORT_TIMEOUT", 30000)))
        return cls(provider, errors)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop the exporter's thread."""
        self.provider.shutdown()

    # ------------------------------------------------------------------------------ the stages
    def exchange(self, metadata: Iterable[tuple[str, str]], headers: Mapping[str, list[str]], method: str,
                 path: str) -> ExchangeSpan:
        return ExchangeSpan(self.tracer, metadata, headers, method, path)

    def renderer(self, inner: Renderer) -> TracedRenderer:
        return TracedRenderer(inner, self.tracer)

    def kv(self, inner: KvLookup) -> TracedKv:
        return TracedKv(inner, self.tracer)

    def scheduler(self, inner: Any, kv: KvLookup | None) -> TracedScheduler:
        return TracedScheduler(inner, self.tracer, kv)

    def admission(self, inner: Callable[[RequestContext], Awaitable[Ticket]]
                  ) -> Callable[[RequestContext], Awaitable[Ticket]]:
        return traced_admission(inner, self.tracer)

    def hook(self) -> TraceHook:
        return TraceHook()


def _recording() -> bool:
    """Is the request's own span sampled? The stages make no span of their own otherwise."""
    return trace.get_current_span().is_recording()


def _clip(text: str, limit: int = 256) -> str:
    return text if len(text) <= limit else text[:limit]


# ------------------------------------------------------------------------------------------ the exchange
class ExchangeSpan:
    """One ext_proc stream's server span, and the context the stages run in (`attach` / `detach`)."""

    __slots__ = ("span", "ctx", "from_gateway")

    def __init__(self, tracer: trace.Tracer, metadata: Iterable[tuple[str, str]],
                 headers: Mapping[str, list[str]], method: str, path: str) -> None:
        carrier: dict[str, str] = {}
        for k, v in metadata:
            if k == TRACEPARENT or k == TRACESTATE:
                carrier[k] = v
        # Envoy's tracing on: its gRPC client put the request's span in the stream's metadata (the request's own
        # header, if any, is the client's, and Envoy already continued it). Off: the client's header, if any.
        self.from_gateway = TRACEPARENT in carrier
        if not self.from_gateway:
            carrier = {k: headers[k][0] for k in (TRACEPARENT, TRACESTATE) if headers.get(k)}
        parent = _W3C.extract(carrier) if carrier else otel_context.Context()
        self.span = tracer.start_span(EXCHANGE_SPAN, context=parent, kind=SpanKind.SERVER, attributes={
            "rpc.system": "grpc", "rpc.service": EXT_PROC_SERVICE, "rpc.method": "Process",
            "http.request.method": _clip(method, 16), "url.path": _clip(path.split("?", 1)[0]),
            "epp.trace.parent": "gateway" if self.from_gateway else "client" if carrier else "none"})
        self.ctx = trace.set_span_in_context(self.span, parent)

    def attach(self) -> object:
        """Make this request's span current (logs carry its ids, the stages' spans are its children)."""
        return otel_context.attach(self.ctx)

    @staticmethod
    def detach(token: object) -> None:
        otel_context.detach(token)  # type: ignore[arg-type]

    def worker_headers(self) -> list[tuple[str, str]]:
        """The `traceparent` the chosen worker must get: none when the gateway traces (its router injects its
        own), else this span's, so that the engine's spans join the request's trace."""
        if self.from_gateway:
            return []
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, context=self.ctx)
        return list(carrier.items())

    def routed(self, address: str, prefill: str | None) -> None:
        if self.span.is_recording():
            self.span.set_attribute("epp.endpoint", address)
            if prefill is not None:
                self.span.set_attribute("epp.pd.prefill_endpoint", prefill)

    def failed(self, err: PickError) -> None:
        """The picker answered the request itself (a 4xx/5xx of its own): the span says why."""
        if self.span.is_recording():
            self.span.set_attribute("error.type", err.problem.value)
            self.span.set_status(Status(StatusCode.ERROR, _clip(str(err), 200)))

    def end(self) -> None:
        self.span.end()


# ------------------------------------------------------------------------------------------ the stages
class TracedRenderer:
    """The render call as an HTTP client span (semantic conventions: `http.request.method`, `url.full`,
    `server.address`, `http.response.status_code`, `error.type`). A `/debug/score` call (count=False) is not
    traced: it belongs to no request."""

    def __init__(self, inner: Renderer, tracer: trace.Tracer) -> None:
        self.inner = inner
        self.tracer = tracer
        self.protocol = inner.protocol
        base = getattr(inner, "base_url", "")
        u = urlsplit(base)
        self._base = base
        self._attrs: dict[str, Any] = {"http.request.method": "POST", "epp.render.protocol": inner.protocol}
        if u.hostname:
            self._attrs["server.address"] = u.hostname
            self._attrs["server.port"] = u.port or (443 if u.scheme == "https" else 80)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        if not count or not _recording():
            return await self.inner.render(kind, body, count=count)
        from epp_extproc.adapters.render_client import CHAT_PATH, COMPLETIONS_PATH

        attrs = dict(self._attrs)
        attrs["url.full"] = self._base + (CHAT_PATH if kind == "chat" else COMPLETIONS_PATH)
        with self.tracer.start_as_current_span("POST", kind=SpanKind.CLIENT, attributes=attrs,
                                               record_exception=False, set_status_on_exception=False) as span:
            try:
                out = await self.inner.render(kind, body, count=count)
            except RenderError as e:
                span.set_attribute("error.type", e.failure.value)
                if e.status is not None:
                    span.set_attribute("http.response.status_code", e.status)
                span.set_status(Status(StatusCode.ERROR, _clip(e.detail, 200)))
                raise
            span.set_attribute("http.response.status_code", 200)
            span.set_attribute("epp.render.tokens", len(out.token_ids))
            return out


class TracedKv:
    """The KV index lookup that fills a candidate table (`overlap`); every other call passes straight on."""

    def __init__(self, inner: KvLookup, tracer: trace.Tracer) -> None:
        self.inner = inner
        self.tracer = tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def overlap(self, prompt: PromptKey, workers: Sequence[str]) -> Mapping[str, int]:
        if not _recording():
            return self.inner.overlap(prompt, workers)
        with self.tracer.start_as_current_span(KV_LOOKUP_SPAN, attributes={"epp.kv.workers": len(workers)}) as span:
            out = self.inner.overlap(prompt, workers)
            span.set_attribute("epp.kv.workers_with_overlap", sum(1 for v in out.values() if v))
            span.set_attribute("epp.kv.best_overlap_blocks", max(out.values(), default=0))
            return out


def _plugin_names(handler: Any) -> tuple[str, list[str], list[str]]:
    """(handler, profiles, `profile/plugin` names): what decides, fixed when the scheduler is built."""
    profiles, plugins = [], []
    for attr in ("primary", "prefill"):
        p = getattr(handler, attr, None)
        if p is None or not hasattr(p, "filters"):
            continue
        profiles.append(p.name)
        parts = [*(f.name for f in p.filters), *(s.name for s, _ in p.scorers), p.picker.name,
                 *(x.name for x in p.pins)]
        plugins.extend(f"{p.name}/{n}" for n in parts)
    return getattr(handler, "name", type(handler).__name__), profiles, plugins


class TracedScheduler:
    """The scheduling decision as a span: candidates, the chosen endpoint and its cost, credited blocks, the
    prefill/decode pair, predicted cached tokens, the profiles and plugins that decided, and why a request
    was routed by load only."""

    def __init__(self, inner: Any, tracer: trace.Tracer, kv: KvLookup | None) -> None:
        self.inner = inner
        self.tracer = tracer
        self.kv = kv
        name, profiles, plugins = _plugin_names(inner)
        self._static: dict[str, Any] = {"epp.scheduling.handler": name, "epp.scheduling.profiles": profiles,
                                        "epp.scheduling.plugins": plugins}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def candidates(self, req: SchedulingRequest) -> Sequence[str]:
        return self.inner.candidates(req)

    def schedule(self, req: SchedulingRequest, addresses: Sequence[str]) -> SchedulingResult:
        if not _recording():
            return self.inner.schedule(req, addresses)
        with self.tracer.start_as_current_span(SCHEDULE_SPAN, attributes=self._static) as span:
            result = self.inner.schedule(req, addresses)
            span.set_attributes(decision_attributes(req, addresses, result, self.kv))
            return result


def decision_attributes(req: SchedulingRequest, addresses: Sequence[str], result: SchedulingResult,
                        kv: KvLookup | None) -> dict[str, Any]:
    r = result.primary
    t, i = r.table, r.chosen
    attrs: dict[str, Any] = {
        "epp.candidates": len(addresses), "epp.endpoint": r.address, "epp.cost": float(t.cost[i]),
        "epp.route": "kv" if req.prompt is not None else "load",
        "epp.pd.path": result.pd.path.value, "epp.pd.reason": result.pd.reason.value,
    }
    if req.prompt is not None:
        attrs["epp.overlap_blocks"] = int(t.overlap[i])
        attrs["epp.credited_blocks"] = float(t.credited[i])
        attrs["epp.prompt_blocks"] = float(t.prompt_blocks[i])
    elif req.load_reason is not None:
        attrs["epp.load_reason"] = req.load_reason
    if req.prompt_tokens:
        attrs["gen_ai.usage.input_tokens"] = req.prompt_tokens
    if result.pd.prefill is not None:
        attrs["epp.pd.prefill_endpoint"] = result.pd.prefill.address
        attrs["epp.pd.prefill_blocks"] = float(result.pd.prefill_blocks)
    if result.pd.uncached_tokens is not None:
        attrs["epp.pd.uncached_tokens"] = result.pd.uncached_tokens
    predicted = predicted_cached_tokens(result, req.prompt, kv)
    if predicted is not None:
        attrs["epp.predicted_cached_tokens"] = int(predicted)
    for key in ("slo", "session"):
        v = r.outcome.get(key)
        if v is not None:
            attrs[f"epp.{key}"] = str(getattr(v, "value", v))
    return attrs


def traced_admission(inner: Callable[[RequestContext], Awaitable[Ticket]], tracer: trace.Tracer
                     ) -> Callable[[RequestContext], Awaitable[Ticket]]:
    """Flow control's wait for a ticket as a span (`epp.flow_control.waited_s`; an error when it drops)."""

    async def admit(ctx: RequestContext) -> Ticket:
        if not _recording():
            return await inner(ctx)
        with tracer.start_as_current_span(FLOW_WAIT_SPAN, record_exception=False,
                                          set_status_on_exception=False) as span:
            started = time.perf_counter()
            try:
                ticket = await inner(ctx)
            except PickError as e:
                span.set_attribute("error.type", e.problem.value)
                span.set_attribute("epp.flow_control.waited_s", time.perf_counter() - started)
                span.set_status(Status(StatusCode.ERROR, _clip(str(e), 200)))
                raise
            span.set_attribute("epp.flow_control.waited_s", ticket.waited_s)
            return ticket

    return admit


class TraceHook:
    """Commit hook: what only a committed decision knows, on the request's span (the model asked for, the
    endpoint booked, the predicted cached tokens); a proposal that fails or `/debug/score` writes nothing."""

    name = "trace"

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        span = trace.get_current_span()
        if not span.is_recording():
            return None
        attrs: dict[str, Any] = {"epp.endpoint": p.address, "epp.booking": booking.id,
                                 "epp.score_seconds": p.score_seconds}
        if p.model is not None:
            attrs["gen_ai.request.model"] = _clip(p.model, 128)
        if p.predicted_cached_tokens is not None:
            attrs["epp.predicted_cached_tokens"] = int(p.predicted_cached_tokens)
        if p.pd.address is not None:
            attrs["epp.pd.prefill_endpoint"] = p.pd.address
        span.set_attributes(attrs)
        return None
