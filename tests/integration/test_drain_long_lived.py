"""A drain waits for requests, not for the service streams a gateway keeps open (access log, health Watch)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.app import PickerApp
from epp_extproc.config import Config

TRANSPORTS = ["h2", "grpcio"]


async def started(transport: str) -> PickerApp:
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                           endpoints="a=127.0.0.1:9", endpoint_probe_interval_ms=0, worker_metrics_interval_ms=0,
                           secure_serving=False,
                           extproc_transport=transport))
    await app.start()
    return app


async def open_service_streams(app: PickerApp, channel: grpc.aio.Channel) -> list[object]:
    """An access-log stream with one message sent, and a health Watch that got its first answer."""
    als = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
    await als.write(als_pb2.StreamAccessLogsMessage(identifier=als_pb2.StreamAccessLogsMessage.Identifier(
        log_name="epp")))
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="liveness"))
    await watch.read()
    for _ in range(200):
        if len(app.access_log.streams) and len(app.health.servicer.streams):
            break
        await asyncio.sleep(0.01)
    assert len(app.access_log.streams) == 1 and len(app.health.servicer.streams) == 1
    return [als, watch]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_idle_gateways_service_streams_do_not_hold_the_drain(
        transport: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "epp_extproc")
    app = await started(transport)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        await open_service_streams(app, channel)
        t0 = time.monotonic()
        await app.stop(grace=20.0)
        took = time.monotonic() - t0
    assert took < 5.0, f"drain took {took:.1f}s with no request in flight"
    assert any("drained: 0 requests finished, 0 cut" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_request_in_flight_holds_the_drain_until_it_ends(transport: str) -> None:
    app = await started(transport)
    exchange = app.picker.open()  # a request stream in flight, as the edge holds it
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        await open_service_streams(app, channel)
        stopping = asyncio.create_task(app.stop(grace=20.0))
        await asyncio.sleep(1.0)
        assert not stopping.done()  # the request holds it
        assert len(app.access_log.streams) == 1  # and the access log stays open for its entry
        t0 = time.monotonic()
        exchange.close()
        await stopping
        assert time.monotonic() - t0 < 3.0
