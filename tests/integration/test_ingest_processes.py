"""`epp-extproc --processes 2 --kv-ingest apart` behind a real Envoy, real mock workers publishing real KV events:
the supervisor runs one ingest shard for both children, both children route through it, and SIGTERM stops
the shard with the group."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from epp_extproc.dev.envoy_config import EnvoyOptions
from epp_extproc.dev.procs import Proc
from tests.harness import EnvoyProcess
from tests.integration.test_replicas_processes import EPP, chat, metric, two_free_ports
from tests.netutil import free_port, wait_port
from tests.stack import GatewayStack
from tests.waiting import until


def ingest_children(pid: int) -> list[int]:
    """Pids of `python -m epp_extproc.ingest` processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == pid and b"epp_extproc.ingest" in cmd:
            out.append(int(d))
    return out


@pytest.fixture(scope="module")
def group() -> Any:
    stack = GatewayStack(workers=2)
    for m in [*stack.mocks, stack.renderer]:
        m.start()
    grpc_port, health_port = free_port(), free_port()
    metrics_port = two_free_ports(avoid={grpc_port, health_port})
    picker = Proc("picker", [EPP, "--processes", "2", "--kv-ingest", "apart", "--grpc-port", str(grpc_port),
                             "--health-port", str(health_port), "--metrics-port", str(metrics_port), "--bind",
                             "127.0.0.1", "--endpoints", stack.endpoints_spec(), "--tokenizer-protocol",
                             "trtllm-render", "--tokenizer-service-url", stack.renderer.url, "--drain-timeout-s",
                             "2", "--secure-serving=false"], grpc_port, stack.dir / "picker.log")
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


def test_one_ingest_shard_serves_both_processes(group) -> None:  # noqa: ANN001
    _, proc, envoy, metrics_port = group
    assert len(ingest_children(proc.pid)) == 1  # the supervisor's, not one per child
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: chat(envoy.url, i), range(40)))
    assert statuses == [200] * 40
    looked = [metric(metrics_port + i, 'epp_kv_ingest_lookups_total{result="ok"}') for i in range(2)]
    assert min(looked) > 0, f"lookups answered by the shard, per process: {looked}"


def test_sigterm_stops_the_ingest_shard_with_the_group(group) -> None:  # noqa: ANN001
    _, proc, _, _ = group
    shard = ingest_children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    until(lambda: not os.path.exists(f"/proc/{shard[0]}") or b"Z" in open(f"/proc/{shard[0]}/stat", "rb").read()[:64],
          "the ingest shard to exit", timeout=10)
