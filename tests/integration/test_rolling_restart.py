"""A rolling restart of one of two picker replicas behind a real Envoy loses no request (issue 28, item 9).

Envoy learns that a replica is going away only from its gRPC health checks of the picker cluster, and a
stream it opens to a replica that has stopped accepting fails the request (500: failure_mode_allow is off,
and Envoy does not retry an ext_proc stream open). So on SIGTERM the picker reports NOT_SERVING at once but
keeps serving new streams for its shutdown grace period (--graceful-shutdown-grace-period-s), long enough
for Envoy's checks (every 1 s in the generated config; a NOT_SERVING host is out at the next one) to move traffic to the other replica; only then does
it drain. Without the grace period the requests Envoy sends in between fail.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.config import Config
from epp_extproc.dev import procs
from epp_extproc.dev.envoy_config import PICKER_CLUSTER, EnvoyOptions
from epp_extproc.envoy.health import EXT_PROC_SERVICE
from tests.gateway_client import request
from tests.waiting import until

BODY = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()
DEFAULT_GRACE_S = Config.__dataclass_fields__["graceful_shutdown_grace_period_s"].default
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_PICKS = re.compile(r'^epp_picks_total\{[^}]*\} ([0-9.e+]+)$', re.M)


def health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=2).status
        except grpc.RpcError:
            return -1


def picks(p: procs.Proc) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{p.extra['metrics_port']}/metrics", timeout=5) as r:
        return int(sum(float(v) for v in _PICKS.findall(r.read().decode())))


def envoy_health(envoy: procs.Proc) -> dict[str, str]:
    """Envoy's health flags per host of the picker cluster (admin /clusters)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{envoy.extra['admin_port']}/clusters", timeout=5) as r:
        text = r.read().decode()
    pre = f"{PICKER_CLUSTER}::"
    return {line.split("::")[1]: line.rsplit("::", 1)[1] for line in text.splitlines()
            if line.startswith(pre) and "::health_flags::" in line}


class SteadyClient(threading.Thread):
    """Requests one after the other through Envoy until stopped; every status kept."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self._done = url, threading.Event()
        self.statuses: list[int] = []

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.statuses.append(request(self.url, body=BODY, timeout=10).status)
            except OSError:
                self.statuses.append(-1)
            time.sleep(0.01)

    def finish(self) -> list[int]:
        self._done.set()
        self.join(15)
        return self.statuses


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[procs.Proc]:
    w = procs.mock_worker("w0", tmp_path).start()
    yield w
    w.stop()


def test_sigterm_says_not_serving_and_still_serves_new_streams_for_the_grace_period(
        tmp_path: Path, worker: procs.Proc) -> None:
    # Envoy without picker health checks: it keeps opening streams to the picker whatever the health says
    picker = procs.picker(tmp_path, endpoints=procs.endpoint_spec([worker]), shutdown_grace_s=3,
                          args=["--secure-serving=false"])
    envoy = None
    try:
        picker.start()
        envoy = procs.envoy(tmp_path, EnvoyOptions(listen_port=0, admin_port=0, picker_port=picker.port, picker_tls=False,
                                                   picker_health_check=False)).start()
        url = f"http://127.0.0.1:{envoy.port}"
        hp = picker.extra["health_port"]
        until(lambda: health(hp, "readiness") == SERVING, "the picker to be ready")
        assert request(url, body=BODY).status == 200
        assert picker.proc is not None
        t0 = time.monotonic()
        picker.proc.send_signal(signal.SIGTERM)
        until(lambda: health(hp, "readiness") == NOT_SERVING, "NOT_SERVING after SIGTERM", timeout=1)
        assert health(hp, EXT_PROC_SERVICE) == NOT_SERVING  # what Envoy's checks ask (on the ext_proc port too)
        assert health(picker.port, EXT_PROC_SERVICE) == NOT_SERVING
        assert health(hp, "liveness") == SERVING  # going away, not broken: nothing should restart it
        before = picks(picker)
        for _ in range(5):  # each one a new ext_proc stream, opened after the SIGTERM
            assert request(url, body=BODY).status == 200
        assert picks(picker) == before + 5
        assert time.monotonic() - t0 < 2.5 and picker.proc.poll() is None
        until(lambda: picker.proc is not None and picker.proc.poll() is not None, "the picker to exit",
              timeout=15)
        took = time.monotonic() - t0
        assert 2.5 <= took < 8, f"SIGTERM -> exit took {took:.1f}s with a 3 s grace period"
        assert picker.proc.returncode == 0
    finally:
        for p in (envoy, picker):
            if p is not None:
                p.stop()


def test_a_rolling_restart_of_one_of_two_replicas_loses_no_request(tmp_path: Path, worker: procs.Proc) -> None:
    spec = procs.endpoint_spec([worker])
    # the product's default grace period, behind the generated Envoy config's default health checks
    a = procs.picker(tmp_path, endpoints=spec, name="picker-a", shutdown_grace_s=DEFAULT_GRACE_S)
    b = procs.picker(tmp_path, endpoints=spec, name="picker-b", shutdown_grace_s=DEFAULT_GRACE_S)
    envoy = client = None
    try:
        a.start()
        b.start()
        assert a.port is not None and b.port is not None
        envoy = procs.envoy(tmp_path, EnvoyOptions(listen_port=0, admin_port=0, picker_port=a.port,
                                                   extra_picker_ports=(b.port,))).start()
        until(lambda: list(envoy_health(envoy).values()) == ["healthy", "healthy"], "both replicas healthy",
              timeout=30)
        client = SteadyClient(f"http://127.0.0.1:{envoy.port}")
        client.start()
        until(lambda: picks(a) > 10 and picks(b) > 10, "traffic on both replicas", timeout=30)
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        # at Envoy's next check (every 1 s): well within the grace period, or streams opened after it would fail
        until(lambda: envoy_health(envoy)[f"127.0.0.1:{a.port}"] != "healthy", "Envoy to see replica a go",
              timeout=3)
        a.proc.wait(DEFAULT_GRACE_S + 30)
        assert a.proc.returncode == 0
        served_by_b = picks(b)
        a.start(timeout=30)  # same argv, same ports
        until(lambda: envoy_health(envoy)[f"127.0.0.1:{a.port}"] == "healthy", "replica a healthy again",
              timeout=30)
        until(lambda: picks(a) > 10, "streams on the restarted replica a", timeout=30)
        statuses = client.finish()
        assert picks(b) > served_by_b  # b carried the traffic meanwhile
        failed = [s for s in statuses if s != 200]
        assert len(statuses) > 100 and not failed, f"{len(failed)} of {len(statuses)} failed: {set(failed)}"
    finally:
        if client is not None:
            client.finish()
        for p in (envoy, a, b):
            if p is not None:
                p.stop()
