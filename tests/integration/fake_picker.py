"""A small ext_proc endpoint picker that follows the endpoint-picker protocol, unless told to break one rule.

The conformance tests start it with one `Break` at a time to show each MUST check can fail, and that a picker
breaking one rule fails exactly that one check.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp_extproc.envoy.tls import ServerCert
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
    SHED_503 = "shed-503"  # a sheddable request on a loaded pool gets 503 instead of 429
    TLS_NO_ALPN = "tls-no-alpn"  # TLS without ALPN (a terminator in front of an h2c server)
    ALTER_BODY = "alter-body"  # the body the worker gets is not the client's (one byte changed, same length)


# The fake's sheddable requests and its load rule: once every endpoint has a request in flight (a stream that
# was routed and is still open), a request carrying this header is shed.
SHED_HEADER = ("x-gateway-inference-objective", "batch")


def _immediate(code: int) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(status=http_status_pb2.HttpStatus(code=code)))


def _subset(req: pb.ProcessingRequest) -> list[str] | None:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    v = ns.fields[SUBSET_KEY]
    if v.WhichOneof("kind") == "string_value":  # Envoy's header_to_metadata writes `ip:port,ip:port`
        return [s.strip() for s in v.string_value.split(",") if s.strip()]
    return [x.string_value for x in v.list_value.values]


class FakePicker(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: list[str], brk: Break = Break.NONE) -> None:
        self.endpoints = endpoints
        self.brk = brk
        self._turn = itertools.count()
        self.in_flight = 0  # routed streams still open

    def _shed(self, sheddable: bool) -> int | None:
        if sheddable and self.endpoints and self.in_flight >= len(self.endpoints):
            return 503 if self.brk is Break.SHED_503 else 429
        return None

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
        """Counts the stream in flight from the answer that routes it until the gateway ends the stream."""
        routed = False
        try:
            async for resp in self._process(request_iterator, context):
                if not routed and (resp.HasField("request_headers") and resp.request_headers.response.header_mutation
                                   .set_headers or resp.HasField("request_body") and resp.request_body.response
                                   .header_mutation.set_headers):
                    routed = True
                    self.in_flight += 1
                yield resp
        finally:
            if routed:
                self.in_flight -= 1

    async def _process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        buffered = False
        subset: list[str] | None = None
        client: str | None = None
        sheddable = False
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
                    if (h.key, h.raw_value.decode()) == SHED_HEADER:
                        sheddable = True
                if buffered:
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "response_headers":
                if self.brk is Break.FAIL_ON_SERVED:
                    await context.abort(grpc.StatusCode.INTERNAL, "unexpected response headers")
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":  # through a real Envoy (--envoy): the answer passes back whole
                chunk = req.response_body
                if buffered:  # STREAMED response bodies: each chunk acknowledged, unchanged
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                else:
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=chunk.body, end_of_stream=chunk.end_of_stream)))))
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            elif kind == "request_body":
                body += req.request_body.body
                if not req.request_body.end_of_stream:
                    continue
                shed = self._shed(sheddable)
                choice = shed if shed is not None else self._choose(subset, client)
                if choice == 0:
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                    return
                if isinstance(choice, int):
                    yield _immediate(choice)
                    return
                if self.brk is Break.ALTER_BODY:
                    body = body.replace(b"conformance", b"CONFORMANCE", 1)
                if buffered:
                    routed = self._routed("request_body", choice, True)
                    if self.brk is Break.ALTER_BODY:
                        routed.request_body.response.body_mutation.body = body
                    yield routed
                    continue
                yield self._routed("request_headers", choice, False)
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=body, end_of_stream=True)))))


async def start_fake(endpoints: list[str], brk: Break = Break.NONE, *, tls: ServerCert | None = None) \
        -> tuple[grpc.aio.Server, int]:
    """The fake picker and its gRPC health (on the same port), plaintext or TLS; (server, port). With
    TLS_NO_ALPN the TLS is a terminator in front of the h2c server that negotiates no ALPN."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FakePicker(endpoints, brk), server)
    hs = health.aio.HealthServicer()
    serving = health_pb2.HealthCheckResponse.SERVING
    broken = {Break.NOT_READY: "readiness", Break.NO_OVERALL_HEALTH: ""}.get(brk)
    for name in ("liveness", "readiness", EXT_PROC_SERVICE, ""):
        await hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING if name == broken else serving)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if tls is not None and brk is not Break.TLS_NO_ALPN:
        creds = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
        port = server.add_secure_port("127.0.0.1:0", creds)
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if tls is not None and brk is Break.TLS_NO_ALPN:
        port = await _tls_terminator(tls, port)
    return server, port


_TERMINATORS: set[asyncio.Task] = set()


async def _tls_terminator(cert: ServerCert, upstream: int) -> int:
    """TLS 1.2+ without ALPN, piping bytes to the h2c server on `upstream`; its port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory() as d:
        crt, key = Path(d) / "c", Path(d) / "k"
        crt.write_bytes(cert.cert_pem)
        key.write_bytes(cert.key_pem)
        ctx.load_cert_chain(crt, key)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", upstream)
        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    srv = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    task = asyncio.ensure_future(srv.serve_forever())
    _TERMINATORS.add(task)
    task.add_done_callback(_TERMINATORS.discard)
    return srv.sockets[0].getsockname()[1]
