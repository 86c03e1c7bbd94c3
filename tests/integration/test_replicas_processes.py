"""`epp-extproc --processes 2` behind a real Envoy: two processes share the ext_proc port and the load.

Envoy rotates its picker connections (max_requests_per_connection) so the kernel's SO_REUSEPORT balancing
has connections to spread; both processes must then route, the requests must all succeed, process 0's view
must include load booked by process 1, and SIGTERM must stop the whole group.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from epp_extproc.dev.envoy_config import EnvoyOptions
from epp_extproc.dev.procs import Proc
from tests.gateway_client import request
from tests.harness import EnvoyProcess, remove_test_dir
from tests.netutil import free_port, wait_port
from tests.stack import GatewayStack

EPP = str(Path(sys.executable).parent / "epp-extproc")


def two_free_ports(avoid: set[int]) -> int:
    """A port p with p and p + 1 free (process 1 serves its metrics on metrics-port + 1)."""
    while True:
        p = free_port()
        if p in avoid or p + 1 in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p


def metric(port: int, name: str) -> float:
    text = request(f"http://127.0.0.1:{port}", method="GET", path="/metrics").body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def process_group(*extra: str) -> Iterator[tuple[GatewayStack, Any, EnvoyProcess, int]]:
    """`epp-extproc --processes 2 [extra...]` over two mock workers and a renderer, behind a real Envoy: yields
    (stack, the supervisor's process, Envoy, the first child's metrics port); everything stops at the end."""
    stack = GatewayStack(workers=2)
    for m in [*stack.mocks, stack.renderer]:
        m.start()
    grpc_port, health_port = free_port(), free_port()
    metrics_port = two_free_ports(avoid={grpc_port, health_port})
    picker = Proc("picker", [EPP, "--processes", "2", *extra, "--grpc-port", str(grpc_port), "--health-port",
                             str(health_port), "--metrics-port", str(metrics_port), "--bind", "127.0.0.1",
                             "--endpoints", stack.endpoints_spec(), "--tokenizer-protocol", "trtllm-render",
                             "--tokenizer-service-url", stack.renderer.url, "--drain-timeout-s", "2",
                             "--secure-serving=false"], grpc_port, stack.dir / "picker.log")
    envoy = None
    try:
        picker.start(timeout=None)
        for port in (grpc_port, metrics_port, metrics_port + 1):
            wait_port(port, timeout=30, proc=picker.proc)
        envoy = EnvoyProcess(EnvoyOptions(picker_port=grpc_port, picker_max_requests_per_connection=1,
                                           picker_tls=False)).start()
        yield stack, picker.proc, envoy, metrics_port
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop(grace=15)
        for m in [*stack.mocks, stack.renderer]:
            m.stop()
        remove_test_dir(stack.dir)


@pytest.fixture(scope="module")
def group() -> Any:
    yield from process_group()


def chat(url: str, i: int) -> int:
    body = {"model": "mock-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"question {i} " + "context " * 50}]}
    return request(url, body=json.dumps(body).encode()).status


def test_both_processes_route_requests_through_one_port(group) -> None:  # noqa: ANN001
    stack, _, envoy, metrics_port = group
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: chat(envoy.url, i), range(60)))
    assert statuses == [200] * 60
    picks = [metric(metrics_port + i, "epp_picks_total") for i in range(2)]
    assert sum(picks) == 60 and min(picks) > 0, f"picks per process: {picks}"


def test_process_zero_sees_the_load_booked_by_process_one(group) -> None:  # noqa: ANN001
    _, _, _, metrics_port = group
    # Process 1's sync link to process 0 is up (its lag histogram counts acked batches once it routed).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(metrics_port + 1, "epp_replica_sync_link_up") < 1:
        time.sleep(0.1)
    assert metric(metrics_port + 1, "epp_replica_sync_link_up") == 1
    assert metric(metrics_port + 1, "epp_replica_sync_lag_seconds_count") > 0


def test_sigterm_stops_every_process(group) -> None:  # noqa: ANN001
    _, proc, _, metrics_port = group
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    for port in (metrics_port, metrics_port + 1):
        with pytest.raises(OSError):
            request(f"http://127.0.0.1:{port}", method="GET", path="/metrics")
