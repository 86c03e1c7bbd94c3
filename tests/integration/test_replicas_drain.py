"""Drain through a real Envoy: a stopping picker finishes the streams in flight and takes no new ones."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gateway_client import Reply, request
from tests.stack import GatewayStack


@pytest.fixture
def stack():  # noqa: ANN201
    st = GatewayStack(workers=1, worker_args=["--decode-ms-per-token", "150"]).start()
    yield st
    st.stop()


def readiness(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                        timeout=2).status
        except grpc.RpcError:
            return -1


def test_a_draining_picker_finishes_the_stream_in_flight(stack: GatewayStack) -> None:
    assert stack.app is not None
    health_port = stack.app.health_port
    deadline = time.monotonic() + 10  # readiness is re-evaluated every 100 ms (index warm, peers synced)
    while time.monotonic() < deadline and readiness(health_port) != health_pb2.HealthCheckResponse.SERVING:
        time.sleep(0.05)
    assert readiness(health_port) == health_pb2.HealthCheckResponse.SERVING
    out: list[Reply] = []
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "stream": True}
    t = threading.Thread(target=lambda: out.append(request(stack.url, body=json.dumps(body).encode())))
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and stack.app.picker.open_requests == 0:
        time.sleep(0.01)
    assert stack.app.picker.open_requests == 1
    app = stack.app
    stopping = threading.Thread(target=lambda: stack.bg.run(app.stop(grace=10)))
    stopping.start()
    time.sleep(0.3)
    assert not app.ready()  # NOT_SERVING from the start of the drain
    late = request(stack.url, body=json.dumps({**body, "stream": False}).encode())
    assert late.status != 200  # no new stream is taken while draining
    t.join(15)
    stopping.join(15)
    stack.app = None  # stopped here; the fixture must not stop it again
    assert out and out[0].status == 200
    assert out[0].body.count(b"data: ") >= 12 and b"[DONE]" in out[0].body  # the whole answer, not cut
    assert app.load.total_inflight() == 0
