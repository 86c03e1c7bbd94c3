"""The picker with its defaults behind an Envoy configured the way the Gateway API Inference Extension's is.

The config below is written here, stanza by stanza, after GAIE's test/testdata/envoy.yaml (commit 1748e829;
the same stanzas ship in its `inferencepool` chart): ext_proc in FULL_DUPLEX_STREAMED both ways with trailers
SEND and a 1000 s message timeout, no metadata namespaces forwarded, a 32 KiB listener buffer, the ORIGINAL_DST
cluster keyed on `x-gateway-destination-endpoint`, and an `ext_proc` cluster that speaks TLS without verifying
the picker and health-checks it over gRPC on the ext_proc port (service
`envoy.service.ext_proc.v3.ExternalProcessor`). It is deliberately NOT built by our generator: it is the
configuration a user of GAIE already has. Clients are plain HTTP and the official `openai` SDK.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.core.endpoints import Endpoint
from epp_extproc.dev.envoy_config import command as envoy_command
from epp_extproc.dev.procs import Proc
from tests.gateway_client import request
from tests.harness import BackgroundLoop, remove_test_dir
from tests.netutil import free_port
from tests.stack import MOCK, GatewayStack, MockProc

pytestmark = pytest.mark.transport  # also run on --extproc-transport grpcio by `make test`

EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def gaie_config(listen_port: int, admin_port: int, picker_port: int) -> dict[str, Any]:
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc", "authority": f"epp.test:{picker_port}"},
                             "timeout": "10s"},
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "response_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            "message_timeout": "1000s",
        },
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "http-8081",
        "route_config": {"name": "vllm", "virtual_hosts": [{"name": "vllm-default", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "route": {"cluster": "original_destination_cluster", "timeout": "86400s", "idle_timeout": "86400s",
                      "upgrade_configs": [{"upgrade_type": "websocket"}]},
            "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}},
        }]}]},
        "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True}}],
        "http2_protocol_options": {"max_concurrent_streams": 100, "initial_stream_window_size": 65536,
                                   "initial_connection_window_size": 1048576},
        "use_remote_address": True, "normalize_path": True, "merge_slashes": True,
        "server_header_transformation": "PASS_THROUGH",
        "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
    }
    breakers = {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}]}
    return {
        "admin": {"address": _socket("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "vllm", "address": _socket("127.0.0.1", listen_port),
                "per_connection_buffer_limit_bytes": 32768,
                "filter_chains": [{"name": "vllm", "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": [
                {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "1000s",
                 "lb_policy": "CLUSTER_PROVIDED", "circuit_breakers": breakers,
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "ext_proc", "type": "STRICT_DNS", "connect_timeout": "86400s", "lb_policy": "LEAST_REQUEST",
                 "circuit_breakers": {"thresholds": [{**breakers["thresholds"][0], "max_retries": 1024}]},
                 "health_checks": [{"timeout": "2s", "interval": "10s", "unhealthy_threshold": 3,
                                    "healthy_threshold": 2, "reuse_connection": True,
                                    "grpc_health_check": {"service_name": EXT_PROC},
                                    "tls_options": {"alpn_protocols": ["h2"]}}],
                 "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                     "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                     "common_tls_context": {"validation_context": {}}}},  # TLS, picker not verified
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {
                         "initial_stream_window_size": 65536, "initial_connection_window_size": 1048576}}}},
                 "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{
                     "locality": {"region": "ext_proc/e2e/0"},
                     "lb_endpoints": [{"endpoint": {"address": _socket("127.0.0.1", picker_port)},
                                       "load_balancing_weight": 1}]}]}},
            ],
        },
    }


class GaieGateway:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="epp-gaie-"))
        self.mocks = []
        for i in range(2):
            port = free_port()
            self.mocks.append(MockProc(f"worker-{i}", [MOCK, "--name", f"worker-{i}", "--port", str(port),
                                                       "--no-kv-events"], port, log=self.dir / f"w{i}.log").start())
        self.bg = BackgroundLoop()
        # the picker's defaults (TLS on, load-only routing, probes on); only ports and endpoints are given
        self.cfg = Config(grpc_port=free_port(), health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                          endpoints=",".join(f"{m.name}={m.address}" for m in self.mocks))
        self.app = PickerApp(self.cfg)
        self.bg.run(self.app.start())
        self.listen_port, self.admin_port = free_port(), free_port()
        cfg = self.dir / "envoy.yaml"
        cfg.write_text(json.dumps(gaie_config(self.listen_port, self.admin_port, self.app.grpc_port)))
        self.envoy = Proc("envoy", envoy_command(cfg), self.listen_port, self.dir / "envoy.log")
        try:
            self.envoy.start(timeout=30)
        except RuntimeError:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?format=json", timeout=5) as r:
            doc = json.loads(r.read())
        return {s["name"]: s.get("value", 0) for s in doc.get("stats", []) if "name" in s}

    def wait_stat(self, name: str, at_least: int = 1, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            v = self.stats().get(name, 0)
            if v >= at_least or time.monotonic() > deadline:
                return v
            time.sleep(0.1)

    def close(self) -> None:
        self.envoy.stop()
        self.bg.run(self.app.stop())
        self.bg.close()
        for m in self.mocks:
            m.stop()
        remove_test_dir(self.dir)


@pytest.fixture(scope="module")
def gw() -> Iterator[GaieGateway]:
    g = GaieGateway()
    yield g
    g.close()


def test_gaie_health_check_on_the_ext_proc_port_marks_the_picker_healthy(gw: GaieGateway) -> None:
    assert gw.wait_stat("cluster.ext_proc.health_check.success") >= 1
    stats = gw.stats()
    assert stats.get("cluster.ext_proc.health_check.failure", 0) == 0
    assert stats.get("cluster.ext_proc.membership_healthy") == 1  # not panic routing


def test_gaie_envoy_speaks_tls_to_the_default_picker_and_routes_a_chat(gw: GaieGateway) -> None:
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}).encode()
    r = request(gw.url, body=body)
    assert r.status == 200, r.body
    assert r.headers["x-trtllm-mock-worker"] in ("worker-0", "worker-1")
    assert gw.stats().get("cluster.ext_proc.ssl.handshake", 0) >= 1


def _client(gw: GaieGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_sdk_chat_and_streaming_through_the_gaie_gateway(gw: GaieGateway) -> None:
    client = _client(gw)
    out = client.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "hello"}],
                                         max_tokens=4)
    assert out.usage is not None and out.usage.completion_tokens == 4
    assert out.choices[0].message.content
    chunks = list(client.chat.completions.create(model="mock-model", max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "stream please"}]))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    text = client.completions.create(model="mock-model", prompt="complete this", max_tokens=3)
    assert text.usage is not None and text.usage.completion_tokens == 3


def test_openai_sdk_shows_the_pickers_error_message(gw: GaieGateway) -> None:
    """With no endpoint left the picker answers 503; the SDK must surface its reason (an OpenAI-shaped JSON
    error: `exc.body` is the inner {"message", "type", ...} object)."""
    async def set_endpoints(eps: list[Endpoint]) -> None:
        gw.app.registry.replace(eps)

    before = gw.app.registry.all()
    gw.bg.run(set_endpoints([]))
    try:
        with pytest.raises(openai.APIStatusError) as ei:
            _client(gw).chat.completions.create(model="mock-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "anyone?"}])
    finally:
        gw.bg.run(set_endpoints(before))
    exc = ei.value
    assert exc.status_code == 503
    assert "no endpoint available" in str(exc)
    assert isinstance(exc.body, dict) and "no endpoint available" in exc.body.get("message", ""), exc.body


# ------------------------------------------------------------------ the same SDK behind our generated config
@pytest.fixture(scope="module")
def ours() -> Iterator[GatewayStack]:
    s = GatewayStack(workers=2).start()  # the generator's defaults: TLS to the picker, health check, metadata
    yield s
    s.stop()


def test_openai_sdk_through_our_generated_config_lands_on_the_cached_worker(ours: GatewayStack) -> None:
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "system", "content": "You are a careful assistant. " * 40},
                {"role": "user", "content": "first question"}]
    first = client.chat.completions.with_raw_response.create(model="mock-model", messages=messages, max_tokens=2)
    worker = first.headers["x-trtllm-mock-worker"]
    ours.wait_index_matches()
    again = client.chat.completions.with_raw_response.create(model="mock-model", max_tokens=2,
                                                             messages=[*messages[:1],
                                                                       {"role": "user", "content": "second"}])
    assert again.headers["x-trtllm-mock-worker"] == worker  # KV-aware through TLS + the SDK
    usage = again.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0
