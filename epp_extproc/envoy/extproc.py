"""The Envoy ext_proc edge: protobuf in, protobuf out, nothing else.

One gRPC stream per HTTP request. Request bodies are buffered to end_of_stream (the decision needs the whole
prompt); then, in FULL_DUPLEX_STREAMED, exactly one request_headers response carries the decision and the body
follows as streamed_response chunks; in BUFFERED, the headers are answered at once and the decision rides on
the single body response, with a content-length that matches the forwarded body. Responses flow straight back
through (each chunk echoed as it arrives), with an observer watching for the first chunk and the usage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp_extproc.core.cost import parse_subset
from epp_extproc.core.pipeline import Decision, Pipeline
from epp_extproc.core.request import (
    DEST_HEADER,
    LB_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    Rejection,
    RequestContext,
)

log = logging.getLogger(__name__)

STREAM_CHUNK = 62_000
_BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX = _BodyMode.Value("FULL_DUPLEX_STREAMED")
BUFFERED = _BodyMode.Value("BUFFERED")
_MODE_NAMES = {v: k for k, v in _BodyMode.items()}

ResponseObserverFactory = Callable[[Decision], Any]


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


def _header_mutation(decision: Decision | None, remove: list[str], content_length: int | None) \
        -> pb.HeaderMutation:
    m = pb.HeaderMutation()
    m.remove_headers.extend(h for h in remove if h != DEST_HEADER or decision is None)
    if decision is not None:
        m.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=decision.address.encode())))
    if content_length is not None:
        m.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(content_length).encode())))
    return m


def _lb_metadata(address: str) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({LB_NAMESPACE: {DEST_HEADER: address}})
    return s


def _immediate(rej: Rejection) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=rej.status),
        body=(rej.message + "\n").encode(),
        headers=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
            for k, v in (("content-type", "text/plain; charset=utf-8"), *getattr(rej, "headers", ()))]),
        details=f"epp_{rej.outcome}"))


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
    def __init__(self, pipeline: Pipeline, *, allowed_modes: tuple[str, ...],
                 observer_factory: ResponseObserverFactory | None = None) -> None:
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.allowed_modes = {_BodyMode.Value(m) for m in allowed_modes}
        self.observer_factory = observer_factory
        self.active = 0

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream(self, context)
        self.active += 1
        self.metrics.picker_inflight.inc()
        try:
            async for resp in stream.run(request_iterator):
                yield resp
        finally:
            self.active -= 1
            self.metrics.picker_inflight.dec()
            stream.close()


class _Stream:
    """State of one HTTP request's ext_proc stream."""

    def __init__(self, svc: ExtProcServicer, context: grpc.aio.ServicerContext) -> None:
        self.svc = svc
        self.context = context
        self.mode = FULL_DUPLEX
        self.response_mode = FULL_DUPLEX
        self.ctx = RequestContext()
        self.chunks: list[bytes] = []
        self.size = 0
        self.body_done = False
        self.decision: Decision | None = None
        self.observer: Any = None
        self.admitted = False
        self.finished = False  # an ImmediateResponse was sent: nothing more to say on this stream

    def close(self) -> None:
        if self.decision is not None:
            if self.observer is not None:
                try:
                    self.observer.finish()
                except Exception:
                    log.exception("response observer failed")
            self.decision.booking.free()

    async def run(self, requests: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        svc = self.svc
        async for req in requests:
            if req.HasField("protocol_config"):
                mode = req.protocol_config.request_body_mode
                if mode not in svc.allowed_modes:
                    name = _MODE_NAMES.get(mode, str(mode))
                    svc.metrics.requests.labels("unsupported_mode").inc()
                    await self.context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"request_body_mode {name} is not supported by this picker; use "
                                             f"one of {sorted(_MODE_NAMES[m] for m in svc.allowed_modes)}")
                self.mode = mode
                self.response_mode = req.protocol_config.response_body_mode
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                async for r in self._on_request_headers(req):
                    yield r
            elif kind == "request_body":
                async for r in self._on_request_body(req.request_body.body, req.request_body.end_of_stream):
                    yield r
            elif kind == "request_trailers":
                if not self.body_done:  # trailers end the body
                    async for r in self._on_request_body(b"", True, trailers=True):
                        yield r
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_headers":
                self._follow_served_endpoint(req)
                if self.observer is not None:
                    self.observer.on_headers(_headers(req.response_headers)[2])
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                body = req.response_body
                if self.observer is not None and body.body:
                    self.observer.on_chunk(body.body)
                if self.decision is not None and body.body:
                    self.decision.booking.prefill_done()
                if self.response_mode == FULL_DUPLEX:  # every chunk must be handed back, as it came
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=body.body, end_of_stream=body.end_of_stream)))))
                else:  # STREAMED / BUFFERED: an empty answer lets the chunk through unchanged
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            if self.finished:
                return

    def _follow_served_endpoint(self, req: pb.ProcessingRequest) -> None:
        """Move the booking when the gateway reports it served a different (known) endpoint than picked."""
        if self.decision is None or not req.HasField("metadata_context"):
            return
        ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if ns is None or SERVED_KEY not in ns.fields:
            return
        served = ns.fields[SERVED_KEY].string_value
        if served and served != self.decision.address and served in self.svc.pipeline.registry:
            log.info("gateway served %s instead of %s; moving the booking", served, self.decision.address)
            self.decision.booking.move(served)

    def _admit(self) -> None:
        limit = self.svc.pipeline.config.max_inflight_requests
        if self.svc.active > limit:
            raise Rejection(503, "endpoint picker overloaded", "overloaded")
        self.admitted = True

    async def _on_request_headers(self, req: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        method, path, headers = _headers(req.request_headers)
        self.ctx = RequestContext(method, path, headers, None, _subset_hint(req))
        try:
            self._admit()
        except Rejection as rej:
            yield self._reject(rej)
            return
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
        self.size += len(data)
        if self.size > self.svc.pipeline.config.max_body_bytes:
            self.body_done = True
            yield self._reject(Rejection(413, f"request body larger than "
                                              f"{self.svc.pipeline.config.max_body_bytes} bytes",
                                         "body_too_large"))
            return
        if data:
            self.chunks.append(data)
        if not end:
            return
        self.body_done = True
        body = b"".join(self.chunks)
        self.chunks = []
        async for r in self._decide(body, trailers=trailers):
            yield r

    def _reject(self, rej: Rejection) -> pb.ProcessingResponse:
        self.svc.metrics.requests.labels(rej.outcome).inc()
        self.finished = True
        log.info("rejected %s %s: %s", self.ctx.method, self.ctx.path, rej)
        return _immediate(rej)

    async def _decide(self, body: bytes | None, trailers: bool = False) -> AsyncIterator[pb.ProcessingResponse]:
        self.ctx.body = body
        try:
            decision = await self.svc.pipeline.decide(self.ctx)
        except Rejection as rej:
            yield self._reject(rej)
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("picker failed on %s %s", self.ctx.method, self.ctx.path)
            yield self._reject(Rejection(500, "endpoint picker internal error", "internal_error"))
            return
        self.decision = decision
        self.svc.metrics.requests.labels("routed").inc()
        if self.svc.observer_factory is not None:
            self.observer = self.svc.observer_factory(decision)
        fwd = decision.body
        spoofed = self.ctx.spoofed_headers()
        metadata = _lb_metadata(decision.address)
        if body is None:
            yield pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                    header_mutation=_header_mutation(decision, spoofed, None), clear_route_cache=True)),
                dynamic_metadata=metadata)
        elif self.mode == BUFFERED:
            assert fwd is not None
            changed = fwd is not body
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=pb.CommonResponse(
                    header_mutation=_header_mutation(decision, [], len(fwd)),
                    body_mutation=pb.BodyMutation(body=fwd) if changed else None,
                    clear_route_cache=True)),
                dynamic_metadata=metadata)
        else:
            assert fwd is not None
            yield pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                    header_mutation=_header_mutation(decision, spoofed, None), clear_route_cache=True)),
                dynamic_metadata=metadata)
            for r in _streamed_chunks(fwd, end_of_stream=not trailers):
                yield r
