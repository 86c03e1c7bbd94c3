"""Picker configuration: CLI flags, each also readable from an environment variable.

The env names are Dynamo's (`DYN_EPP_*`, `DYN_KV_CACHE_BLOCK_SIZE`, `DYN_ROUTER_*`) wherever Dynamo has one, so
users of the reference EPP can switch without rewriting manifests. A flag on the command line wins over the
environment, which wins over the default. `OPTIONS` is the single table both the parser and the README's
flag table are generated from, and what the manifest tests check env names against.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from epp_extproc.envoy.tls import cert_files

TOKENIZER_PROTOCOLS = ("none", "trtllm-render", "vllm-render", "sglang-renderer")
SALT_POLICIES = ("reject", "load-only")
RENDER_FAILURE_POLICIES = ("load-only", "fail")
BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")


@dataclass(frozen=True)
class Option:
    flag: str
    env: str | None
    default: Any
    type: Callable[[str], Any]
    help: str
    choices: Sequence[str] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _opt_str(s: str) -> str | None:
    return s or None


OPTIONS: tuple[Option, ...] = (
    # Serving
    Option("--grpc-port", "DYN_EPP_GRPC_PORT", 9002, int, "ext_proc gRPC port (Envoy connects here, h2c)"),
    Option("--health-port", "DYN_EPP_HEALTH_PORT", 9003, int,
           "gRPC health port (services liveness, readiness, ExternalProcessor, \"\")"),
    Option("--metrics-port", "DYN_EPP_METRICS_PORT", 9090, int,
           "HTTP port for /metrics (Prometheus) and the /debug admin API"),
    Option("--bind", "DYN_EPP_BIND_ADDRESS", "0.0.0.0", str, "address the three ports listen on"),
    Option("--log-level", "DYN_EPP_LOG_LEVEL", "INFO", str, "DEBUG, INFO, WARNING, ERROR"),
    Option("--secure-serving", "DYN_EPP_SECURE_SERVING", False, _bool,
           "TLS on the ext_proc port (health and metrics stay plain); the gateway must then speak TLS to it"),
    Option("--cert-path", "DYN_EPP_CERT_PATH", None, _opt_str,
           "directory with tls.crt and tls.key for secure serving; unset = a self-signed certificate is "
           "generated at start-up (needs the openssl tool)"),
    Option("--drain-timeout-s", "DYN_EPP_DRAIN_TIMEOUT_S", 25.0, float,
           "on SIGTERM: not ready at once, no new ext_proc streams, up to this long for the ones in flight "
           "(keep it below the pod's terminationGracePeriodSeconds)"),
    # Replicas
    Option("--processes", "DYN_EPP_PROCESSES", 1, int,
           "picker processes on this host sharing the ext_proc port (SO_REUSEPORT), synced over Unix "
           "sockets; process 0 serves health and metrics, process i metrics on metrics-port + i"),
    Option("--peers", "DYN_EPP_PEERS", None, _opt_str,
           "peer replicas' sync addresses, comma separated `host:port` (or `unix:/path`): load and "
           "predictions are shared with them"),
    Option("--peer-service", "DYN_EPP_PEER_SERVICE", None, _opt_str,
           "Kubernetes: the picker's own Service; its EndpointSlices' `replica-agg` port are the peers"),
    Option("--pod-ip", "POD_IP", None, _opt_str, "this pod's IP, left out of the peer service's endpoints"),
    Option("--replica-sync-port", "DYN_EPP_REPLICA_SYNC_PORT", 9004, int,
           "gRPC port of the replica-sync service (listens only when peers or --processes > 1 are set)"),
    Option("--peer-timeout-ms", "DYN_EPP_PEER_TIMEOUT_MS", 2000, int,
           "a peer silent this long (it heartbeats every quarter of it) counts as gone"),
    Option("--peer-expiry-ms", "DYN_EPP_PEER_EXPIRY_MS", 5000, int,
           "a gone peer's bookings still count this long (its requests may still run), then are dropped"),
    # Endpoints
    Option("--endpoints", "DYN_EPP_ENDPOINTS", None, _opt_str,
           "static endpoints, comma separated `name=ip:port` (or just `ip:port`)"),
    Option("--endpoints-file", "DYN_EPP_ENDPOINTS_FILE", None, _opt_str,
           "YAML/JSON file with the endpoints; reloaded when it changes"),
    Option("--inference-pool-name", "DYN_EPP_INFERENCE_POOL_NAME", None, _opt_str,
           "discover endpoints from this InferencePool (Kubernetes)"),
    Option("--namespace", "POD_NAMESPACE", None, _opt_str, "namespace of the InferencePool (default: own)"),
    Option("--kubeconfig", "KUBECONFIG", None, _opt_str,
           "kubeconfig for running outside the cluster (default: in-cluster config)"),
    Option("--endpoint-probe-interval-ms", "DYN_EPP_ENDPOINT_PROBE_INTERVAL_MS", 1000, int,
           "GET each endpoint's probe path this often; refused = out of rotation at once (and its KV entries "
           "dropped), other failures after 2 in a row, back after 1 success; 0 = off"),
    Option("--endpoint-probe-path", "DYN_EPP_ENDPOINT_PROBE_PATH", "/health", str,
           "HTTP path the endpoint prober GETs (trtllm-serve, vLLM and SGLang answer /health)"),
    Option("--kv-event-port", "DYN_EPP_KV_EVENT_PORT", 5557, int,
           "per-worker ZMQ PUB port for KV events (used when an endpoint names none)"),
    Option("--kv-event-replay-port", "DYN_EPP_KV_EVENT_REPLAY_PORT", None,
           lambda s: int(s) if s else None, "per-worker ZMQ replay (ROUTER) port; unset = no replay"),
    Option("--kv-event-topic", "DYN_EPP_KV_EVENT_TOPIC", "", str, "ZMQ topic to subscribe to (prefix match)"),
    # Request handling
    Option("--max-inflight-requests", "DYN_EPP_MAX_INFLIGHT_REQUESTS", 1024, int,
           "above this many requests in the picker: 503 \"endpoint picker overloaded\""),
    Option("--max-body-bytes", "DYN_EPP_MAX_BODY_BYTES", 32 * 1024 * 1024, int,
           "request bodies above this size get 413"),
    Option("--allowed-body-modes", "DYN_EPP_ALLOWED_BODY_MODES", "FULL_DUPLEX_STREAMED,BUFFERED", str,
           "request body modes the picker accepts from Envoy's protocol_config"),
    # Rendering
    Option("--tokenizer-protocol", "DYN_EPP_TOKENIZER_PROTOCOL", "none", str,
           "renderer protocol; `none` routes by load only", TOKENIZER_PROTOCOLS),
    Option("--tokenizer-service-url", "DYN_EPP_TOKENIZER_SERVICE_URL", None, _opt_str,
           "absolute http(s) base URL of the renderer; /v1/chat/completions/render is appended"),
    Option("--tokenization-timeout-ms", "DYN_EPP_TOKENIZATION_TIMEOUT_MS", 5000, int,
           "timeout of the whole render call"),
    Option("--tokenizer-max-response-bytes", "DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", 16 * 1024 * 1024, int,
           "cap on the render answer"),
    Option("--render-failure-policy", "DYN_EPP_RENDER_FAILURE_POLICY", "load-only", str,
           "renderer down/5xx/timeout: `load-only` routes by load; `fail` answers 503/502/504 like Dynamo",
           RENDER_FAILURE_POLICIES),
    Option("--render-reject-policy", "DYN_EPP_RENDER_REJECT_POLICY", "load-only", str,
           "renderer 4xx: `load-only` routes by load and lets the worker answer; `fail` answers 400",
           RENDER_FAILURE_POLICIES),
    Option("--cache-salt-policy", "DYN_EPP_CACHE_SALT_POLICY", "reject", str,
           "trtllm-render + salted request: `reject` = 400 like Dynamo; `load-only` = route by load, forward "
           "the salt as top-level cache_salt", SALT_POLICIES),
    # KV scoring
    Option("--kv-cache-block-size", "DYN_KV_CACHE_BLOCK_SIZE", 32, int,
           "tokens per KV block (TensorRT-LLM default 32); learned per worker from its events"),
    Option("--max-index-blocks-per-worker", "DYN_EPP_MAX_INDEX_BLOCKS_PER_WORKER", 1_000_000, int,
           "cap on indexed blocks per worker (oldest evicted) so missed removals cannot grow memory"),
    Option("--kv-overlap-score-credit", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", 2.0, float,
           "weight of a cached block against a block to prefill (Dynamo's default is 1.0; 2.0 measured "
           "stable at saturation, see bench/README.md)"),
    Option("--prefill-load-scale", "DYN_ROUTER_PREFILL_LOAD_SCALE", 1.0, float, "weight of prefill load"),
    Option("--router-temperature", "DYN_ROUTER_TEMPERATURE", 0.0, float,
           "0 = argmin with random ties; > 0 = softmax sampling over normalised costs"),
    Option("--prediction-ttl-s", "DYN_EPP_PREDICTION_TTL_S", 2.0, float,
           "how long a pick counts as cached on its worker before its KV events confirm it"),
)

ENV_NAMES: frozenset[str] = frozenset(o.env for o in OPTIONS if o.env)


@dataclass
class Config:
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    bind: str = "0.0.0.0"
    log_level: str = "INFO"
    secure_serving: bool = False
    cert_path: str | None = None
    endpoints: str | None = None
    endpoints_file: str | None = None
    inference_pool_name: str | None = None
    namespace: str | None = None
    kubeconfig: str | None = None
    endpoint_probe_interval_ms: int = 1000
    endpoint_probe_path: str = "/health"
    kv_event_port: int = 5557
    kv_event_replay_port: int | None = None
    kv_event_topic: str = ""
    max_inflight_requests: int = 1024
    max_body_bytes: int = 32 * 1024 * 1024
    allowed_body_modes: str = "FULL_DUPLEX_STREAMED,BUFFERED"
    tokenizer_protocol: str = "none"
    tokenizer_service_url: str | None = None
    tokenization_timeout_ms: int = 5000
    tokenizer_max_response_bytes: int = 16 * 1024 * 1024
    render_failure_policy: str = "load-only"
    render_reject_policy: str = "load-only"
    cache_salt_policy: str = "reject"
    kv_cache_block_size: int = 32
    max_index_blocks_per_worker: int = 1_000_000
    kv_overlap_score_credit: float = 2.0
    prefill_load_scale: float = 1.0
    router_temperature: float = 0.0
    prediction_ttl_s: float = 2.0
    drain_timeout_s: float = 25.0
    processes: int = 1
    peers: str | None = None
    peer_service: str | None = None
    pod_ip: str | None = None
    replica_sync_port: int = 9004
    peer_timeout_ms: int = 2000
    peer_expiry_ms: int = 5000
    # Set by the --processes supervisor for each child, not by flags: where its sync service listens.
    replica_sync_listen: tuple[str, ...] = ()
    process_index: int = 0
    share_port: bool = False  # SO_REUSEPORT on the ext_proc port (siblings bind it too)

    def sync_enabled(self) -> bool:
        return bool(self.peers or self.peer_service or self.replica_sync_listen)

    def peer_list(self) -> list[str]:
        return [p.strip() for p in (self.peers or "").split(",") if p.strip()]

    def validate(self) -> None:
        """Fail at start-up, with a message naming the setting, rather than on the first request."""
        if self.tokenizer_protocol not in TOKENIZER_PROTOCOLS:
            raise ValueError(f"DYN_EPP_TOKENIZER_PROTOCOL must be one of {TOKENIZER_PROTOCOLS}")
        if self.tokenizer_protocol != "none":
            url = urlparse(self.tokenizer_service_url or "")
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ValueError("DYN_EPP_TOKENIZER_SERVICE_URL must be an absolute http(s) URL when "
                                 f"DYN_EPP_TOKENIZER_PROTOCOL={self.tokenizer_protocol}; got "
                                 f"{self.tokenizer_service_url!r}")
        if self.cert_path is not None:
            if not self.secure_serving:
                raise ValueError("DYN_EPP_CERT_PATH is set but DYN_EPP_SECURE_SERVING is off: the ext_proc port "
                                 "would serve plain h2c; enable secure serving or drop the cert path")
            cert_files(self.cert_path)
        if self.kv_cache_block_size <= 0:
            raise ValueError("DYN_KV_CACHE_BLOCK_SIZE must be positive")
        if self.endpoint_probe_interval_ms < 0:
            raise ValueError("DYN_EPP_ENDPOINT_PROBE_INTERVAL_MS must be >= 0 (0 = off)")
        if self.max_inflight_requests <= 0:
            raise ValueError("DYN_EPP_MAX_INFLIGHT_REQUESTS must be positive")
        if self.max_body_bytes <= 0:
            raise ValueError("DYN_EPP_MAX_BODY_BYTES must be positive")
        if self.router_temperature < 0:
            raise ValueError("DYN_ROUTER_TEMPERATURE must be >= 0")
        if self.processes < 1:
            raise ValueError("DYN_EPP_PROCESSES must be >= 1")
        if self.processes > 1 and self.grpc_port == 0:
            raise ValueError("DYN_EPP_PROCESSES > 1 needs a fixed DYN_EPP_GRPC_PORT (the processes share it)")
        if self.peers and self.peer_service:
            raise ValueError("choose one peer source: --peers or --peer-service")
        if self.processes > 1 and (self.peers or self.peer_service):
            raise ValueError("DYN_EPP_PROCESSES > 1 cannot be combined with DYN_EPP_PEERS/DYN_EPP_PEER_SERVICE yet")
        if self.peer_timeout_ms <= 0 or self.peer_expiry_ms < 0:
            raise ValueError("DYN_EPP_PEER_TIMEOUT_MS must be positive and DYN_EPP_PEER_EXPIRY_MS >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError("DYN_EPP_DRAIN_TIMEOUT_S must be >= 0")
        modes = self.body_modes()
        bad = [m for m in modes if m not in BODY_MODES]
        if bad or not modes:
            raise ValueError(f"DYN_EPP_ALLOWED_BODY_MODES: unknown mode(s) {bad}; choose from {BODY_MODES}")
        sources = [s for s in (self.endpoints, self.endpoints_file, self.inference_pool_name) if s]
        if len(sources) > 1:
            raise ValueError("choose one endpoint source: --endpoints, --endpoints-file or "
                             "--inference-pool-name")

    def body_modes(self) -> tuple[str, ...]:
        return tuple(m.strip().upper() for m in self.allowed_body_modes.split(",") if m.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epp-extproc",
        description="KV-cache-aware endpoint picker for Envoy (ext_proc). Every flag can also be set "
                    "through the environment variable shown in brackets.",
    )
    for o in OPTIONS:
        env = f" [env {o.env}]" if o.env else ""
        kw: dict[str, Any] = {"dest": o.dest, "default": None, "help": f"{o.help} (default {o.default!r}){env}"}
        if o.choices:
            kw["choices"] = list(o.choices)
        kw["type"] = o.type
        if o.type is _bool:  # `--secure-serving` alone means true; `--secure-serving=false` also works
            kw.update(nargs="?", const=True)
        p.add_argument(o.flag, **kw)
    return p


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for o in OPTIONS:
        v = getattr(args, o.dest)
        if v is None and o.env and env.get(o.env) is not None:
            raw = env[o.env]
            try:
                v = o.type(raw)
            except ValueError as e:
                raise SystemExit(f"epp-extproc: bad value for {o.env}={raw!r}: {e}") from None
            if o.choices and v not in o.choices:
                raise SystemExit(f"epp-extproc: {o.env} must be one of {list(o.choices)}, got {raw!r}")
        if v is None:
            v = o.default
        values[o.dest] = v
    cfg = Config(**values)
    try:
        cfg.validate()
    except ValueError as e:
        raise SystemExit(f"epp-extproc: {e}") from None
    return cfg
