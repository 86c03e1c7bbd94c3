"""Hostile clients of the side ports: gRPC health and the admin/metrics HTTP port.

The memory case runs the real `epp-extproc` process and reads its RSS from /proc, because what grows is
gRPC's C core and protobuf memory, which no Python-level accounting sees.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.dev.procs import Proc
from epp_extproc.envoy.health import Health
from tests.netutil import free_port
from tests.waiting import SCALE

BIN = Path(sys.executable).parent
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def picker_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    health = free_port()
    argv = [str(BIN / "epp-extproc"), "--bind", "127.0.0.1", "--grpc-port", str(free_port()), "--health-port",
            str(health), "--metrics-port", str(free_port()), "--admin-port", str(free_port()),
            "--endpoints", "127.0.0.1:1", "--endpoint-probe-interval-ms", "0", "--log-level", "WARNING"]
    picker = Proc("picker", argv, health, tmp_path / "picker.log")
    try:
        picker.start(timeout=20)
        assert picker.proc is not None
        yield picker.proc, health
    finally:
        picker.stop()


async def check(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=5)).status


async def test_watch_with_huge_service_names_costs_the_picker_bounded_memory(picker_process) -> None:  # noqa: ANN001
    proc, port = picker_process
    assert await check(port, "liveness") == SERVING
    before = rss_mb(proc.pid)
    name = "x" * (3 * 1024 * 1024)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service=name)) for _ in range(150)]

        async def first(call: grpc.aio.UnaryStreamCall) -> object:
            try:
                # 450 MB leave the client here: on a busy 2-core machine that alone can take most of a
                # minute, so the deadline scales and is generous (the assertion is on the answer, not time)
                return await asyncio.wait_for(call.read(), 60 * SCALE)
            except grpc.aio.AioRpcError as e:
                return e.code()

        answers = await asyncio.gather(*(first(c) for c in calls))
        held = rss_mb(proc.pid) - before  # while every call the picker did not refuse is still open
        for c in calls:
            c.cancel()
    await asyncio.sleep(0.5)
    after = rss_mb(proc.pid) - before
    print(f"picker RSS: +{held:.0f} MB with 150 watches on 3 MB names open, +{after:.0f} MB after")
    # refused, never watched: by gRPC's size limit on the health port, or the servicer's name limit
    assert set(answers) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}, answers
    # A picker that kept the watches would hold all 450 MB sent. What it holds is gRPC's C core reading the
    # requests it then refuses, as many at once as the machine lets arrive (+18 MB on a quiet machine, +153 MB
    # once on a loaded one, against a bound of 150 then): the bound is half of what was sent
    assert held < 225, f"+{held:.0f} MB while 150 watches on 3 MB names were open (450 MB sent)"
    assert after < 225, f"+{after:.0f} MB after they closed (450 MB sent)"
    assert await check(port, "liveness") == SERVING


@pytest.fixture
async def health_server() -> AsyncIterator[tuple[Health, str]]:
    health = Health(max_watchers=4)
    await health.start()
    server = grpc.aio.server()
    health.add_to(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield health, f"127.0.0.1:{port}"
    await health.shutdown()
    await server.stop(0)


async def test_unknown_service_watch_answers_service_unknown_and_stores_nothing(health_server) -> None:  # noqa: ANN001
    health, target = health_server
    async with grpc.aio.insecure_channel(target) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert (await call.read()).status == SERVICE_UNKNOWN
        assert health.servicer.watchers == 1
        assert "no.such.Service" not in health.servicer._server_watchers  # the reference servicer's store
        assert "no.such.Service" not in health.servicer._watcher_count_by_service
        call.cancel()


async def test_watchers_beyond_the_cap_are_refused_and_known_names_still_work(health_server) -> None:  # noqa: ANN001
    health, target = health_server
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        held = [stub.Watch(health_pb2.HealthCheckRequest(service=f"unknown-{i}")) for i in range(3)]
        for c in held:
            assert (await c.read()).status == SERVICE_UNKNOWN
        ready = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert (await ready.read()).status == NOT_SERVING
        extra = stub.Watch(health_pb2.HealthCheckRequest(service="liveness"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await extra.read()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == SERVING
        await health.set_ready(True)
        assert (await ready.read()).status == SERVING  # the known watcher still hears changes
        for c in held:
            c.cancel()
        deadline = time.monotonic() + 5
        while health.servicer.watchers > 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        again = stub.Watch(health_pb2.HealthCheckRequest(service="liveness"))
        assert (await again.read()).status == SERVING  # slots come back when watchers leave
        again.cancel()
        ready.cancel()


async def test_check_on_a_huge_unknown_name_is_not_found(health_server) -> None:  # noqa: ANN001
    _, target = health_server
    async with grpc.aio.insecure_channel(target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="y" * 100_000))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------------------------------------- admin bind


def http_status(host: str, port: int, path: str) -> int | None:
    """The HTTP status of GET path, or None when nothing listens there."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:  # noqa: S310 - loopback
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (ConnectionRefusedError, urllib.error.URLError):
        return None


@pytest.fixture
async def split_picker() -> AsyncIterator[object]:
    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config

    # metrics on 127.0.0.2 stands for the pod IP; the admin API keeps its default loopback bind 127.0.0.1
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.2",
                           endpoints="a=127.0.0.1:9", endpoint_probe_interval_ms=0))
    await app.start()
    yield app
    await app.stop()


def test_defaults_put_metrics_on_all_interfaces_and_the_debug_api_on_loopback() -> None:
    from epp_extproc.config import load_config

    cfg = load_config([], env={})
    assert (cfg.bind, cfg.metrics_port, cfg.admin_bind, cfg.admin_port) == ("0.0.0.0", 9090, "127.0.0.1", 9091)


async def test_the_metrics_listener_serves_metrics_but_not_the_debug_api(split_picker) -> None:  # noqa: ANN001
    port = split_picker.metrics_port
    assert await asyncio.to_thread(http_status, "127.0.0.2", port, "/metrics") == 200
    for path in ("/debug/endpoints", "/debug/kv"):
        assert await asyncio.to_thread(http_status, "127.0.0.2", port, path) == 404


async def test_the_debug_api_listens_on_the_admin_bind_only(split_picker) -> None:  # noqa: ANN001
    port = split_picker.admin_port
    assert await asyncio.to_thread(http_status, "127.0.0.1", port, "/debug/endpoints") == 200
    assert await asyncio.to_thread(http_status, "127.0.0.2", port, "/debug/endpoints") is None


async def test_the_same_address_and_port_for_both_is_one_listener_serving_everything() -> None:
    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config

    port = free_port()
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=port, admin_port=port, bind="127.0.0.1",
                           admin_bind="127.0.0.1", endpoints="a=127.0.0.1:9", endpoint_probe_interval_ms=0))
    await app.start()
    try:
        assert (app.metrics_port, app.admin_port) == (port, port)
        for path in ("/metrics", "/debug/endpoints"):
            assert await asyncio.to_thread(http_status, "127.0.0.1", port, path) == 200
    finally:
        await app.stop()


def test_the_admin_port_on_the_metrics_port_with_another_address_is_refused_at_start() -> None:
    from epp_extproc.config import load_config

    with pytest.raises(SystemExit, match="DYN_EPP_ADMIN_PORT"):
        load_config(["--admin-port", "9090"], env={})
