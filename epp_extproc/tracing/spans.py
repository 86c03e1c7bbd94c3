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

Cheap when on: the sampling decision is made once per request, before any span object exists; a request
that is not sampled makes none (a counter test per stage; a context lookup while another request's sampled
decision is attached), and a sampled one
records its stages as tuples, queued as one record and written as OTLP's bytes on the exporter's thread, for
the SDK's own OTLP exporters (`Tracing`, `SpanQueue` and `otlp_wire` say why). No prompt text and no token ids
are ever put in a span.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from time import time_ns
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import sampling as otel_sampling
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)
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
from epp_extproc.core.scheduling.result import PdPath, PdReason, SchedulingResult
from epp_extproc.core.scheduling.table import SchedulingRequest
from epp_extproc.tracing import otlp_wire
from epp_extproc.tracing.current import CURRENT

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
EXCHANGE_SPAN = f"{EXT_PROC_SERVICE}/Process"  # the RPC semantic conventions' span name
SCHEDULE_SPAN = "epp.schedule"
KV_LOOKUP_SPAN = "epp.kv.lookup"
INGEST_LOOKUP_SPAN = "epp.kv.ingest.lookup"
FLOW_WAIT_SPAN = "epp.flow_control.wait"
SYNC_PUBLISH_SPAN = "epp.replica_sync.publish"  # the gRPC mesh's (NATS: `publish <subject>`, the convention's)
SYNC_SNAPSHOT_SPAN = "epp.replica_sync.snapshot.load"
PLANE_DUMP_SPAN = "epp.kv_plane.dump.load"
REPLICA_SYNC_SERVICE = "epp.v1.ReplicaSync"
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
    """The OTLP exporter `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL` names: `http/protobuf` (the specification's
    default) or `grpc`. Both cost the picker about the same (bench/bench_tracing.py `picker10grpc`)."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf").strip().lower()
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


_LOW64 = (1 << 64) - 1
_getrandbits = random.getrandbits  # the module's generator (seeded as `random.seed` seeds it), bound once
_SAMPLED = TraceFlags(0x01)
_SCOPE = InstrumentationScope("epp_extproc")
_UNSET = Status(StatusCode.UNSET)


def _first(metadata: Iterable[tuple[str, str]] | None, key: str) -> str | None:
    """The first value of `key` in a servicer context's metadata (grpc.aio's: a tuple, or None)."""
    for k, v in metadata or ():
        if k == key:
            return v
    return None


# A version-00 `traceparent` that `_parse_traceparent` reads as valid and unsampled (lower-case hex, neither id
# zero, flags 00): what Envoy's tracer sends for the requests it does not sample, checked by one regex match
# (~3.6k instructions) where the parse makes three ints (~9k). Anything else is parsed.
_UNSAMPLED_V00 = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-00").fullmatch


def _parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a version-00 `traceparent`; None for anything else (the SDK's
    propagator then reads it, and refuses what is invalid). A few string operations, where the propagator
    runs a regex."""
    if len(value) != 55 or value[:3] != "00-" or value[35] != "-" or value[52] != "-":
        return None
    try:
        trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, flags


def _sampling_shape(sampler: otel_sampling.Sampler) -> tuple[bool, float | None]:
    """(follows its parent's decision, the root's sampling ratio): when the sampler is the specification's
    parent-based one over always_on / always_off / traceidratio, the picker decides without calling it.
    (False, None) for another sampler: it is then asked for every request."""
    if not isinstance(sampler, otel_sampling.ParentBased):
        return False, None
    follows = (getattr(sampler, "_remote_parent_not_sampled", None) is otel_sampling.ALWAYS_OFF
               and getattr(sampler, "_remote_parent_sampled", None) is otel_sampling.ALWAYS_ON)
    root = getattr(sampler, "_root", None)
    if root is otel_sampling.ALWAYS_ON:
        return follows, 1.0
    if root is otel_sampling.ALWAYS_OFF:
        return follows, 0.0
    if isinstance(root, otel_sampling.TraceIdRatioBased):
        return follows, root.rate
    return follows, None


# The sampled request whose decision is running (set by ExchangeSpan.attach): the stage wrappers record into it.
_CURRENT = CURRENT
# How many sampled requests are attached right now (`ExchangeSpan.attach` .. `detach`), in any task. While none
# is, no task's request can be recorded, and the stage wrappers pass straight on without the context lookup
# (~700 instructions each, four or five per request: most of what an unsampled request's stages cost); while one
# is (a sampled decision waiting on its render call, say), every wrapper asks the context, as before.
_attached = 0


# One sampled request, as it waits for the exporter: only ints, strings and dicts of them, so that the cyclic
# collector untracks it and never walks it. (The SDK's span objects, queued for seconds in the hundreds,
# were promoted to the oldest generation and made its full collections, which walk the KV index too, run
# far more often: that, not the spans themselves, was most of a sampled request's cost.)
#   (trace id, tracestate header, exchange span id, its parent id or 0, start, end, attributes, error or None,
#    children: (name, SpanKind value, span id, parent id, start, end, attributes, error or None), ...)
Record = tuple[int, str, int, int, int, int, dict[str, Any], "str | None", tuple[tuple[Any, ...], ...]]
# A span of its own, not a request's exchange (a booking's publish to the peers, a start-up load): its name first,
# so that `_spans` tells the two apart by the first item's type.
#   (name, SpanKind value, trace id, span id, parent id or 0, start, end, attributes, error or None)
Loose = tuple[str, int, int, int, int, int, int, dict[str, Any], "str | None"]


class SpanQueue:
    """The exporter's queue and thread (the SDK's BatchSpanProcessor, for records instead of span objects):
    `put` is a deque append; every `delay_s`, or as soon as `batch` records wait, the thread turns them into
    spans and exports them. Bounded: past `max_queue` records, new ones are dropped and
    counted. `immediate` (tests) exports in `put`, on the caller's thread. `wire`: the exporter takes the
    records encoded as OTLP's bytes (`otlp_wire`: the SDK's OTLP exporters, once `otlp_wire.install`ed), not
    the SDK's span objects (any other exporter)."""

    def __init__(self, exporter: SpanExporter, resource: Resource, *, max_queue: int = 2048, delay_s: float = 5.0,
                 batch: int = 512, immediate: bool = False, dropped: Counter | None = None,
                 wire: bool = False) -> None:
        self.exporter = exporter
        self.resource = resource
        self._convert = self._encoded if wire else self._spans
        self._resource_attrs = dict(resource.attributes)
        # the request's resource and scope, the same in every batch: encoded once
        self._envelope = otlp_wire.envelope(self._resource_attrs, resource.schema_url, _SCOPE.name,
                                            _SCOPE.version or "")
        self.max_queue = max_queue
        self.delay_s = delay_s
        self.batch = batch
        self.dropped = 0
        self._dropped = dropped  # the Prometheus counter of the same
        self._q: deque[Record | Loose] = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._immediate = immediate
        self._thread: threading.Thread | None = None
        if not immediate:
            self._thread = threading.Thread(target=self._run, name="epp-trace-export", daemon=True)
            self._thread.start()

    def put(self, record: Record | Loose) -> None:
        if self._immediate:
            self.exporter.export(self._convert([record]))
            return
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            if self._dropped is not None:
                self._dropped.inc()
            return
        self._q.append(record)
        if len(self._q) >= self.batch:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._drain()
            if self._stop:
                return

    def _drain(self) -> None:
        self._idle.clear()
        try:
            while self._q:
                records = [self._q.popleft() for _ in range(min(self.batch, len(self._q)))]
                try:
                    self.exporter.export(self._convert(records))
                except Exception:  # CountingExporter counts; this thread must live on
                    log.exception("span export failed")
        finally:
            self._idle.set()

    def _spans(self, records: Sequence[Record | Loose]) -> list[ReadableSpan]:
        out: list[ReadableSpan] = []
        resource = self.resource
        for record in records:
            if isinstance(record[0], str):
                out.append(self._loose(record))  # type: ignore[arg-type]
                continue
            trace_id, state_header, span_id, parent_id, t0, t1, attrs, err, children = record  # type: ignore[misc]
            state = TraceState.from_header([state_header]) if state_header else TraceState()
            contexts = {span_id: SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED,
                                             trace_state=state)}
            for child in children:
                contexts[child[2]] = SpanContext(trace_id, child[2], is_remote=False, trace_flags=_SAMPLED,
                                                 trace_state=state)
            parent = SpanContext(trace_id, parent_id, is_remote=True, trace_flags=_SAMPLED, trace_state=state) \
                if parent_id else None
            out.append(ReadableSpan(EXCHANGE_SPAN, contexts[span_id], parent, resource, attrs,
                                    kind=SpanKind.SERVER, status=_status(err), start_time=t0, end_time=t1,
                                    instrumentation_scope=_SCOPE))
            for name, kind, cid, pid, c0, c1, cattrs, cerr in children:
                out.append(ReadableSpan(name, contexts[cid], contexts.get(pid), resource, cattrs, kind=SpanKind(kind),
                                        status=_status(cerr), start_time=c0, end_time=c1,
                                        instrumentation_scope=_SCOPE))
        return out

    def _encoded(self, records: Sequence[Record | Loose]) -> otlp_wire.Encoded:
        """The records as one OTLP request's bytes: what `_spans` makes, without its objects."""
        out: list[bytes] = []
        span, head_of, server, error = otlp_wire.span, otlp_wire.span_head, SpanKind.SERVER.value, _ERROR
        for record in records:
            if record[0].__class__ is str:
                name, kind, trace_id, span_id, parent_id, t0, t1, attrs, err = record  # type: ignore[misc]
                out.append(span(head_of(trace_id), span_id, b"", parent_id, False, name, kind, t0, t1, attrs,
                                None if err is None else (error, err)))
                continue
            trace_id, state_header, span_id, parent_id, t0, t1, attrs, err, children = record  # type: ignore[misc]
            head = head_of(trace_id)  # the trace id's bytes, once for the record's spans
            state = otlp_wire.trace_state(_state_text(state_header)) if state_header else b""
            out.append(span(head, span_id, state, parent_id, True, EXCHANGE_SPAN, server, t0, t1, attrs,
                            None if err is None else (error, err)))
            known = set(map(_ID_OF, children))  # a parent outside the record: none (as `_spans`)
            known.add(span_id)
            for name, kind, cid, pid, c0, c1, cattrs, cerr in children:
                out.append(span(head, cid, state, pid if pid in known else 0, False, name, kind, c0, c1, cattrs,
                                None if cerr is None else (error, cerr)))
        return otlp_wire.Encoded(out, otlp_wire.request_from(self._envelope, out))

    def _loose(self, record: Loose) -> ReadableSpan:
        name, kind, trace_id, span_id, parent_id, t0, t1, attrs, err = record
        parent = SpanContext(trace_id, parent_id, is_remote=False, trace_flags=_SAMPLED) if parent_id else None
        return ReadableSpan(name, SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED), parent,
                            self.resource, attrs, kind=SpanKind(kind), status=_status(err), start_time=t0,
                            end_time=t1, instrumentation_scope=_SCOPE)

    def force_flush(self, timeout_s: float = 30.0) -> None:
        if self._thread is None:
            return
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while (self._q or not self._idle.is_set()) and time.monotonic() < deadline:
            time.sleep(0.01)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Export what is queued (bounded by the exporter's own timeout), then stop the thread and exporter."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.exporter.shutdown()


def _status(err: str | None) -> Status:
    return _UNSET if err is None else Status(StatusCode.ERROR, err or None)


_ERROR = StatusCode.ERROR.value
_CLIENT, _INTERNAL = SpanKind.CLIENT.value, SpanKind.INTERNAL.value
_ID_OF = itemgetter(2)  # a child's span id


def _state_text(header: str) -> str:
    """A `tracestate` header as the SDK encodes it: parsed by its rules (invalid members dropped), re-joined."""
    if not header:
        return ""
    return ",".join(f"{k}={v}" for k, v in TraceState.from_header([header]).items())


class Tracing:
    """The picker's sampling, its exporter pipeline, and the wrappers that record the stages.

    Why spans are recorded here rather than through the SDK's tracer: a sampled request makes four or five
    spans, and the SDK's `Span` (a lock, the sampler asked per span, attributes validated twice, a context
    switch per `start_as_current_span`) made a sampled request cost the picker about three of its own
    decisions; at 10% sampling that was 10-20% of its CPU, not the 5% this must stay within. A sampled
    request is decided once (by the configured sampler's rules), its stages are kept as plain tuples, queued
    as one `Record` (`SpanQueue`), and written as OTLP's protobuf bytes on the exporter's thread
    (`otlp_wire`: the SDK's encoder cost a sampled request ~100 us more), for the SDK's OTLP exporters (and
    their retries)."""

    def __init__(self, queue: SpanQueue, sampler: otel_sampling.Sampler | None = None,
                 errors: Counter | None = None) -> None:
        self.queue = queue
        self.sampler = sampler if sampler is not None else otel_sampling.ParentBased(otel_sampling.ALWAYS_ON)
        self.resource = queue.resource
        self.export_errors = errors
        self._follows, ratio = _sampling_shape(self.sampler)
        # a root's decision without the sampler: its ratio as a bound on the trace id's low 64 bits (1.0: all)
        self._fast_root = self._follows and ratio is not None
        self._bound = round((ratio or 0.0) * (1 << 64))

    @classmethod
    def from_env(cls, environ: Mapping[str, str], registry: CollectorRegistry | None = None) -> Tracing:
        errors = Counter("epp_trace_export_errors", "Span batches the OTLP collector did not take (unreachable, "
                         "refused, timed out): the spans are dropped, requests are not affected",
                         registry=registry) if registry is not None else None
        dropped = Counter("epp_trace_requests_dropped", "Sampled requests whose spans were dropped: the export "
                          "queue (OTEL_BSP_MAX_QUEUE_SIZE requests) was full, the collector too slow or away",
                          registry=registry) if registry is not None else None
        # the batch processor's standard variables, in requests (a record holds one request's spans)
        exporter = _exporter(environ)
        queue = SpanQueue(CountingExporter(exporter, errors), _resource(environ), wire=otlp_wire.install(exporter),
                          max_queue=_int_env(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
                          delay_s=_int_env(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
                          batch=_int_env(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), dropped=dropped)
        return cls(queue, _sampler(environ), errors)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop the exporter's thread."""
        self.queue.shutdown()

    # ------------------------------------------------------------------------------ the decision
    def exchange(self, context: Any, headers: Mapping[str, list[str]], method: str, path: str
                 ) -> tuple[ExchangeSpan | None, Sequence[tuple[str, str]]]:
        """(the request's span when its trace is sampled, else None; the headers the worker must get). No span
        object for an unsampled trace: no header when the context it came with reaches the worker anyway
        (Envoy's, or the client's header), a fresh unsampled `traceparent` when the picker starts the trace.
        `context` is the stream's servicer context: its initial metadata holds Envoy's context (read with
        h2grpc's `metadata_value` where the context has it: one field, not the tuple). With the usual samplers
        this is a string check and a random number: the 90% of requests a 10% sampling does not record cost
        about a microsecond."""
        lookup = getattr(context, "metadata_value", None)
        gateway = lookup(TRACEPARENT) if lookup is not None else _first(context.invocation_metadata(), TRACEPARENT)
        from_gateway = gateway is not None
        if from_gateway:
            given: str | None = gateway
        else:
            values = headers.get(TRACEPARENT)
            given = values[0] if values else None
        if given is None and self._fast_root:  # the usual case of a picker that starts its traces
            # one draw: the trace id (the top 128 bits) and the exchange's span id (the low 64)
            r = _getrandbits(192)
            trace_id = r >> 64
            if (trace_id & _LOW64) >= self._bound and trace_id and r & _LOW64:  # not sampled, no id zero
                # TraceIdRatioBased's rule said no. Flags 02: not sampled, and a random trace id (Trace Context
                # level 2, as the SDK marks its own). Both ids' hex at once: 16 bytes, a dash, 8 bytes.
                return None, [(TRACEPARENT, f"00-{r.to_bytes(24, 'big').hex('-', -16)}-02")]
            trace_id, span_id = trace_id or 1, r & _LOW64 or 1  # W3C: an id is never zero
            if (trace_id & _LOW64) < self._bound:  # TraceIdRatioBased's rule
                span = ExchangeSpan(self, trace_id, None, False, headers.get(TRACESTATE), path, span_id)
                return span, span.worker_headers
            return None, [(TRACEPARENT, f"00-{trace_id:032x}-{span_id:016x}-02")]
        if self._follows and given is not None and given.endswith("-00") and _UNSAMPLED_V00(given) is not None:
            return None, ()  # Envoy's 90%: a valid unsampled parent, followed, without parsing its ids
        parent: tuple[int, int, int] | None = None
        if given is not None:
            parent = _parse_traceparent(given)
            if parent is None:  # another version, or invalid: the specification's propagator decides
                sc = trace.get_current_span(_W3C.extract({TRACEPARENT: given})).get_span_context()
                parent = (sc.trace_id, sc.span_id, int(sc.trace_flags)) if sc.is_valid else None
        if parent is not None and self._follows and not parent[2] & 1:
            return None, ()  # an unsampled parent, followed (Envoy's 90%): its own header goes on to the worker
        # the tracestate only for a request that may be recorded (read from where its traceparent came)
        state_values = [v for k, v in context.invocation_metadata() or () if k == TRACESTATE] if from_gateway \
            else headers.get(TRACESTATE)
        if parent is not None and self._follows:
            span = ExchangeSpan(self, parent[0], parent[1], from_gateway, state_values, path)
            return span, span.worker_headers
        trace_id = parent[0] if parent is not None else (_getrandbits(128) or 1)
        ctx = None
        if parent is not None:
            ctx = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                parent[0], parent[1], is_remote=True, trace_flags=TraceFlags(parent[2]))))
        if self.sampler.should_sample(ctx, trace_id, EXCHANGE_SPAN, SpanKind.SERVER).decision.is_sampled():
            span = ExchangeSpan(self, trace_id, parent[1] if parent is not None else None, from_gateway,
                                state_values, path)
            return span, span.worker_headers
        if parent is not None:
            return None, ()
        return None, [(TRACEPARENT, f"00-{trace_id:032x}-{_getrandbits(64) or 1:016x}-02")]

    # ------------------------------------------------------------------------------ the stages
    def renderer(self, inner: Renderer) -> TracedRenderer:
        return TracedRenderer(inner)

    def kv(self, inner: KvLookup) -> TracedKv:
        return TracedKv(inner)

    def scheduler(self, inner: Any, kv: KvLookup | None) -> TracedScheduler:
        return TracedScheduler(inner, kv)

    def admission(self, inner: Callable[[RequestContext], Awaitable[Ticket]]
                  ) -> Callable[[RequestContext], Awaitable[Ticket]]:
        return traced_admission(inner)

    def hook(self) -> TraceHook:
        return TraceHook()

    # ------------------------------------------------------------------------------ off the request's path
    def publish(self, plane: str, subject: str = "") -> PublishSpan | None:
        """The span of a booking's publish to the peer replicas, when the request that booked it is sampled
        (a context lookup otherwise, and no object): a child of its decision, ended by the sync plane when
        the booking left (`PublishSpan`). `plane` grpc (the mesh: the RPC conventions' attributes) or nats
        (the messaging conventions', `subject` its destination)."""
        rec = _CURRENT.get() if _attached else None
        if rec is None:
            return None
        name, attrs = _sync_span(plane, subject, "send", "publish")
        return PublishSpan(self, rec.trace_id, rec.decision or rec.span_id, name or SYNC_PUBLISH_SPAN, attrs)

    def snapshot_loaded(self, plane: str, peer: str, bookings: int, start_ns: int, *, during_start: bool,
                        subject: str = "") -> None:
        """A peer replica's snapshot of its bookings, applied here (each connect of a peer, and what readiness
        waits for at start): a root span from the peer's stream start (grpc) or the message (nats)."""
        _, attrs = _sync_span(plane, subject, "process", "process")
        attrs["epp.replica_sync.peer"] = _clip(peer, 128)
        attrs["epp.replica_sync.bookings"] = bookings
        attrs["epp.replica_sync.during_start"] = during_start
        self.background(SYNC_SNAPSHOT_SPAN, start_ns, attrs, kind=SpanKind.CONSUMER)

    def dump_loaded(self, worker: str, start_ns: int, *, blocks: int = 0, chunks: int = 0, subject: str = "",
                    merged: bool = False, error: tuple[str, str] | None = None) -> None:
        """A KV-plane relay's dump of one worker's index (`--kv-event-plane nats`: at start, when a worker
        joins, after a gap), asked and loaded: a root span; `merged` when it went on top of the worker's entries
        (a new relay's partial history); `error` (type, description) when none loaded."""
        attrs: dict[str, Any] = {"messaging.system": "nats", "messaging.operation.type": "receive",
                                 "epp.kv_plane.worker": _clip(worker, 128)}
        if subject:
            attrs["messaging.destination.name"] = _clip(subject, 256)
        if error is None:
            attrs["epp.kv_plane.dump_blocks"] = blocks
            attrs["epp.kv_plane.dump_chunks"] = chunks
            attrs["epp.kv_plane.dump_merged"] = merged
            self.background(PLANE_DUMP_SPAN, start_ns, attrs, kind=SpanKind.CLIENT)
            return
        attrs["error.type"] = error[0]
        self.background(PLANE_DUMP_SPAN, start_ns, attrs, _clip(error[1], 200), kind=SpanKind.CLIENT)

    def background(self, name: str, start_ns: int, attrs: dict[str, Any], error: str | None = None,
                   kind: SpanKind = SpanKind.INTERNAL) -> None:
        """Work no request asked for (a peer's snapshot, a relay's dump, loaded at start or after a gap), as a
        root span of its own trace, ending now; sampled by the sampler's rule for a root (its ratio), so a
        pool that restarts at 10% sampling records one load in ten. Rare by nature: the SDK's sampler is asked
        when the picker's own shortcut does not apply."""
        trace_id = _getrandbits(128) or 1
        if self._fast_root:
            if (trace_id & _LOW64) >= self._bound:
                return
        elif not self.sampler.should_sample(None, trace_id, name, kind).decision.is_sampled():
            return
        self.queue.put((name, kind.value, trace_id, _getrandbits(64) or 1, 0, start_ns, time_ns(), attrs,
                        error))


def _clip(text: str, limit: int = 256) -> str:
    return text if len(text) <= limit else text[:limit]


# ------------------------------------------------------------------------------------------ the exchange
_Child = tuple[str, int, int, int, int, int, dict[str, Any], "str | None"]  # name, kind, id, parent, t0, t1


class ExchangeSpan:
    """One sampled ext_proc stream: its server span and the stages recorded under it, exported at `end()`."""

    __slots__ = ("tracing", "trace_id", "span_id", "parent_id", "from_gateway", "start", "attrs", "children",
                 "current", "decision", "error", "worker_headers", "_state", "_ended")

    def __init__(self, tracing: Tracing, trace_id: int, parent_id: int | None, from_gateway: bool,
                 state_values: list[str] | None, path: str, span_id: int = 0) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        self.span_id = span_id or (_getrandbits(64) or 1)
        self.parent_id = parent_id
        # Envoy's tracing on: its gRPC client put the request's span in the stream's metadata (the request's own
        # header, if any, is the client's, and Envoy already continued it). Off: the client's header, if any.
        self.from_gateway = from_gateway
        # kept as its header (the exporter's thread parses it): no OpenTelemetry object on the request's path
        self._state = ",".join(state_values)[:512] if state_values else ""
        self.start = time_ns()
        # few attributes: each costs a sampled request a few microseconds to encode (the span's name is the
        # RPC's `service/method`; the chosen endpoint and the model come at commit, TraceHook)
        self.attrs: dict[str, Any] = {
            "rpc.system": "grpc", "url.path": _clip(path.split("?", 1)[0]),
            "epp.trace.parent": "gateway" if from_gateway else "client" if parent_id is not None else "none"}
        self.children: list[_Child] = []
        self.current = self.span_id  # the parent of the next stage recorded (the decision nests the lookup)
        self.decision = 0  # the last decision span's id: the parent of its booking's publish to the peers
        self.error: str | None = None
        self._ended = False
        # the `traceparent` the chosen worker must get: none when the gateway traces (its router injects its
        # own), else this span's, so that the engine's spans join the request's trace
        self.worker_headers: list[tuple[str, str]] = []
        if not from_gateway:
            self.worker_headers.append((TRACEPARENT, f"00-{trace_id:032x}-{self.span_id:016x}-01"))
            if self._state:
                self.worker_headers.append((TRACESTATE, self._state))

    def attach(self) -> object:
        """Make this request current (logs carry its ids, the stages record under it) until `detach`."""
        global _attached
        token = _CURRENT.set(self)
        _attached += 1
        return token

    @staticmethod
    def detach(token: object) -> None:
        global _attached
        if token is not None:
            _CURRENT.reset(token)  # type: ignore[arg-type]
            _attached -= 1  # after the reset: if that raised, the count errs high (a lookup), never low

    def child(self, name: str, kind: int, start: int, attrs: dict[str, Any], error: str | None = None,
              span_id: int = 0, parent_id: int = 0) -> None:
        """A stage's span, ending now; `kind` a SpanKind's value (`_CLIENT`, `_INTERNAL`: the enum's `.value` is a
        property, a microsecond); `error` (its description, may be empty) makes its status ERROR."""
        self.children.append((name, kind, span_id or (_getrandbits(64) or 1),
                              parent_id or self.current, start, time_ns(), attrs, error))

    def failed(self, err: PickError) -> None:
        """The picker answered the request itself (a 4xx/5xx of its own): the span says why."""
        self.attrs["error.type"] = err.problem.value
        self.error = _clip(str(err), 200)

    def end(self) -> None:
        """The stream is over: its spans go to the exporter's queue as one record, once."""
        if self._ended:
            return
        self._ended = True
        self.tracing.queue.put((self.trace_id, self._state, self.span_id,
                                self.parent_id or 0, self.start, time_ns(), self.attrs, self.error,
                                tuple(self.children)))


# ------------------------------------------------------------------------------------------ the stages
class TracedRenderer:
    """The render call as an HTTP client span (semantic conventions: `http.request.method`, `url.full`,
    `server.address`, `server.port`, `http.response.status_code`, `error.type`). A `/debug/score` call
    (count=False) is not traced: it belongs to no request."""

    def __init__(self, inner: Renderer) -> None:
        self.inner = inner
        self.protocol = inner.protocol
        base = getattr(inner, "base_url", "")
        u = urlsplit(base)
        self._base = base
        self._attrs: dict[str, Any] = {"http.request.method": "POST"}
        from epp_extproc.adapters.render_client import CHAT_PATH, COMPLETIONS_PATH

        self._chat_url, self._completions_url = base + CHAT_PATH, base + COMPLETIONS_PATH  # once, not per call
        if u.hostname:
            self._attrs["server.address"] = u.hostname
            self._attrs["server.port"] = u.port or (443 if u.scheme == "https" else 80)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def render(self, kind: str, body: bytes, *, count: bool = True) -> Awaitable[Rendered]:
        """The inner call itself when the request is not recorded: no coroutine of this wrapper in between."""
        rec = _CURRENT.get() if _attached else None
        if rec is None or not count:
            return self.inner.render(kind, body, count=count)
        return self._traced(rec, kind, body)

    async def _traced(self, rec: ExchangeSpan, kind: str, body: bytes) -> Rendered:
        attrs = dict(self._attrs)
        attrs["url.full"] = self._chat_url if kind == "chat" else self._completions_url
        t0 = time_ns()
        error: str | None = None
        try:
            out = await self.inner.render(kind, body, count=True)
        except RenderError as e:
            attrs["error.type"] = e.failure.value
            if e.status is not None:
                attrs["http.response.status_code"] = e.status
            error = _clip(e.detail, 200)
            raise
        except BaseException as e:
            attrs["error.type"] = type(e).__name__
            error = ""
            raise
        else:
            attrs["http.response.status_code"] = 200
            return out
        finally:
            rec.child("POST", _CLIENT, t0, attrs, error)


class TracedKv:
    """The KV index lookup that fills a candidate table (`overlap`, or `overlap_array` where the lookup answers
    a large pool as one array); every other call passes straight on.

    Under `--kv-ingest apart` the lookup is a question to each ingest shard that owns a candidate, and the
    decision waits for the answers: each is a child span (`epp.kv.ingest.lookup`) with the shard's own figures,
    from the adapter's `lookup_observer` (set here, so the adapter knows nothing of spans; None when tracing is
    off: the adapter then makes no call and reads no clock for it)."""

    def __init__(self, inner: KvLookup) -> None:
        self.inner = inner
        # the rest of the lookup's interface, bound once: no delegation on the request's path
        self.prompt, self.base_model_for, self.block_size = inner.prompt, inner.base_model_for, inner.block_size
        self.credit, self.held, self.predict = inner.credit, inner.held, inner.predict
        self._array = getattr(inner, "overlap_array", None)
        if self._array is not None:  # absent where the inner has none: the table then asks `overlap`
            self.overlap_array = self._overlap_array
        if hasattr(inner, "lookup_observer"):
            inner.lookup_observer = ingest_answered  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def overlap(self, prompt: PromptKey, workers: Sequence[str]) -> Mapping[str, int]:
        rec = _CURRENT.get() if _attached else None
        if rec is None:
            return self.inner.overlap(prompt, workers)
        t0, outer, first = time_ns(), rec.current, len(rec.children)
        span_id = rec.current = _getrandbits(64) or 1
        try:
            out = self.inner.overlap(prompt, workers)
        finally:
            rec.current = outer
        attrs = {"epp.kv.workers": len(workers), "epp.kv.best_overlap_blocks": max(out.values(), default=0)}
        _unanswered(rec, first, attrs)
        rec.child(KV_LOOKUP_SPAN, _INTERNAL, t0, attrs, span_id=span_id, parent_id=outer)
        return out

    def _overlap_array(self, prompt: PromptKey, workers: Sequence[str]) -> Any:
        rec = _CURRENT.get() if _attached else None
        assert self._array is not None
        if rec is None:
            return self._array(prompt, workers)
        t0, outer, first = time_ns(), rec.current, len(rec.children)
        span_id = rec.current = _getrandbits(64) or 1
        try:
            out = self._array(prompt, workers)
        finally:
            rec.current = outer
        if out is None:  # this lookup answers by `overlap` after all (the table asks it next): that one is the span
            del rec.children[first:]
            return None
        attrs = {"epp.kv.workers": len(workers), "epp.kv.best_overlap_blocks": int(out.max()) if len(out) else 0}
        _unanswered(rec, first, attrs)
        rec.child(KV_LOOKUP_SPAN, _INTERNAL, t0, attrs, span_id=span_id, parent_id=outer)
        return out


def _unanswered(rec: ExchangeSpan, first: int, attrs: dict[str, Any]) -> None:
    """The lookup's shards that did not answer (their spans since `first`): their workers got no KV credit."""
    if len(rec.children) == first:  # no shard's span (in-process ingest): nothing to count
        return
    n = sum(1 for c in rec.children[first:] if c[0] == INGEST_LOOKUP_SPAN and c[7] is not None)
    if n:
        attrs["epp.kv.ingest.unanswered_shards"] = n


_INGEST_ERRORS = {
    "timeout": "shard {shard} did not answer in time: its candidates were scored without KV credit (by load)",
    "unavailable": "shard {shard} is down or restarting: its candidates were scored without KV credit (by load)",
}


def ingest_answered(shard: int, result: str, start_ns: int, service_s: float | None,
                    batch_lag_s: float | None) -> None:
    """One ingest shard's answer to a lookup (`RemoteKv.lookup_observer`), as a child of the lookup's span when
    the request is sampled: `result` ok, timeout or unavailable; `service_s` the shard's own time on it (the
    rest of the wait is the channel and the lookup's queue behind the shard's batch apply, `queued_s`);
    `batch_lag_s` how old the shard's newest applied event batch was when applied (its publisher's stamp)."""
    rec = _CURRENT.get() if _attached else None
    if rec is None:
        return
    attrs: dict[str, Any] = {"network.transport": "unix", "epp.kv.ingest.shard": shard,
                             "epp.kv.ingest.result": result}
    error: str | None = None
    if result != "ok":
        attrs["error.type"] = result
        error = _INGEST_ERRORS.get(result, "{shard}: no answer").format(shard=shard)
    if service_s is not None:
        attrs["epp.kv.ingest.service_s"] = service_s
        attrs["epp.kv.ingest.queued_s"] = max(0.0, (time_ns() - start_ns) / 1e9 - service_s)
    if batch_lag_s is not None:
        attrs["epp.kv.ingest.batch_lag_s"] = batch_lag_s
    rec.child(INGEST_LOOKUP_SPAN, _CLIENT, start_ns, attrs, error)


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
    was routed by load only. The KV lookup it makes is recorded under it."""

    def __init__(self, inner: Any, kv: KvLookup | None) -> None:
        self.inner = inner
        self.kv = kv
        self.candidates = inner.candidates  # not traced: the handler's own method, no call in between
        name, _, plugins = _plugin_names(inner)
        # one joined string, not an array (`profile/plugin`, so the profiles are named too)
        self._static: dict[str, Any] = {"epp.scheduling.handler": name, "epp.scheduling.plugins": ",".join(plugins)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def schedule(self, req: SchedulingRequest, addresses: Sequence[str]) -> SchedulingResult:
        rec = _CURRENT.get() if _attached else None
        if rec is None:
            return self.inner.schedule(req, addresses)
        t0, outer = time_ns(), rec.current
        span_id = rec.current = rec.decision = _getrandbits(64) or 1
        attrs = dict(self._static)
        error: str | None = None
        try:
            result = self.inner.schedule(req, addresses)
            attrs.update(decision_attributes(req, addresses, result, self.kv))
            return result
        except PickError as e:
            attrs["error.type"] = e.problem.value
            error = _clip(str(e), 200)
            raise
        except Exception as e:
            attrs["error.type"] = type(e).__name__
            error = ""
            raise
        finally:
            rec.current = outer
            rec.child(SCHEDULE_SPAN, _INTERNAL, t0, attrs, error, span_id=span_id, parent_id=outer)


def decision_attributes(req: SchedulingRequest, addresses: Sequence[str], result: SchedulingResult,
                        kv: KvLookup | None) -> dict[str, Any]:
    r = result.primary
    t, i = r.table, r.chosen
    """Only what explains the choice (each attribute costs a sampled request about 2.5 us): the P/D verdict
    only in a pool with prefill workers, the credited blocks only when the prompt was scored."""
    attrs: dict[str, Any] = {
        "epp.candidates": len(addresses), "epp.endpoint": r.address, "epp.cost": float(t.cost[i]),
        "epp.route": "kv" if req.prompt is not None else "load",
    }
    if req.prompt is not None:
        attrs["epp.overlap_blocks"] = int(t.overlap[i])
        attrs["epp.credited_blocks"] = float(t.credited[i])
    elif req.load_reason is not None:
        attrs["epp.load_reason"] = req.load_reason
    if req.prompt_tokens:
        attrs["gen_ai.usage.input_tokens"] = req.prompt_tokens
    pd = result.pd
    if pd.path is not PdPath.AGGREGATED or pd.reason is not PdReason.NO_PREFILL_WORKERS:
        attrs["epp.pd.path"] = pd.path.value
        attrs["epp.pd.reason"] = pd.reason.value
    if pd.prefill is not None:
        attrs["epp.pd.prefill_endpoint"] = pd.prefill.address
        attrs["epp.pd.prefill_blocks"] = float(pd.prefill_blocks)
    if pd.uncached_tokens is not None:
        attrs["epp.pd.uncached_tokens"] = pd.uncached_tokens
    predicted = predicted_cached_tokens(result, req.prompt, kv)
    if predicted is not None:
        attrs["epp.predicted_cached_tokens"] = int(predicted)
    for key in ("slo", "session"):
        v = r.outcome.get(key)
        if v is not None:
            attrs[f"epp.{key}"] = str(getattr(v, "value", v))
    return attrs


def traced_admission(inner: Callable[[RequestContext], Awaitable[Ticket]]
                     ) -> Callable[[RequestContext], Awaitable[Ticket]]:
    """Flow control's wait for a ticket as a span (`epp.flow_control.waited_s`; an error when it drops)."""

    def admit(ctx: RequestContext) -> Awaitable[Ticket]:
        rec = _CURRENT.get() if _attached else None
        if rec is None:
            return inner(ctx)  # no coroutine of this wrapper in between
        return traced(rec, ctx)

    async def traced(rec: ExchangeSpan, ctx: RequestContext) -> Ticket:
        t0, started = time_ns(), time.perf_counter()
        try:
            ticket = await inner(ctx)
        except PickError as e:
            rec.child(FLOW_WAIT_SPAN, _INTERNAL, t0,
                      {"error.type": e.problem.value, "epp.flow_control.waited_s": time.perf_counter() - started},
                      _clip(str(e), 200))
            raise
        rec.child(FLOW_WAIT_SPAN, _INTERNAL, t0, {"epp.flow_control.waited_s": ticket.waited_s})
        return ticket

    return admit


class TraceHook:
    """Commit hook: what only a committed decision knows, on the request's span (the model asked for, the
    endpoint booked); a proposal that fails or `/debug/score` writes nothing."""

    name = "trace"

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None:
        rec = _CURRENT.get() if _attached else None
        if rec is None:
            return None
        rec.attrs["epp.endpoint"] = p.address  # the decision span has the rest
        if p.model is not None:
            rec.attrs["gen_ai.request.model"] = _clip(p.model, 128)
        if p.pd.address is not None:
            rec.attrs["epp.pd.prefill_endpoint"] = p.pd.address
        return None


# ------------------------------------------------------------------------------------------ replica sync
def _sync_span(plane: str, subject: str, op_type: str, op_name: str) -> tuple[str, dict[str, Any]]:
    """(span name, attributes) of a replica-sync message by the semantic conventions of its plane: messaging.*
    on NATS (named `<operation> <subject>`), rpc.* on the gRPC mesh's stream (named by the caller)."""
    if plane == "nats":
        return f"{op_name} {subject}", {"epp.replica_sync.plane": "nats", "messaging.system": "nats",
                                        "messaging.destination.name": _clip(subject, 256),
                                        "messaging.operation.type": op_type, "messaging.operation.name": op_name}
    return "", {"epp.replica_sync.plane": "grpc", "rpc.system": "grpc", "rpc.service": REPLICA_SYNC_SERVICE,
                "rpc.method": "Sync"}


class PublishSpan:
    """A sampled request's booking on its way to the peer replicas: from its commit (queued on each link that
    was up, or on the NATS subject) until the last of them handed it to its transport, in a batch or a
    snapshot. A child of the request's decision span, queued as a span of its own (the request's record has
    usually gone to the exporter by then). Only a sampled request makes one: the plane asks `Tracing.publish`,
    which returns None otherwise.

    The plane calls `queued` once per link it was queued on, `sent` or `dropped` once per such link, and
    `settle` after queueing (a booking no link took is ended at once: no peer to tell, the next connect's
    snapshot carries it)."""

    __slots__ = ("tracing", "trace_id", "parent_id", "name", "attrs", "start", "waiting", "error", "_ended")

    def __init__(self, tracing: Tracing, trace_id: int, parent_id: int, name: str, attrs: dict[str, Any]) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.name = name
        self.attrs = attrs
        self.start = time_ns()
        self.waiting = 0
        self.error: str | None = None
        self._ended = False

    def queued(self) -> None:
        self.waiting += 1

    def settle(self) -> None:
        if self.waiting <= 0:
            self.attrs.setdefault("epp.replica_sync.via", "none")
            self._end()

    def sent(self, via: str = "batch", items: int = 0) -> None:
        """Handed to the transport (`via` batch or snapshot; `items` the changes in that message)."""
        self.attrs["epp.replica_sync.via"] = via
        if items:
            self.attrs["epp.replica_sync.batch_items"] = items
        self._done()

    def dropped(self, why: str) -> None:
        """Never sent on one link (its backlog overflowed, its stream failed, the publish failed): the peers
        learn it from the snapshot the plane sends next."""
        self.attrs["error.type"] = "dropped"
        self.error = _clip(why, 200)
        self._done()

    def _done(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0:
            self._end()

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.tracing.queue.put((self.name, SpanKind.PRODUCER.value, self.trace_id, _getrandbits(64) or 1,
                                self.parent_id, self.start, time_ns(), self.attrs, self.error))
