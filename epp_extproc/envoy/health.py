"""gRPC health for Envoy and Kubernetes probes: liveness, readiness, the ext_proc service name and ""."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Liveness is true while the process serves; readiness needs at least one known endpoint."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
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
