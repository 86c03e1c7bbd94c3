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
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any
from urllib.parse import urlparse

from epp_extproc.envoy.tls import cert_files

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
LOG_FORMATS = ("text", "json")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
EXTPROC_TRANSPORTS = ("h2", "grpcio")


class TokenizerProtocol(StrEnum):
    NONE = "none"
    TRTLLM = "trtllm-render"
    VLLM = "vllm-render"
    SGLANG = "sglang-renderer"


class RenderPolicy(StrEnum):
    """What a render failure does: route by load only, or fail the request with the reference status."""

    LOAD_ONLY = "load-only"
    FAIL = "fail"


class SaltPolicy(StrEnum):
    """A salted request with TensorRT-LLM workers (whose events carry no salt)."""

    REJECT = "reject"
    LOAD_ONLY = "load-only"


class PassthroughPolicy(StrEnum):
    """Whether the forwarded request carries the rendered prompt (TensorRT-LLM workers skip rendering)."""

    OFF = "off"
    AUTO = "auto"


TOKENIZER_PROTOCOLS = tuple(p.value for p in TokenizerProtocol)


@dataclass(frozen=True)
class Option:
    flag: str
    env: str | None
    default: Any
    type: Callable[[str], Any]
    help: str
    choices: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.type, type) and issubclass(self.type, StrEnum) and self.choices is None:
            object.__setattr__(self, "choices", tuple(e.value for e in self.type))

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
    Option("--grpc-port", "DYN_EPP_GRPC_PORT", 9002, int,
           "ext_proc gRPC port (Envoy connects here; TLS unless --secure-serving=false); also serves gRPC "
           "health like the health port"),
    Option("--health-port", "DYN_EPP_HEALTH_PORT", 9003, int,
           "gRPC health port (services liveness, readiness, ExternalProcessor, \"\")"),
    Option("--metrics-port", "DYN_EPP_METRICS_PORT", 9090, int,
           "HTTP port for /metrics (Prometheus), on --bind"),
    Option("--bind", "DYN_EPP_BIND_ADDRESS", "0.0.0.0", str,
           "address the ext_proc, health and metrics ports listen on"),
    Option("--admin-port", "DYN_EPP_ADMIN_PORT", 9091, int,
           "HTTP port for the /debug admin API (and /metrics), on --admin-bind; the same address and port "
           "as --bind/--metrics-port = one listener for both"),
    Option("--admin-bind", "DYN_EPP_ADMIN_BIND_ADDRESS", "127.0.0.1", str,
           "address the /debug admin API listens on; it has no authentication, so loopback by default "
           "(kubectl port-forward reaches it)"),
    Option("--log-level", "DYN_EPP_LOG_LEVEL", "INFO", str, "DEBUG, INFO, WARNING, ERROR"),
    Option("--log-format", "DYN_EPP_LOG_FORMAT", "text", str,
           "`text` for people, `json` = one JSON object per line (time, level, logger, message) for log "
           "pipelines", LOG_FORMATS),
    Option("--event-loop", "DYN_EPP_EVENT_LOOP", "auto", str,
           "`uvloop` (libuv) spends less CPU per gRPC message than the standard loop (bench/README.md has the "
           "figures); `auto` = uvloop when it is installed (it is a dependency), else `asyncio`",
           EVENT_LOOPS),
    Option("--extproc-transport", "DYN_EPP_EXTPROC_TRANSPORT", "h2", str,
           "what serves the ext_proc port (ext_proc, gRPC health, the access-log service): `h2` = the picker's "
           "own HTTP/2 gRPC server (envoy/h2server.py), about a third of grpcio's CPU per message "
           "(bench/README.md); `grpcio` = grpcio's asyncio server", EXTPROC_TRANSPORTS),
    Option("--extproc-keepalive-s", "DYN_EPP_EXTPROC_KEEPALIVE_S", 60.0, float,
           "h2 transport: a peer silent this long on the ext_proc port is sent an HTTP/2 PING, and its "
           "connection is closed when nothing arrives within 20 s more (its streams end as cancelled, their "
           "bookings are freed): a gateway host that died without closing its connections holds nothing for "
           "long. Envoy answers PINGs by itself; 0 = off"),
    Option("--extproc-max-connections", "DYN_EPP_EXTPROC_MAX_CONNECTIONS", 4096, int,
           "h2 transport: connections the ext_proc port holds at once; more are closed as they arrive (logged). "
           "Envoy opens one per worker thread, so this is gateway pods x their threads, with room to spare"),
    Option("--secure-serving", "DYN_EPP_SECURE_SERVING", True, _bool,
           "TLS on the ext_proc port, as GAIE's and Dynamo's pickers and their gateway configs expect (health "
           "port and metrics stay plain); `--secure-serving=false` serves plaintext h2c"),
    Option("--cert-path", "DYN_EPP_CERT_PATH", None, _opt_str,
           "directory with tls.crt and tls.key for secure serving, re-read when they change; unset = a "
           "self-signed certificate minted in memory at start-up"),
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
    Option("--replica-sync-tls-path", "DYN_EPP_REPLICA_SYNC_TLS_PATH", None, _opt_str,
           "directory with tls.crt, tls.key and ca.crt (one Secret shared by the replicas): sync over TCP "
           "becomes mutual TLS, each side presenting tls.crt and accepting only certificates ca.crt signed; "
           "re-read when the files change (new connections use the new set); unset = plaintext (keep 9004 behind "
           "the NetworkPolicy); Unix sockets (--processes) stay local"),
    Option("--replica-sync-server-name", "DYN_EPP_REPLICA_SYNC_SERVER_NAME", "epp-replica-sync", str,
           "the name a peer's certificate must carry (a DNS subjectAltName): peers are dialled by pod IP"),
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
    Option("--endpoint-probe-max-rate", "DYN_EPP_ENDPOINT_PROBE_MAX_RATE", 100.0, float,
           "cap on probes per second over the whole pool (probes spread evenly, 32 at most in flight): a "
           "pool larger than rate x interval is probed less often, e.g. 1,000 endpoints every 10 s"),
    Option("--kv-event-port", "DYN_EPP_KV_EVENT_PORT", 5557, int,
           "per-worker ZMQ PUB port for KV events (used when an endpoint names none)"),
    Option("--kv-event-replay-port", "DYN_EPP_KV_EVENT_REPLAY_PORT", None,
           lambda s: int(s) if s else None, "per-worker ZMQ replay (ROUTER) port; unset = no replay"),
    Option("--kv-event-topic", "DYN_EPP_KV_EVENT_TOPIC", "", str, "ZMQ topic to subscribe to (prefix match)"),
    # Request handling
    Option("--max-inflight-requests", "DYN_EPP_MAX_INFLIGHT_REQUESTS", 1024, int,
           "above this many requests in the picker: 503 \"endpoint picker overloaded\""),
    Option("--max-body-bytes", "DYN_EPP_MAX_BODY_BYTES", 32 * 1024 * 1024, int,
           "request bodies above this size get 413 (in both body modes)"),
    Option("--max-buffered-body-bytes", "DYN_EPP_MAX_BUFFERED_BODY_BYTES", 256 * 1024 * 1024, int,
           "all request bodies being buffered at once may hold at most this much; a body that would exceed "
           "it gets 503 (retryable), so many slow or unfinished uploads cannot exhaust memory"),
    Option("--request-body-timeout-ms", "DYN_EPP_REQUEST_BODY_TIMEOUT_MS", 60_000, int,
           "a request whose headers and body have not fully arrived this long after its ext_proc stream "
           "opened gets 408 and frees its slot (stalled clients cannot hold the picker's capacity)"),
    Option("--allowed-body-modes", "DYN_EPP_ALLOWED_BODY_MODES", "FULL_DUPLEX_STREAMED,BUFFERED", str,
           "request body modes the picker accepts from Envoy's protocol_config"),
    # Rendering
    Option("--tokenizer-protocol", "DYN_EPP_TOKENIZER_PROTOCOL", TokenizerProtocol.NONE, TokenizerProtocol,
           "renderer protocol; `none` routes by load only"),
    Option("--tokenizer-service-url", "DYN_EPP_TOKENIZER_SERVICE_URL", None, _opt_str,
           "absolute http(s) base URL of the renderer; /v1/chat/completions/render is appended"),
    Option("--tokenization-timeout-ms", "DYN_EPP_TOKENIZATION_TIMEOUT_MS", 5000, int,
           "timeout of the whole render call"),
    Option("--tokenizer-max-response-bytes", "DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", 16 * 1024 * 1024, int,
           "cap on the render answer"),
    Option("--render-circuit-failures", "DYN_EPP_RENDER_CIRCUIT_FAILURES", 5, int,
           "this many render failures in a row (timeout, unreachable, 401/403/404/429/5xx, redirect, unusable "
           "answer; not a rejecting 4xx) open the renderer's circuit: requests skip it (circuit_open, handled "
           "by the failure policy) until a probe call succeeds; 0 = never open"),
    Option("--render-circuit-open-ms", "DYN_EPP_RENDER_CIRCUIT_OPEN_MS", 5000, int,
           "how long an open circuit skips the renderer before one request probes it; doubles after each "
           "failed probe, up to 60 s"),
    Option("--render-failure-policy", "DYN_EPP_RENDER_FAILURE_POLICY", RenderPolicy.LOAD_ONLY, RenderPolicy,
           "renderer down/5xx/timeout: `load-only` routes by load; `fail` answers 503/502/504 like Dynamo"),
    Option("--render-reject-policy", "DYN_EPP_RENDER_REJECT_POLICY", RenderPolicy.LOAD_ONLY, RenderPolicy,
           "renderer 4xx: `load-only` routes by load and lets the worker answer; `fail` answers 400"),
    Option("--cache-salt-policy", "DYN_EPP_CACHE_SALT_POLICY", SaltPolicy.REJECT, SaltPolicy,
           "trtllm-render + salted request: `reject` = 400 like Dynamo; `load-only` = route by load, forward "
           "the salt as top-level cache_salt"),
    Option("--prompt-passthrough", "DYN_EPP_PROMPT_PASSTHROUGH", PassthroughPolicy.AUTO, PassthroughPolicy,
           "trtllm-render: `auto` forwards the rendered prompt (chat: top-level prompt_token_ids; completions: "
           "prompt as ids) so the worker skips templating and tokenizing, whenever the worker's render "
           "fingerprint matches and the render says the ids are safe; `off` always forwards the original body"),
    Option("--render-fingerprint-refresh-ms", "DYN_EPP_RENDER_FINGERPRINT_REFRESH_MS", 10_000, int,
           "re-read each worker's /server_info render_fingerprint this often (also at admission and when the "
           "prober finds the worker gone)"),
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
    # Worker metrics and flow control
    Option("--worker-metrics-interval-ms", "DYN_EPP_WORKER_METRICS_INTERVAL_MS", 100, int,
           "scrape each worker's Prometheus metrics this often (queue, running, KV utilisation) for "
           "saturation and the load this picker did not book; 0 = off"),
    Option("--worker-metrics-idle-interval-ms", "DYN_EPP_WORKER_METRICS_IDLE_INTERVAL_MS", 1000, int,
           "a worker found idle twice in a row (nothing running or waiting, nothing of this picker's) is "
           "scraped at doubling intervals up to this; a booking on it restores the interval at once; at "
           "or below the interval = every worker at the interval"),
    Option("--worker-metrics-staleness-ms", "DYN_EPP_WORKER_METRICS_STALENESS_MS", 300, int,
           "a worker's metrics older than this are ignored (it is judged by this picker's bookings only)"),
    Option("--worker-metrics-path", "DYN_EPP_WORKER_METRICS_PATH", "/metrics", str,
           "HTTP path of the workers' Prometheus metrics"),
    Option("--flow-control", "DYN_EPP_FLOW_CONTROL", False, _bool,
           "queue requests in the picker while every worker is saturated: priority bands, fairness, TTL"),
    Option("--flow-control-queue-ttl-s", "DYN_EPP_FLOW_CONTROL_QUEUE_TTL_S", 30.0, float,
           "longest a request waits in the queue, then 429 (503 when no endpoint exists); keep it below "
           "the gateway's ext_proc message_timeout"),
    Option("--flow-control-max-queued-requests", "DYN_EPP_FLOW_CONTROL_MAX_QUEUED_REQUESTS", 512, int,
           "queue bound; when full, a request displaces the newest one of a lower band or gets 429"),
    Option("--queue-depth-threshold", "DYN_EPP_QUEUE_DEPTH_THRESHOLD", 5, int,
           "a worker with this many requests waiting in its engine (beyond a full batch) is saturated; 0 = "
           "saturated as soon as its batch is full, so nothing queues where it cannot be reordered"),
    Option("--kv-cache-util-threshold", "DYN_EPP_KV_CACHE_UTIL_THRESHOLD", 0.8, float,
           "a worker with this fraction of its KV cache in use is saturated"),
    Option("--max-num-batched-tokens", "DYN_EPP_MAX_NUM_BATCHED_TOKENS", 0, int,
           "a worker with this many prompt tokens booked in prefill by this picker is saturated; 0 = off"),
    Option("--inference-objectives-file", "DYN_EPP_INFERENCE_OBJECTIVES_FILE", None, _opt_str,
           "YAML/JSON objectives (name -> priority, or InferenceObjective manifests), reloaded when it "
           "changes; with --inference-pool-name the InferenceObjective CRD is read instead"),
)

ENV_NAMES: frozenset[str] = frozenset(o.env for o in OPTIONS if o.env)
_BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}


_DEFAULTS: dict[str, Any] = {o.dest: o.default for o in OPTIONS}


def _default(dest: str) -> Any:
    return _DEFAULTS[dest]


@dataclass(frozen=True)
class ProcessSlot:
    """Where one picker process sits in a `--processes` group; set by the supervisor (or a test), never by a
    flag, so it is not part of Config."""

    index: int = 0
    sync_listen: tuple[str, ...] = ()  # where its replica-sync service listens (instead of bind:replica-sync-port)
    share_port: bool = False  # SO_REUSEPORT on the ext_proc port: its siblings bind it too


@dataclass
class Config:
    """The picker's settings; every default lives in OPTIONS (one table for the parser, the README and here)."""

    grpc_port: int = _default("grpc_port")
    health_port: int = _default("health_port")
    metrics_port: int = _default("metrics_port")
    bind: str = _default("bind")
    admin_port: int = _default("admin_port")
    admin_bind: str = _default("admin_bind")
    log_level: str = _default("log_level")
    log_format: str = _default("log_format")
    event_loop: str = _default("event_loop")
    extproc_transport: str = _default("extproc_transport")
    extproc_keepalive_s: float = _default("extproc_keepalive_s")
    extproc_max_connections: int = _default("extproc_max_connections")
    secure_serving: bool = _default("secure_serving")
    cert_path: str | None = _default("cert_path")
    endpoints: str | None = _default("endpoints")
    endpoints_file: str | None = _default("endpoints_file")
    inference_pool_name: str | None = _default("inference_pool_name")
    namespace: str | None = _default("namespace")
    kubeconfig: str | None = _default("kubeconfig")
    endpoint_probe_interval_ms: int = _default("endpoint_probe_interval_ms")
    endpoint_probe_path: str = _default("endpoint_probe_path")
    endpoint_probe_max_rate: float = _default("endpoint_probe_max_rate")
    kv_event_port: int = _default("kv_event_port")
    kv_event_replay_port: int | None = _default("kv_event_replay_port")
    kv_event_topic: str = _default("kv_event_topic")
    max_inflight_requests: int = _default("max_inflight_requests")
    max_body_bytes: int = _default("max_body_bytes")
    max_buffered_body_bytes: int = _default("max_buffered_body_bytes")
    request_body_timeout_ms: int = _default("request_body_timeout_ms")
    allowed_body_modes: str = _default("allowed_body_modes")
    tokenizer_protocol: TokenizerProtocol = _default("tokenizer_protocol")
    tokenizer_service_url: str | None = _default("tokenizer_service_url")
    tokenization_timeout_ms: int = _default("tokenization_timeout_ms")
    tokenizer_max_response_bytes: int = _default("tokenizer_max_response_bytes")
    render_circuit_failures: int = _default("render_circuit_failures")
    render_circuit_open_ms: int = _default("render_circuit_open_ms")
    render_failure_policy: RenderPolicy = _default("render_failure_policy")
    render_reject_policy: RenderPolicy = _default("render_reject_policy")
    cache_salt_policy: SaltPolicy = _default("cache_salt_policy")
    prompt_passthrough: PassthroughPolicy = _default("prompt_passthrough")
    render_fingerprint_refresh_ms: int = _default("render_fingerprint_refresh_ms")
    kv_cache_block_size: int = _default("kv_cache_block_size")
    max_index_blocks_per_worker: int = _default("max_index_blocks_per_worker")
    kv_overlap_score_credit: float = _default("kv_overlap_score_credit")
    prefill_load_scale: float = _default("prefill_load_scale")
    router_temperature: float = _default("router_temperature")
    prediction_ttl_s: float = _default("prediction_ttl_s")
    worker_metrics_interval_ms: int = _default("worker_metrics_interval_ms")
    worker_metrics_idle_interval_ms: int = _default("worker_metrics_idle_interval_ms")
    worker_metrics_staleness_ms: int = _default("worker_metrics_staleness_ms")
    worker_metrics_path: str = _default("worker_metrics_path")
    flow_control: bool = _default("flow_control")
    flow_control_queue_ttl_s: float = _default("flow_control_queue_ttl_s")
    flow_control_max_queued_requests: int = _default("flow_control_max_queued_requests")
    queue_depth_threshold: int = _default("queue_depth_threshold")
    kv_cache_util_threshold: float = _default("kv_cache_util_threshold")
    max_num_batched_tokens: int = _default("max_num_batched_tokens")
    inference_objectives_file: str | None = _default("inference_objectives_file")
    drain_timeout_s: float = _default("drain_timeout_s")
    processes: int = _default("processes")
    peers: str | None = _default("peers")
    peer_service: str | None = _default("peer_service")
    pod_ip: str | None = _default("pod_ip")
    replica_sync_port: int = _default("replica_sync_port")
    replica_sync_tls_path: str | None = _default("replica_sync_tls_path")
    replica_sync_server_name: str = _default("replica_sync_server_name")
    peer_timeout_ms: int = _default("peer_timeout_ms")
    peer_expiry_ms: int = _default("peer_expiry_ms")

    def __post_init__(self) -> None:
        for f in fields(self):  # accept plain strings from code and tests; store the enum
            opt = _BY_DEST.get(f.name)
            if opt is not None and isinstance(opt.type, type) and issubclass(opt.type, StrEnum):
                try:
                    setattr(self, f.name, opt.type(getattr(self, f.name)))
                except ValueError:
                    raise ValueError(f"{opt.env} must be one of {list(opt.choices or ())}") from None

    def sync_enabled(self) -> bool:
        return bool(self.peers or self.peer_service)

    def peer_list(self) -> list[str]:
        return [p.strip() for p in (self.peers or "").split(",") if p.strip()]

    def validate(self) -> None:
        """Fail at start-up, with a message naming the setting, rather than on the first request."""
        if self.tokenizer_protocol is not TokenizerProtocol.NONE:
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
        if self.render_circuit_failures < 0:
            raise ValueError("DYN_EPP_RENDER_CIRCUIT_FAILURES must be >= 0 (0 = never open)")
        if self.render_circuit_open_ms <= 0:
            raise ValueError("DYN_EPP_RENDER_CIRCUIT_OPEN_MS must be positive")
        if self.admin_port == self.metrics_port != 0 and self.admin_bind != self.bind:
            raise ValueError("DYN_EPP_ADMIN_PORT equals DYN_EPP_METRICS_PORT on a different address: set "
                             "DYN_EPP_ADMIN_BIND_ADDRESS to DYN_EPP_BIND_ADDRESS to serve /debug on the "
                             "metrics listener, or choose another admin port")
        if self.kv_cache_block_size <= 0:
            raise ValueError("DYN_KV_CACHE_BLOCK_SIZE must be positive")
        if self.render_fingerprint_refresh_ms <= 0:
            raise ValueError("DYN_EPP_RENDER_FINGERPRINT_REFRESH_MS must be positive")
        if self.extproc_max_connections <= 0:
            raise ValueError("DYN_EPP_EXTPROC_MAX_CONNECTIONS must be positive")
        if not self.extproc_keepalive_s >= 0:
            raise ValueError("DYN_EPP_EXTPROC_KEEPALIVE_S must be >= 0 (0 = off)")
        if self.endpoint_probe_interval_ms < 0:
            raise ValueError("DYN_EPP_ENDPOINT_PROBE_INTERVAL_MS must be >= 0 (0 = off)")
        if not self.endpoint_probe_max_rate > 0:
            raise ValueError("DYN_EPP_ENDPOINT_PROBE_MAX_RATE must be positive")
        if self.max_inflight_requests <= 0:
            raise ValueError("DYN_EPP_MAX_INFLIGHT_REQUESTS must be positive")
        if self.max_body_bytes <= 0:
            raise ValueError("DYN_EPP_MAX_BODY_BYTES must be positive")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError("DYN_EPP_MAX_BUFFERED_BODY_BYTES must be at least DYN_EPP_MAX_BODY_BYTES (one "
                             "largest body must fit)")
        if self.request_body_timeout_ms <= 0:
            raise ValueError("DYN_EPP_REQUEST_BODY_TIMEOUT_MS must be positive")
        if self.router_temperature < 0:
            raise ValueError("DYN_ROUTER_TEMPERATURE must be >= 0")
        if self.worker_metrics_interval_ms < 0 or self.worker_metrics_staleness_ms <= 0 \
                or self.worker_metrics_idle_interval_ms < 0:
            raise ValueError("DYN_EPP_WORKER_METRICS_INTERVAL_MS and DYN_EPP_WORKER_METRICS_IDLE_INTERVAL_MS "
                             "must be >= 0 and DYN_EPP_WORKER_METRICS_STALENESS_MS > 0")
        if not 0 < self.flow_control_queue_ttl_s < 600:
            raise ValueError("DYN_EPP_FLOW_CONTROL_QUEUE_TTL_S must be in (0, 600): the shipped Envoy configs "
                             "wait 600 s (message_timeout) for the picker's answer")
        if self.flow_control_max_queued_requests <= 0 or self.queue_depth_threshold < 0:
            raise ValueError("DYN_EPP_FLOW_CONTROL_MAX_QUEUED_REQUESTS must be positive and "
                             "DYN_EPP_QUEUE_DEPTH_THRESHOLD >= 0")
        if not 0 < self.kv_cache_util_threshold <= 1:
            raise ValueError("DYN_EPP_KV_CACHE_UTIL_THRESHOLD must be in (0, 1]")
        if self.max_num_batched_tokens < 0:
            raise ValueError("DYN_EPP_MAX_NUM_BATCHED_TOKENS must be >= 0 (0 = off)")
        if self.flow_control and self.worker_metrics_interval_ms == 0 and self.max_num_batched_tokens == 0:
            raise ValueError("DYN_EPP_FLOW_CONTROL needs a saturation signal: worker metrics "
                             "(DYN_EPP_WORKER_METRICS_INTERVAL_MS > 0) or DYN_EPP_MAX_NUM_BATCHED_TOKENS")
        if self.processes < 1:
            raise ValueError("DYN_EPP_PROCESSES must be >= 1")
        if self.processes > 1 and self.grpc_port == 0:
            raise ValueError("DYN_EPP_PROCESSES > 1 needs a fixed DYN_EPP_GRPC_PORT (the processes share it)")
        if self.peers and self.peer_service:
            raise ValueError("choose one peer source: --peers or --peer-service")
        if self.replica_sync_tls_path:
            from epp_extproc.adapters.replica_sync import SyncTls

            SyncTls.load(self.replica_sync_tls_path, self.replica_sync_server_name)  # named if missing or broken
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
        if self.endpoints:  # a typo must stop start-up with one line, before any port is bound
            from epp_extproc.adapters.discovery_static import EndpointSpecError, parse_flag

            try:
                parse_flag(self.endpoints, kv_event_port=self.kv_event_port,
                           replay_port=self.kv_event_replay_port)
            except EndpointSpecError as e:
                raise ValueError(f"DYN_EPP_ENDPOINTS: {e}") from None

    def body_modes(self) -> tuple[str, ...]:
        return tuple(m.strip().upper() for m in self.allowed_body_modes.split(",") if m.strip())


def show_default(value: Any) -> str:
    """A default as a user would type it (`none`, not `<TokenizerProtocol.NONE: 'none'>`)."""
    if value is None:
        return "unset"
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, str):
        return repr(value) if value == "" else value
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epp-extproc",
        description="KV-cache-aware endpoint picker for Envoy (ext_proc). Every flag can also be set "
                    "through the environment variable shown in brackets.",
        epilog="`epp-extproc envoy-config --help`: print a ready Envoy configuration for this picker.",
    )
    for o in OPTIONS:
        env = f" [env {o.env}]" if o.env else ""
        kw: dict[str, Any] = {"dest": o.dest, "default": None,
                              "help": f"{o.help} (default {show_default(o.default)}){env}"}
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
