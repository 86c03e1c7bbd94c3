"""gRPC health for Envoy and Kubernetes probes: liveness, readiness, the ext_proc service name and "".

The reference servicer (grpcio-health-checking) keeps a condition per watched service name for as long as a
`Watch` on it is open, whatever the name, and a stream holds its request message: 150 watches on 3 MB names
cost 2 GB. `BoundedHealthServicer` keeps the reference behaviour for the services we serve and bounds the
rest: a name longer than `MAX_SERVICE_NAME_BYTES` is refused (INVALID_ARGUMENT) before anything is kept,
another unknown name answers SERVICE_UNKNOWN and stays open as the health protocol asks, but is never stored
(our names are fixed at start, so it can never become known), and at most `max_watchers` Watch streams are
open at once (RESOURCE_EXHAUSTED beyond). Check never stores anything (unknown names: NOT_FOUND).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp_extproc.envoy.streams import LongLivedStreams

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVICES = ("liveness", "readiness", EXT_PROC_SERVICE, "")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
MAX_SERVICE_NAME_BYTES = 256  # a fully qualified gRPC service name; ours is 43
DEFAULT_MAX_WATCHERS = 128  # kubelet and Envoy use Check; Watch is for client-side health checking
MAX_REQUEST_BYTES = 4096  # a HealthCheckRequest is one short string
# For a server that serves only health (port 9003): gRPC refuses a larger request before it is buffered and
# parsed, which the servicer alone cannot (150 concurrent 3 MB requests peak at +570 MB before any handler
# runs). Where health shares a port with ext_proc the servicer's own bounds still apply.
HEALTH_SERVER_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                         ("grpc.max_concurrent_streams", 256)]


class BoundedHealthServicer(health.aio.HealthServicer):
    """The reference aio servicer with bounded Watch: see the module docstring."""

    def __init__(self, known: Iterable[str] = SERVICES, *, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        super().__init__()
        self.known = frozenset(known)
        self.max_watchers = max_watchers
        self.watchers = 0
        self._closing = asyncio.Event()
        self.streams = LongLivedStreams()  # a drain ends them once the requests are done

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the gRPC method name
                    context: grpc.aio.ServicerContext) -> None:
        service = request.service
        if len(service) > MAX_SERVICE_NAME_BYTES or len(service.encode()) > MAX_SERVICE_NAME_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"service name longer than {MAX_SERVICE_NAME_BYTES} bytes")
        if self.watchers >= self.max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_watchers} health watchers already open; use Check")
        self.watchers += 1
        try:
            with self.streams.track():
                if service in self.known:
                    await super().Watch(request, context)
                else:
                    del service  # nothing about an unknown name outlives this line but the call's own request
                    await context.write(health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN))
                    await self._closing.wait()  # the protocol keeps the call open; it ends at shutdown/cancel
        finally:
            self.watchers -= 1

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        if service not in self.known:
            raise ValueError(f"unknown health service {service!r}; known: {sorted(self.known)}")
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._closing.set()


class Health:
    """Liveness is true while the process serves; readiness needs at least one known endpoint."""

    def __init__(self, *, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        self.servicer = BoundedHealthServicer(SERVICES, max_watchers=max_watchers)
        self._ready: bool | None = None

    async def start(self) -> None:
        await self.servicer.set("liveness", SERVING)
        await self.set_ready(False)

    async def set_ready(self, ready: bool) -> None:
        if ready == self._ready:
            return
        self._ready = ready
        status = SERVING if ready else NOT_SERVING
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()

    def add_to(self, server) -> None:  # noqa: ANN001 - grpc.aio.Server
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
