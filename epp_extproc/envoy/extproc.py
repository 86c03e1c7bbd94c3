"""The Envoy ext_proc edge: protobuf in, protobuf out, nothing else.

One gRPC stream per HTTP request, admitted against the picker's in-flight cap as soon as it opens. Request
bodies are buffered to end_of_stream (the decision needs the whole prompt) within a deadline; then, in
FULL_DUPLEX_STREAMED, exactly one request_headers response carries the decision and the body follows as
streamed_response chunks; in BUFFERED, the headers are answered at once and the decision rides on the single
body response, with a content-length that matches the forwarded body. Responses flow straight back through
(each chunk echoed as it arrives) while the picker watches for the first chunk and the usage.

Everything the decision needs is asked of a `core.api.Picker`; this module never books, counts or scores.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp_extproc.core.api import Exchange, Picker, Routed
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.request import RequestContext
from epp_extproc.core.time_cost import parse_slo
from epp_extproc.envoy.errors import http_error
from epp_extproc.gaie import (
    BOOKING_KEY,
    DEST_HEADER,
    LB_NAMESPACE,
    PREFILLER_HEADER,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from epp_extproc.tracing.otlp_wire import varint

if TYPE_CHECKING:
    from epp_extproc.tracing.spans import ExchangeSpan, Tracing

log = logging.getLogger(__name__)

STREAM_CHUNK = 62_000
OVERLOADED_FIRST_MESSAGE_S = 1.0  # an over-cap stream gets this long to send headers for its 503
_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = _BodyMode.Value("FULL_DUPLEX_STREAMED")
BUFFERED = _BodyMode.Value("BUFFERED")
_MODE_NAMES = {v: k for k, v in _BodyMode.items()}
_PASS_CHUNK = pb.ProcessingResponse(response_body=pb.BodyResponse())  # never mutated: shared
# looked up once: the enum wrapper's attribute access costs a microsecond per header otherwise
_OVERWRITE = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _headers(msg: pb.HttpHeaders) -> tuple[str, str, dict[str, list[str]]]:
    method = path = ""
    out: dict[str, list[str]] = {}
    for h in msg.headers.headers:
        key = h.key.lower()
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        if key == ":method":
            method = value
        elif key == ":path":
            path = value
        out.setdefault(key, []).append(value)
    return method, path, out


def parse_subset(value: object) -> list[str] | None:
    """The gateway's subset hint: a list of `ip:port` or one comma-separated string; None = no hint."""
    if value is None:
        return None
    items: list[str] = []
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, str):
                items.extend(v.split(","))
    return [s.strip() for s in items if s.strip()]


def _subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE) if req.HasField("metadata_context") \
        else None
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    v = ns.fields[SUBSET_KEY]
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return parse_subset(v.string_value)
    if kind == "list_value":
        return parse_subset([x.string_value for x in v.list_value.values if x.WhichOneof("kind") ==
                             "string_value"])
    return []  # a hint we cannot read narrows to nothing rather than widening


def _lb_value(req: pb.ProcessingRequest, key: str) -> str | None:
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is None or key not in ns.fields:
        return None
    return ns.fields[key].string_value or None


def _header_mutation(routed: Routed | None, remove: list[str], content_length: int | None,
                     extra: Sequence[tuple[str, str]] = ()) -> pb.HeaderMutation:
    """`extra`: headers set for the worker, replacing the client's (the trace context when Envoy does not
    trace)."""
    m = pb.HeaderMutation()
    # `prefill` is optional on a Routed (older pickers and test doubles do not carry it): absent = none
    prefill = getattr(routed, "prefill", None) if routed is not None else None
    m.remove_headers.extend(h for h in remove if not (h == DEST_HEADER and routed is not None)
                            and not (h == PREFILLER_HEADER and prefill is not None))
    if routed is not None:
        m.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=routed.address.encode())))
    if prefill is not None:  # every client copy is replaced: one value, the picker's
        m.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=PREFILLER_HEADER, raw_value=prefill.encode()),
            append_action=base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD))
    if content_length is not None:
        m.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(content_length).encode())))
    _add_set_headers(m, extra)
    return m


def _add_set_headers(m: pb.HeaderMutation, extra: Sequence[tuple[str, str]]) -> None:
    """`extra` appended to `m.set_headers` (OVERWRITE_IF_EXISTS_OR_ADD), as wire bytes merged into it. Merged
    into the response's own mutation once it is built (`_Stream._decide`): a message given to a constructor is
    copied (upb serializes and parses it), and the response is three constructors deep."""
    for k, v in extra:
        m.MergeFromString(_set_header_wire(k, v))  # appended after the others, as `append` would


# (key, the value's length in bytes) -> the bytes of a `set_headers` entry before the value: the trace context's
# headers have one or a few lengths (a `traceparent` always 55). Bounded: past it, prefixes are made every time.
_SET_PREFIXES: dict[tuple[str, int], bytes] = {}
_MAX_SET_PREFIXES = 256
_APPEND_OVERWRITE = b"\x18" + varint(_OVERWRITE)  # HeaderValueOption.append_action = 3


def _set_header_wire(key: str, value: str) -> bytes:
    """One `HeaderMutation.set_headers` entry (HeaderValueOption {header {key, raw_value}, append_action
    OVERWRITE_IF_EXISTS_OR_ADD}) as protobuf's wire bytes, for `MergeFromString`. Why not the messages: upb
    copies a message given to a constructor or to `append` by serializing and parsing it, twice per header
    here, ~17k instructions per header against ~3k for these bytes (`bench/bench_tracing_path.py`: the worker's
    `traceparent` on every request of a picker that starts its traces)."""
    raw = value.encode()
    prefix = _SET_PREFIXES.get((key, len(raw)))
    if prefix is None:
        k = key.encode()
        header = b"\x0a" + varint(len(k)) + k + b"\x1a" + varint(len(raw))  # HeaderValue: key 1, raw_value 3
        n_header = len(header) + len(raw)
        option = b"\x0a" + varint(n_header) + header  # HeaderValueOption.header = 1
        n_option = len(option) + len(raw) + len(_APPEND_OVERWRITE)
        prefix = b"\x0a" + varint(n_option) + option  # HeaderMutation.set_headers = 1
        if len(_SET_PREFIXES) < _MAX_SET_PREFIXES:
            _SET_PREFIXES[(key, len(raw))] = prefix
    return prefix + raw + _APPEND_OVERWRITE


def _response_headers(add: list[tuple[str, str]]) -> pb.HeadersResponse:
    if not add:
        return pb.HeadersResponse()
    overwrite = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
    return pb.HeadersResponse(response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=overwrite)
        for k, v in add])))


def _lb_metadata(routed: Routed) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({LB_NAMESPACE: {DEST_HEADER: routed.address, BOOKING_KEY: routed.booking_id}})
    return s


def immediate(err: PickError, path: str) -> pb.ProcessingResponse:
    e = http_error(err, path)
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=e.status),
        body=e.body(),
        headers=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=e.content_type))] + [
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
            for k, v in e.headers]),
        details=f"epp_{e.code}"))


def _streamed_chunks(body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    chunks = [body[i:i + STREAM_CHUNK] for i in range(0, len(body), STREAM_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=chunk, end_of_stream=end_of_stream and last))))))
    return out


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, *, allowed_modes: tuple[str, ...], body_timeout_s: float,
                 tracing: Tracing | None = None) -> None:
        self.picker = picker
        self.allowed_modes = {_BodyMode.Value(m) for m in allowed_modes}
        self.body_timeout_s = body_timeout_s
        self.tracing = tracing  # None: tracing off, no span is made on any stream

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        try:
            exchange = self.picker.open()
        except PickError as err:
            async for resp in self._refuse(err, request_iterator):
                yield resp
            return
        stream = _Stream(self, exchange, context)
        try:
            async for resp in stream.run(request_iterator):
                yield resp
        finally:
            exchange.close()
            if stream.trace is not None:
                stream.trace.end()

    async def _refuse(self, err: PickError, requests: AsyncIterator[pb.ProcessingRequest]) \
            -> AsyncIterator[pb.ProcessingResponse]:
        """Over the cap: answer the request's headers with the reason, or drop a stream that sends none."""
        self.picker.count_rejection(err)
        try:
            async with asyncio.timeout(OVERLOADED_FIRST_MESSAGE_S):
                req = await anext(aiter(requests))
        except (TimeoutError, StopAsyncIteration):
            return
        if req.WhichOneof("request") == "request_headers":
            yield immediate(err, _headers(req.request_headers)[1])


class _Stream:
    """State of one HTTP request's ext_proc stream."""

    def __init__(self, svc: ExtProcServicer, exchange: Exchange, context: grpc.aio.ServicerContext) -> None:
        self.svc = svc
        self.exchange = exchange
        self.context = context
        self.mode = FULL_DUPLEX
        self.response_mode = FULL_DUPLEX
        self.ctx: RequestContext | None = None
        self.body_done = False
        self.routed: Routed | None = None
        self.finished = False  # an ImmediateResponse was sent, or an observer is done: stop reading
        # the request's span (tracing on and its trace sampled), from its headers to the end
        self.trace: ExchangeSpan | None = None
        self.trace_headers: Sequence[tuple[str, str]] = ()  # set for the worker: the trace context, when we pass it
        self.deadline = asyncio.get_running_loop().time() + svc.body_timeout_s

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """Two phases: until the request body is complete, each message must arrive before the deadline;
        then the response, whose chunks (one message each, possibly thousands) take the short synchronous
        path of :meth:`_response_chunk`: no generator, task or timer per chunk. The deadline is a timer on
        this task (`timeout_at`), not `wait_for`, which in Python 3.11 wraps every read in a task of its own."""
        it = aiter(requests)
        while not self.body_done:
            try:
                async with asyncio.timeout_at(self.deadline):
                    req = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                err = PickError(Problem.BODY_TIMEOUT, f"request body not complete within "
                                                      f"{self.svc.body_timeout_s:g}s")
                if self.ctx is None:  # not even headers: nothing to answer to
                    self.exchange.reject(err, RequestContext())
                    await self.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(err))
                yield self._reject(err)
                return
            async for r in self._on_message(req):
                yield r
            # the next read waits for the client: a message still named here (a BUFFERED body, whole) would
            # be held twice while the body is incomplete, in the protobuf and in the exchange's buffer
            del req
            if self.finished:
                return
        async for req in it:
            if req.WhichOneof("request") == "response_body" and self.ctx is not None:
                yield self._response_chunk(req.response_body)
                continue
            async for r in self._on_message(req):
                yield r
            if self.finished:
                return

    async def _on_message(self, req: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            mode = req.protocol_config.request_body_mode
            if mode not in self.svc.allowed_modes:
                name = _MODE_NAMES.get(mode, str(mode))
                self.exchange.reject(PickError(Problem.UNSUPPORTED_MODE, name), RequestContext())
                await self.context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"request_body_mode {name} is not supported by this picker; use "
                                         f"one of {sorted(_MODE_NAMES[m] for m in self.svc.allowed_modes)}")
            self.mode = mode
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            if self.ctx is not None:  # one HTTP request per stream: never a second decision
                await self._protocol_error("a second request_headers on one ext_proc stream")
            async for r in self._on_request_headers(req):
                yield r
        elif kind == "request_body":
            if self.ctx is None:
                await self._protocol_error("request_body before request_headers")
            async for r in self._on_request_body(req.request_body.body, req.request_body.end_of_stream):
                yield r
        elif kind == "request_trailers":
            if self.ctx is None:
                await self._protocol_error("request_trailers before request_headers")
            if not self.body_done:  # trailers end the body
                async for r in self._on_request_body(b"", True, trailers=True):
                    yield r
                if self.finished:
                    return
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_headers":
            served = _lb_value(req, SERVED_KEY)
            if served is not None:
                self.exchange.served_by(served)
            add = self.exchange.response_headers(_headers(req.response_headers)[2])
            yield pb.ProcessingResponse(response_headers=_response_headers(add))
        elif kind == "response_body" and self.ctx is None:
            # No request on this stream: the lean mode's observability-mode filter showing us the response.
            self._observe_first_chunk(req)
        elif kind == "response_body":
            yield self._response_chunk(req.response_body)
        elif kind == "response_trailers":
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    def _response_chunk(self, body: pb.HttpBody) -> pb.ProcessingResponse:
        data = body.body
        self.exchange.response_chunk(data)
        if self.response_mode == FULL_DUPLEX:  # every chunk must be handed back, as it came
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=data, end_of_stream=body.end_of_stream)))))
        return _PASS_CHUNK  # STREAMED / BUFFERED: an empty answer lets the chunk through unchanged

    def _observe_first_chunk(self, req: pb.ProcessingRequest) -> None:
        """Lean mode: the first non-empty chunk ends the booking's prefill; the stream is then closed so
        Envoy sends no more chunks (it does not wait for answers in observability mode, so nothing is lost)."""
        self.exchange.close()  # an observer is not a request: it holds no slot and has no deadline
        self.body_done = True
        booking = _lb_value(req, BOOKING_KEY)
        if booking is None:
            self.finished = True  # nothing to tell: do not keep reading
        elif req.response_body.body:
            self.svc.picker.first_chunk(booking)
            self.finished = True
        elif req.response_body.end_of_stream:
            self.finished = True

    async def _protocol_error(self, what: str) -> None:
        err = PickError(Problem.PROTOCOL, what)
        self.exchange.reject(err, self.ctx or RequestContext())
        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, what)

    async def _on_request_headers(self, req: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        method, path, headers = _headers(req.request_headers)
        slo, malformed = parse_slo(headers)  # llm-d's SLO headers become plain numbers here
        self.ctx = RequestContext(method, path, headers, None, _subset_hint(req), slo, malformed)
        if self.svc.tracing is not None:  # the gateway's context rides in the stream's initial metadata
            self.trace, self.trace_headers = self.svc.tracing.exchange(self.context, headers, method, path)
        if req.request_headers.end_of_stream:
            self.body_done = True
            async for r in self._decide(None):
                yield r
        elif self.mode == BUFFERED:
            # Envoy waits for this answer before it sends the body; the decision rides on the body response.
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=_header_mutation(None, self.ctx.spoofed_headers(), None))))

    async def _on_request_body(self, data: bytes, end: bool, trailers: bool = False) \
            -> AsyncIterator[pb.ProcessingResponse]:
        if self.body_done:
            return  # Envoy may repeat the final chunk of a large body; it was already handled
        if data:
            try:
                self.exchange.add_body(data)
            except PickError as err:
                self.body_done = True
                yield self._reject(err)
                return
        if not end:
            return
        self.body_done = True
        async for r in self._decide(self.exchange.body(), trailers=trailers):
            yield r

    def _reject(self, err: PickError) -> pb.ProcessingResponse:
        ctx = self.ctx or RequestContext()
        if self.trace is None:
            self.exchange.reject(err, ctx)
        else:
            self.trace.failed(err)
            token = self.trace.attach()  # the rejection's log line carries the request's trace
            try:
                self.exchange.reject(err, ctx)
            finally:
                self.trace.detach(token)
        self.finished = True
        return immediate(err, ctx.path)

    async def _decide(self, body: bytes | None, trailers: bool = False) -> AsyncIterator[pb.ProcessingResponse]:
        assert self.ctx is not None
        self.ctx.body = body
        # the request's span is current while it is decided (never across a yield): the stages' spans are its
        # children and the log lines carry its ids
        token = self.trace.attach() if self.trace is not None else None
        refusal: PickError | None = None
        try:
            routed = await self.exchange.decide(self.ctx)
        except PickError as err:
            refusal = err
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("picker failed on %s", self.ctx.method)
            refusal = PickError(Problem.INTERNAL, "endpoint picker internal error")
        finally:
            if token is not None:
                self.trace.detach(token)  # type: ignore[union-attr]
        if refusal is not None:
            yield self._reject(refusal)
            return
        self.routed = routed
        self.ctx.body = None  # the exchange forwards `routed.body`; do not hold the original twice
        fwd = routed.body
        spoofed = self.ctx.spoofed_headers()
        metadata = _lb_metadata(routed)
        extra = self.trace_headers  # the trace context for the worker: added to the built response, in place
        buffered = body is not None and self.mode == BUFFERED
        if buffered:
            assert fwd is not None
            changed = fwd is not body
            resp = pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=pb.CommonResponse(
                    header_mutation=_header_mutation(routed, [], len(fwd)),
                    body_mutation=pb.BodyMutation(body=fwd) if changed else None,
                    clear_route_cache=True)),
                dynamic_metadata=metadata)
            mutation = resp.request_body.response.header_mutation
        else:  # no body, or a streamed one: the headers carry the decision, the body follows
            resp = pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                    header_mutation=_header_mutation(routed, spoofed, None), clear_route_cache=True)),
                dynamic_metadata=metadata)
            mutation = resp.request_headers.response.header_mutation
        if extra:
            _add_set_headers(mutation, extra)
        yield resp
        if body is not None and not buffered:
            assert fwd is not None
            for r in _streamed_chunks(fwd, end_of_stream=not trailers):
                yield r
