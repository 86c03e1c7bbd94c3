"""A small ext_proc endpoint picker that follows the endpoint-picker protocol, unless told to break one rule.

The conformance tests start it with one `Break` at a time to show each MUST check can fail, and that a picker
breaking one rule fails exactly that one check.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp_extproc.gaie import DEST_HEADER, EXT_PROC_SERVICE, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE

BUFFERED = processing_mode_pb2.ProcessingMode.BodySendMode.Value("BUFFERED")


class Break(enum.Enum):
    NONE = "none"
    NO_METADATA_STREAMED = "no-metadata-streamed"  # FULL_DUPLEX_STREAMED answers lack envoy.lb metadata
    NO_METADATA_BUFFERED = "no-metadata-buffered"  # BUFFERED answers lack it
    REFUSE_BUFFERED = "refuse-buffered"  # BUFFERED streams fail with FAILED_PRECONDITION (allowed)
    HONOUR_CLIENT_HEADER = "honour-client-header"  # a client-sent destination header chooses
    IGNORE_SUBSET = "ignore-subset"  # a hint that names a pool endpoint does not narrow the choice
    CONTINUE_ON_DISJOINT_SUBSET = "continue-on-disjoint-subset"  # hint outside the pool: CONTINUE, no 503
    EMPTY_SUBSET_IS_NO_HINT = "empty-subset-is-no-hint"  # an empty hint list routes as if there were none
    NOT_READY = "not-ready"  # readiness health is NOT_SERVING
    NO_OVERALL_HEALTH = "no-overall-health"  # service "" is NOT_SERVING
    NO_ENDPOINTS_500 = "no-endpoints-500"  # with no endpoints: 500 instead of 503
    FAIL_ON_SERVED = "fail-on-served"  # the response headers reporting the served endpoint end the stream in error


def _immediate(code: int) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=code)))


def _subset(req: pb.ProcessingRequest) -> list[str] | None:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    return [v.string_value for v in ns.fields[SUBSET_KEY].list_value.values]


class FakePicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: list[str], brk: Break = Break.NONE) -> None:
        self.endpoints = endpoints
        self.brk = brk
        self._turn = itertools.count()

    def _choose(self, subset: list[str] | None, client: str | None) -> str | int:
        """An endpoint, or the status of an ImmediateResponse (0: CONTINUE without a destination)."""
        if client and self.brk is Break.HONOUR_CLIENT_HEADER:
            return client
        if not self.endpoints:
            return 500 if self.brk is Break.NO_ENDPOINTS_500 else 503
        if subset == [] and self.brk is Break.EMPTY_SUBSET_IS_NO_HINT:
            subset = None
        pool = self.endpoints if subset is None else [e for e in self.endpoints if e in subset]
        if not pool:
            return 0 if subset and self.brk is Break.CONTINUE_ON_DISJOINT_SUBSET else 503
        if self.brk is Break.IGNORE_SUBSET:
            pool = self.endpoints
        return pool[next(self._turn) % len(pool)]

    def _routed(self, kind: str, dest: str, buffered: bool) -> pb.ProcessingResponse:
        mutation = pb.HeaderMutation(remove_headers=[DEST_HEADER], set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DEST_HEADER, raw_value=dest.encode()))])
        if self.brk is Break.HONOUR_CLIENT_HEADER:
            del mutation.remove_headers[:]
        resp = pb.ProcessingResponse(**{kind: pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=mutation, clear_route_cache=True)) if kind == "request_headers" else
            pb.BodyResponse(response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True))})
        omit = Break.NO_METADATA_BUFFERED if buffered else Break.NO_METADATA_STREAMED
        if self.brk is not omit:
            md = struct_pb2.Struct()
            md.update({LB_NAMESPACE: {DEST_HEADER: dest}})
            resp.dynamic_metadata.CopyFrom(md)
        return resp

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        buffered = False
        subset: list[str] | None = None
        client: str | None = None
        body = b""
        async for req in request_iterator:
            if req.HasField("protocol_config"):
                buffered = req.protocol_config.request_body_mode == BUFFERED
                if buffered and self.brk is Break.REFUSE_BUFFERED:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "BUFFERED is not supported")
            if req.HasField("metadata_context"):
                subset = _subset(req)
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                for h in req.request_headers.headers.headers:
                    if h.key == DEST_HEADER:
                        client = h.raw_value.decode()
                if buffered:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "response_headers":
                if self.brk is Break.FAIL_ON_SERVED:
                    await context.abort(grpc.StatusCode.INTERNAL, "unexpected response headers")
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "request_body":
                body += req.request_body.body
                if not req.request_body.end_of_stream:
                    continue
                choice = self._choose(subset, client)
                if choice == 0:
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                    return
                if isinstance(choice, int):
                    yield _immediate(choice)
                    return
                if buffered:
                    yield self._routed("request_body", choice, True)
                    continue
                yield self._routed("request_headers", choice, False)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=True)))))


async def start_fake(endpoints: list[str], brk: Break = Break.NONE) -> tuple[grpc.aio.Server, int]:
    """The fake picker and its gRPC health (on the same port), plaintext; (server, port)."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FakePicker(endpoints, brk), server)
    hs = health.aio.HealthServicer()
    serving = health_pb2.HealthCheckResponse.SERVING
    broken = {Break.NOT_READY: "readiness", Break.NO_OVERALL_HEALTH: ""}.get(brk)
    for name in ("liveness", "readiness", EXT_PROC_SERVICE, ""):
        await hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING if name == broken else serving)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
