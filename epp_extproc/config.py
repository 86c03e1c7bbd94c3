"""Picker configuration: CLI flags, each also readable from an environment variable.

The env names are Dynamo's (`DYN_EPP_*`, `DYN_KV_CACHE_BLOCK_SIZE`, `DYN_ROUTER_*`) wherever Dynamo has one, so
users of the reference EPP can switch without rewriting manifests. A flag on the command line wins over the
environment, which wins over the default. Each option is written once, as a typed field of `Config` with its
env name and help in `opt(...)`; `OPTIONS`, read from those fields, is the table the parser and the README's
flag table are generated from, and what the manifest tests check env names against.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from enum import StrEnum
from typing import Any, NoReturn, get_type_hints
from urllib.parse import urlparse

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


class MediaCredit(StrEnum):
    """How far an image request is credited against the KV index (docs/multimodal.md)."""

    EXACT = "exact"  # image blocks too, keyed by the items' identities and spans from the render
    TEXT_PREFIX = "text-prefix"  # only the text before the first image (the behaviour before image crediting)


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


def opt(env: str | None, default: Any, type: Callable[[str], Any], help: str,
        choices: Sequence[str] | None = None) -> Any:
    """One `Config` field that is also a flag: the typed default, and how the flag and env var read it."""
    return field(default=default, metadata={"option": (env, type, help, choices)})


@dataclass(frozen=True)
class ProcessSlot:
    """Where one picker process sits in a `--processes` group; set by the supervisor (or a test), never by a
    flag, so it is not part of Config."""

    index: int = 0
    sync_listen: tuple[str, ...] = ()  # where its replica-sync service listens (instead of bind:replica-sync-port)
    share_port: bool = False  # SO_REUSEPORT on the ext_proc port: its siblings bind it too
    ingest_dir: str | None = None  # --kv-ingest apart: the supervisor runs the ingest shards there for all


@dataclass
class Config:
    """The picker's settings. Each field is one option: its flag (`--` + the name, `_` -> `-`), env name,
    parser and help live in its `opt(...)`, and `OPTIONS` (the parser's and README's table) is read from
    these fields, so an option is written once."""

    # Serving
    grpc_port: int = opt("DYN_EPP_GRPC_PORT", 9002, int,
        "ext_proc gRPC port (Envoy connects here; TLS unless --secure-serving=false); also serves gRPC "
        "health like the health port")
    health_port: int = opt("DYN_EPP_HEALTH_PORT", 9003, int,
        "gRPC health port (services liveness, readiness, ExternalProcessor, \"\")")
    metrics_port: int = opt("DYN_EPP_METRICS_PORT", 9090, int,
        "HTTP port for /metrics (Prometheus), on --bind")
    bind: str = opt("DYN_EPP_BIND_ADDRESS", "0.0.0.0", str,
        "address the ext_proc, health and metrics ports listen on")
    admin_port: int = opt("DYN_EPP_ADMIN_PORT", 9091, int,
        "HTTP port for the /debug admin API (and /metrics), on --admin-bind; the same address and port "
        "as --bind/--metrics-port = one listener for both")
    admin_bind: str = opt("DYN_EPP_ADMIN_BIND_ADDRESS", "127.0.0.1", str,
        "address the /debug admin API listens on; it has no authentication, so loopback by default "
        "(kubectl port-forward reaches it)")
    log_level: str = opt("DYN_EPP_LOG_LEVEL", "INFO", str, "DEBUG, INFO, WARNING, ERROR")
    log_format: str = opt("DYN_EPP_LOG_FORMAT", "text", str,
        "`text` for people, `json` = one JSON object per line (time, level, logger, message) for log "
        "pipelines", LOG_FORMATS)
    event_loop: str = opt("DYN_EPP_EVENT_LOOP", "auto", str,
        "`uvloop` (libuv) spends less CPU per gRPC message than the standard loop (bench/README.md has the "
        "figures); `auto` = uvloop when it is installed (it is a dependency), else `asyncio`",
        EVENT_LOOPS)
    extproc_transport: str = opt("DYN_EPP_EXTPROC_TRANSPORT", "h2", str,
        "what serves the ext_proc port (ext_proc, gRPC health, the access-log service): `h2` = the picker's "
        "own HTTP/2 gRPC server (the h2grpc package), about a third of grpcio's CPU per message "
        "(bench/README.md); `grpcio` = grpcio's asyncio server", EXTPROC_TRANSPORTS)
    extproc_keepalive_s: float = opt("DYN_EPP_EXTPROC_KEEPALIVE_S", 60.0, float,
        "h2 transport: a peer silent this long on the ext_proc port is sent an HTTP/2 PING, and its "
        "connection is closed when nothing arrives within 20 s more (its streams end as cancelled, their "
        "bookings are freed): a gateway host that died without closing its connections holds nothing for "
        "long. Envoy answers PINGs by itself; 0 = off")
    extproc_max_connections: int = opt("DYN_EPP_EXTPROC_MAX_CONNECTIONS", 4096, int,
        "h2 transport: connections the ext_proc port holds at once; more are closed as they arrive (logged). "
        "Envoy opens one per worker thread, so this is gateway pods x their threads, with room to spare")
    secure_serving: bool = opt("DYN_EPP_SECURE_SERVING", True, _bool,
        "TLS on the ext_proc port, as GAIE's and Dynamo's pickers and their gateway configs expect (health "
        "port and metrics stay plain); `--secure-serving=false` serves plaintext h2c")
    cert_path: str | None = opt("DYN_EPP_CERT_PATH", None, _opt_str,
        "directory with tls.crt and tls.key for secure serving, re-read when they change; unset = a "
        "self-signed certificate minted in memory at start-up")
    graceful_shutdown_grace_period_s: float = opt("DYN_EPP_GRACEFUL_SHUTDOWN_GRACE_PERIOD_S", 5.0, float,
        "on SIGTERM: NOT_SERVING (readiness, ext_proc health) at once, but new ext_proc streams are still "
        "served this long, so the gateway's health checks and Kubernetes' endpoint removal move traffic to "
        "the other replicas before the drain refuses streams (Dynamo's DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS); "
        "SIGINT or a second signal skips it; 0 = drain at once")
    drain_timeout_s: float = opt("DYN_EPP_DRAIN_TIMEOUT_S", 25.0, float,
        "after the grace period: no new ext_proc streams, up to this long for the ones in flight (keep grace "
        "period + this below the pod's terminationGracePeriodSeconds)")
    # Replicas
    processes: int = opt("DYN_EPP_PROCESSES", 1, int,
        "picker processes on this host sharing the ext_proc port (SO_REUSEPORT), synced over Unix "
        "sockets; process 0 serves health and metrics, process i metrics on metrics-port + i")
    peers: str | None = opt("DYN_EPP_PEERS", None, _opt_str,
        "peer replicas' sync addresses, comma separated `host:port` (or `unix:/path`): load and "
        "predictions are shared with them")
    peer_service: str | None = opt("DYN_EPP_PEER_SERVICE", None, _opt_str,
        "Kubernetes: the picker's own Service; its EndpointSlices' `replica-agg` port are the peers")
    pod_ip: str | None = opt("POD_IP", None, _opt_str, "this pod's IP, left out of the peer service's endpoints")
    replica_sync_port: int = opt("DYN_EPP_REPLICA_SYNC_PORT", 9004, int,
        "gRPC port of the replica-sync service (listens only when peers or --processes > 1 are set)")
    replica_sync_tls_path: str | None = opt("DYN_EPP_REPLICA_SYNC_TLS_PATH", None, _opt_str,
        "directory with tls.crt, tls.key and ca.crt (one Secret shared by the replicas): sync over TCP "
        "becomes mutual TLS, each side presenting tls.crt and accepting only certificates ca.crt signed; "
        "re-read when the files change (new connections use the new set); unset = plaintext (keep 9004 behind "
        "the NetworkPolicy); Unix sockets (--processes) stay local")
    replica_sync_server_name: str = opt("DYN_EPP_REPLICA_SYNC_SERVER_NAME", "epp-replica-sync", str,
        "the name a peer's certificate must carry (a DNS subjectAltName): peers are dialled by pod IP")
    peer_timeout_ms: int = opt("DYN_EPP_PEER_TIMEOUT_MS", 2000, int,
        "a peer silent this long (it heartbeats every quarter of it) counts as gone")
    peer_expiry_ms: int = opt("DYN_EPP_PEER_EXPIRY_MS", 5000, int,
        "a gone peer's bookings still count this long (its requests may still run), then are dropped")
    replica_sync_plane: str = opt("DYN_EPP_REPLICA_SYNC_PLANE", "grpc", str,
        "how replicas share bookings and predictions: `grpc` (the mesh: a stream to each of --peers or "
        "--peer-service) or `nats` (one subject per replica on --nats-url, pool --kv-plane-pool; replicas find "
        "each other there, no peer list); see docs/kv-event-plane.md", ("grpc", "nats"))
    replica_sync_linger_ms: float = opt("DYN_EPP_REPLICA_SYNC_LINGER_MS", 0.0, float,
        "hold a replica's changes this long before sending them (both planes): the changes of that time go "
        "in one message, and the peers wake later, after the request's own critical steps; a booking is seen "
        "by the peers this much later (0: each change is sent at once)")
    replica_sync_share_metrics: bool = opt("DYN_EPP_REPLICA_SYNC_SHARE_METRICS", True, _bool,
        "synced replicas split the workers' /metrics scrapes (each worker read by one live replica, chosen by "
        "rendezvous hashing) and send each other the samples with their sync: a worker answers one scrape "
        "per interval instead of one per replica; a worker whose reader goes quiet is read by the others "
        "again after its next read is overdue (counted in epp_worker_metrics_takeovers); false: every "
        "replica reads every worker (as before 2026-12; no effect without replica sync or worker metrics)")
    # Endpoints
    endpoints: str | None = opt("DYN_EPP_ENDPOINTS", None, _opt_str,
        "static endpoints, comma separated `name=ip:port` (or just `ip:port`)")
    endpoints_file: str | None = opt("DYN_EPP_ENDPOINTS_FILE", None, _opt_str,
        "YAML/JSON file with the endpoints; reloaded when it changes")
    max_endpoints: int = opt("DYN_EPP_MAX_ENDPOINTS", 4096, int,
        "the most endpoints --endpoints-file may list; a longer file is refused whole (logged, the previous set "
        "kept). Each endpoint holds a KV-event subscription, about four file descriptors in the process that "
        "ingests (this one, or its shard with --kv-ingest apart): raise `ulimit -n` with it")
    inference_pool_name: str | None = opt("DYN_EPP_INFERENCE_POOL_NAME", None, _opt_str,
        "discover endpoints from this InferencePool (Kubernetes)")
    namespace: str | None = opt("POD_NAMESPACE", None, _opt_str, "namespace of the InferencePool (default: own)")
    kubeconfig: str | None = opt("KUBECONFIG", None, _opt_str,
        "kubeconfig for running outside the cluster (default: in-cluster config)")
    endpoint_probe_interval_ms: int = opt("DYN_EPP_ENDPOINT_PROBE_INTERVAL_MS", 1000, int,
        "GET each endpoint's probe path this often; refused = out of rotation at once (and its KV entries "
        "dropped), other failures after 2 in a row, back after 1 success; 0 = off")
    endpoint_probe_path: str = opt("DYN_EPP_ENDPOINT_PROBE_PATH", "/health", str,
        "HTTP path the endpoint prober GETs (trtllm-serve, vLLM and SGLang answer /health)")
    endpoint_probe_max_rate: float = opt("DYN_EPP_ENDPOINT_PROBE_MAX_RATE", 100.0, float,
        "cap on probes per second over the whole pool (probes spread evenly, 32 at most in flight): a "
        "pool larger than rate x interval is probed less often, e.g. 1,000 endpoints every 10 s")
    kv_event_port: int = opt("DYN_EPP_KV_EVENT_PORT", 5557, int,
        "per-worker ZMQ PUB port for KV events (used when an endpoint names none)")
    kv_event_replay_port: int | None = opt("DYN_EPP_KV_EVENT_REPLAY_PORT", None,
        lambda s: int(s) if s else None, "per-worker ZMQ replay (ROUTER) port; unset = no replay")
    role_label: str = opt("DYN_EPP_ROLE_LABEL", "llm-d.ai/role", str,
        "pod label naming a worker's role in a disaggregated pool (Kubernetes discovery): prefill, decode, "
        "both (llm-d's prefill-decode too); an unlabelled pod serves both")
    kv_event_topic: str = opt("DYN_EPP_KV_EVENT_TOPIC", "", str, "ZMQ topic to subscribe to (prefix match)")
    kv_event_plane: str = opt("DYN_EPP_KV_EVENT_PLANE", "zmq", str,
        "where KV events come from: `zmq` (each worker's own ZeroMQ socket, one per worker) or `nats` (the "
        "`epp-kv-relay`s' NATS subjects, one subscription per pool; a start or restart loads the relays' dumps, "
        "no engine replay needed); see docs/kv-event-plane.md", ("zmq", "nats"))
    nats_url: str = opt("DYN_EPP_NATS_URL", "nats://127.0.0.1:4222", str,
        "with --kv-event-plane nats: the NATS server(s), comma-separated")
    kv_plane_pool: str = opt("DYN_EPP_KV_PLANE_POOL", "default", str,
        "with --kv-event-plane nats: the pool's subject token (the relays of the pool use the same)")
    kv_plane_fallback: str = opt("DYN_EPP_KV_PLANE_FALLBACK", "zmq", str,
        "with --kv-event-plane nats: while NATS or a worker's relay is unreachable, read the worker's own ZeroMQ "
        "events (`zmq`) or drop its entries and route it by load (`load`); counted in "
        "epp_kv_plane_fallbacks_total, undone by the next dump", ("zmq", "load"))
    # Request handling
    max_inflight_requests: int = opt("DYN_EPP_MAX_INFLIGHT_REQUESTS", 1024, int,
        "whole requests (body complete) being decided or served: above this many, 503 \"endpoint picker "
        "overloaded\"")
    max_incomplete_requests: int = opt("DYN_EPP_MAX_INCOMPLETE_REQUESTS", 4096, int,
        "requests whose headers or body are still arriving, counted apart so that stalled clients cannot take "
        "the slots of whole requests: above this many, new streams get 503")
    max_body_bytes: int = opt("DYN_EPP_MAX_BODY_BYTES", 32 * 1024 * 1024, int,
        "request bodies above this size get 413 (in both body modes)")
    max_buffered_body_bytes: int = opt("DYN_EPP_MAX_BUFFERED_BODY_BYTES", 256 * 1024 * 1024, int,
        "all request bodies being buffered at once may hold at most this much, in resident memory, counted "
        "once whether taken by the picker or still arriving in an unfinished message (the h2 transport; "
        "grpcio's buffers its own, see Ports and APIs); a body that would exceed it gets 503 (retryable), "
        "so many slow or unfinished uploads cannot exhaust memory")
    request_body_timeout_ms: int = opt("DYN_EPP_REQUEST_BODY_TIMEOUT_MS", 60_000, int,
        "a request whose headers and body have not fully arrived this long after its ext_proc stream "
        "opened gets 408 and frees its slot (stalled clients cannot hold the picker's capacity)")
    allowed_body_modes: str = opt("DYN_EPP_ALLOWED_BODY_MODES", "FULL_DUPLEX_STREAMED,BUFFERED", str,
        "request body modes the picker accepts from Envoy's protocol_config")
    # Rendering
    tokenizer_protocol: TokenizerProtocol = opt("DYN_EPP_TOKENIZER_PROTOCOL", TokenizerProtocol.NONE, TokenizerProtocol,
        "renderer protocol; `none` routes by load only")
    tokenizer_service_url: str | None = opt("DYN_EPP_TOKENIZER_SERVICE_URL", None, _opt_str,
        "absolute http(s) base URL of the renderer; /v1/chat/completions/render is appended")
    tokenization_timeout_ms: int = opt("DYN_EPP_TOKENIZATION_TIMEOUT_MS", 5000, int,
        "timeout of the whole render call")
    tokenizer_max_response_bytes: int = opt("DYN_EPP_TOKENIZER_MAX_RESPONSE_BYTES", 16 * 1024 * 1024, int,
        "cap on the render answer")
    render_circuit_failures: int = opt("DYN_EPP_RENDER_CIRCUIT_FAILURES", 5, int,
        "this many render failures in a row (timeout, unreachable, 401/403/404/429/5xx, redirect, unusable "
        "answer; not a rejecting 4xx) open the renderer's circuit: requests skip it (circuit_open, handled "
        "by the failure policy) until a probe call succeeds; 0 = never open")
    render_circuit_open_ms: int = opt("DYN_EPP_RENDER_CIRCUIT_OPEN_MS", 5000, int,
        "how long an open circuit skips the renderer before one request probes it; doubles after each "
        "failed probe, up to 60 s")
    render_failure_policy: RenderPolicy = opt("DYN_EPP_RENDER_FAILURE_POLICY", RenderPolicy.LOAD_ONLY, RenderPolicy,
        "renderer down/5xx/timeout: `load-only` routes by load; `fail` answers 503/502/504 like Dynamo")
    render_reject_policy: RenderPolicy = opt("DYN_EPP_RENDER_REJECT_POLICY", RenderPolicy.LOAD_ONLY, RenderPolicy,
        "renderer 4xx: `load-only` routes by load and lets the worker answer; `fail` answers 400")
    cache_salt_policy: SaltPolicy = opt("DYN_EPP_CACHE_SALT_POLICY", SaltPolicy.REJECT, SaltPolicy,
        "trtllm-render + salted request: `reject` = 400 like Dynamo; `load-only` = route by load, forward "
        "the salt as top-level cache_salt")
    prompt_passthrough: PassthroughPolicy = opt("DYN_EPP_PROMPT_PASSTHROUGH", PassthroughPolicy.AUTO, PassthroughPolicy,
        "trtllm-render: `auto` forwards the rendered prompt (chat: top-level prompt_token_ids; completions: "
        "prompt as ids) so the worker skips templating and tokenizing, whenever the worker's render "
        "fingerprint matches and the render says the ids are safe; `off` always forwards the original body")
    media_credit: MediaCredit = opt("DYN_EPP_MEDIA_CREDIT", MediaCredit.EXACT, MediaCredit,
        "image requests: `exact` credits the image blocks too, with the items' identities and placeholder "
        "spans the render reports (vllm-render); `text-prefix` credits only the text before the first image. "
        "Renderers that report no spans (trtllm-render, sglang-renderer) always credit the text prefix")
    trust_media_uuids: bool = opt("DYN_EPP_TRUST_MEDIA_UUIDS", False, _bool,
        "forward a media content part's caller `uuid` as sent: vLLM then keys the item by it, so a client "
        "that reuses another's uuid gets the other's cached item. Off: a caller uuid is namespaced by the "
        "tenant salt, or replaced by the sha256 of a data URI's bytes, or removed (http(s) URLs)")
    render_fingerprint_refresh_ms: int = opt("DYN_EPP_RENDER_FINGERPRINT_REFRESH_MS", 10_000, int,
        "re-read each worker's /server_info render_fingerprint this often (also at admission and when the "
        "prober finds the worker gone)")
    # KV scoring
    config_file: str | None = opt("DYN_EPP_CONFIG_FILE", None, _opt_str,
        "an llm-d EndpointPickerConfig YAML (plugins, schedulingProfiles, featureGates, flowControl, ...): its "
        "scheduling profiles compiled to our plugins, start-up reporting what mapped and what was ignored; see "
        "README \"One config file\"")
    kv_cache_block_size: int = opt("DYN_KV_CACHE_BLOCK_SIZE", 32, int,
        "tokens per KV block, assumed for a worker until its own is known: asked from its /server_info (vLLM: "
        "/metrics), else learned from its events. 32 is TensorRT-LLM's default; vLLM's is 16 on GPU")
    max_index_blocks_per_worker: int = opt("DYN_EPP_MAX_INDEX_BLOCKS_PER_WORKER", 1_000_000, int,
        "cap on indexed blocks per worker (oldest evicted) so missed removals cannot grow memory")
    kv_overlap_score_credit: float = opt("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", 2.0, float,
        "weight of a cached block against a block to prefill (Dynamo's default is 1.0; 2.0 measured "
        "stable at saturation, see bench/README.md)")
    prefill_load_scale: float = opt("DYN_ROUTER_PREFILL_LOAD_SCALE", 8.0, float,
        "weight of prefill load (blocks still to prefill: the queued prompts and this one's uncached part) "
        "against decode load (blocks held by requests in flight): a new request waits behind the prefills "
        "queued ahead of it, while each held block slows a step by a small share; Dynamo's default is 1.0, "
        "8.0 measured better on issue 42's workload suite (bench/README.md, \"The workload suite\")")
    router_temperature: float = opt("DYN_ROUTER_TEMPERATURE", 0.0, float,
        "0 = argmin with random ties; > 0 = softmax sampling over normalised costs (block or time cost alike)")
    cost_model: str = opt("DYN_EPP_COST_MODEL", "blocks", str,
        "`blocks`: the KV-router block cost (load and overlap in blocks); `time`: each worker's predicted TTFT "
        "(+ a TPOT term) learned online from its answers, honouring x-slo-ttft-ms / x-slo-tpot-ms (a sheddable "
        "request no worker is predicted to meet gets 429); see docs/time-cost.md", ("blocks", "time"))
    affinity_load_bound: float | None = opt("DYN_EPP_AFFINITY_LOAD_BOUND", None, lambda s: float(s) if s else None,
        "bounded-load affinity: the longest cached prefix wins among the workers whose load is within "
        "(1 + this) x the pool's average (plus the request's blocks), ties by the block cost (not applied with "
        "--cost-model time: a value set is named in a start-up warning); unset = 0.5, and 2.0 with tier credit "
        "on while any worker holds blocks off the GPU (a prefix kept in host memory is worth holding its worker "
        "further past the average; README 'Tiered KV credit'); 0 = the block cost alone places (the rule before "
        "0.5 became the default); see docs/bounded-affinity.md")
    affinity_rule: str = opt("DYN_EPP_AFFINITY_RULE", "weighed", str,
        "how much affinity a cached prefix buys within the load bound: `weighed` = each fitting worker's cost "
        "is lowered by (1 + bound) x the pool's average held load x the share of the prompt it holds, the least "
        "adjusted cost wins (a small prefix no longer outweighs the queue it joins; issue 42); `longest` = the "
        "longest cached prefix wins, ties by the cost (the rule before issue 42, kept for a release)",
        ("weighed", "longest"))
    prediction_ttl_s: float = opt("DYN_EPP_PREDICTION_TTL_S", 2.0, float,
        "how long a pick counts as cached on its worker before its KV events confirm it (--prediction-lifetime "
        "fixed; also what replica-sync peers are told in either mode)")
    prediction_lifetime: str = opt("DYN_EPP_PREDICTION_LIFETIME", "fixed", str,
        "how long a pick's predicted blocks stay credited unconfirmed: `fixed` = --prediction-ttl-s; `queue` = "
        "while the request waits for its first response chunk on that worker, plus --prediction-grace-s, at "
        "most --prediction-max-lifetime-s (see docs/predictions.md)", ("fixed", "queue"))
    prediction_grace_s: float = opt("DYN_EPP_PREDICTION_GRACE_S", 2.0, float,
        "with --prediction-lifetime queue: how long predicted blocks stay credited after the request's first "
        "response chunk, for the worker's KV event to arrive")
    prediction_max_lifetime_s: float = opt("DYN_EPP_PREDICTION_MAX_LIFETIME_S", 60.0, float,
        "with --prediction-lifetime queue: the longest a prediction lives unconfirmed, so a lost event or a "
        "hung request cannot pin credit")
    eviction_aware: bool = opt("DYN_EPP_EVICTION_AWARE", False, _bool,
        "credit a worker's cached prefix only as far as its cache will likely keep it until the request is "
        "admitted, and price the other prefixes a long new prompt would flush there (from its KV events' "
        "removals, its KV usage gauge and the bookings; in-process KV ingest only); see docs/eviction-aware.md")
    tiered_credit: bool = opt("DYN_EPP_TIERED_CREDIT", False, _bool,
        "credit a worker's cached prefix block by block at the best tier holding each block (GPU, host memory, "
        "disk, shared storage) instead of its GPU blocks alone (the `tiered-credit` plugin; either --kv-ingest; "
        "vLLM needs its offloading connector's self_describing_kv_events); on by itself when a tier "
        "weight is set; see README 'Tiered KV credit'")
    router_host_cache_hit_weight: float | None = opt("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", None,
        lambda s: float(s) if s else None,
        "credit of a block held in host memory against one on the GPU (1.0); unset = 0.8 (llm-d's cpu weight; "
        "Dynamo's default is 0.75); setting it turns --tiered-credit on")
    router_disk_cache_hit_weight: float | None = opt("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", None,
        lambda s: float(s) if s else None,
        "credit of a block held on disk or shared storage; unset = 0.25 (Dynamo's disk weight); setting it "
        "turns --tiered-credit on")
    kv_shared_stores: str | None = opt("DYN_EPP_KV_SHARED_STORES", None, _opt_str,
        "with --tiered-credit: which workers mount the same shared KV store, `store=addr,addr;other=addr`: a "
        "block one of them publishes on the shared tier (SGLang EXTERNAL, llm-d SHARED_STORAGE / OBJECT_STORE) "
        "is credited to all of them at the shared weight, not only to the publisher; with --kv-ingest apart a "
        "store's workers are indexed by one shard")
    kv_storage_block_size: int = opt("DYN_EPP_KV_STORAGE_BLOCK_SIZE", 256, int,
        "tokens per chunk of llm-d's file-system connector (its kv_connector_extra_config `block_size`, 256 by "
        "default): its events name one hash per chunk and do not say the size; a worker's `kv_storage_events` "
        "endpoint (endpoints file; `storage=` in --endpoints; pod annotation `epp-extproc/kv-storage-events`) is "
        "that connector's `storage_events_endpoint`")
    pd_min_uncached_tokens: int = opt("DYN_EPP_PD_MIN_UNCACHED_TOKENS", 16, int,
        "disaggregated pools: a prompt whose uncached suffix on the chosen decode worker is at least this many "
        "tokens is prefilled on a prefill worker (named in x-prefiller-host-port), a shorter one on the decode "
        "worker itself; 0 = never disaggregate (llm-d's prefix-based decider: nonCachedTokens)")
    kv_ingest: str = opt("DYN_EPP_KV_INGEST", "inprocess", str,
        "where KV events are ingested: `inprocess` (this process's event loop, as always) or `apart` (ingest "
        "processes the picker starts and restarts itself, answering lookups over a Unix socket; one per host "
        "serves every --processes child); see docs/ingest-apart.md", ("inprocess", "apart"))
    kv_ingest_shards: int = opt("DYN_EPP_KV_INGEST_SHARDS", 1, int,
        "with --kv-ingest apart: ingest processes, each owning a share of the workers (by address hash; the "
        "workers of one --kv-shared-stores store together)")
    kv_ingest_lookup_timeout_ms: float = opt("DYN_EPP_KV_INGEST_LOOKUP_TIMEOUT_MS", 5.0, float,
        "with --kv-ingest apart: the longest a decision waits for the ingest's answer; late or down = the "
        "request is routed by load (counted in epp_kv_ingest_lookups_total)")
    kv_ingest_worker_cpu_share: float = opt("DYN_EPP_KV_INGEST_WORKER_CPU_SHARE", 0.1, float,
        "the share of one core one worker's events may use, in the picker's own loop (`inprocess`) or in its "
        "ingest shard (`apart`); a publisher above it is read more slowly and loses its own freshness, nobody "
        "else's")
    session_affinity_keys_file: str | None = opt("DYN_EPP_SESSION_AFFINITY_KEYS_FILE", None, _opt_str,
        "turns session affinity on: a file of AES-256 keys (one per line, base64 or hex; the first seals, all "
        "open; a Secret the replicas share, reloaded when it changes). A request carrying x-session-token is "
        "answered with a sealed token naming its worker and sent back there while it is healthy and not "
        "saturated")
    session_affinity_ttl_s: float = opt("DYN_EPP_SESSION_AFFINITY_TTL_S", 3600.0, float,
        "seconds a session token stays valid after it was issued (each answer issues a fresh one)")
    # Worker metrics and flow control
    worker_metrics_interval_ms: int = opt("DYN_EPP_WORKER_METRICS_INTERVAL_MS", 100, int,
        "scrape each worker's Prometheus metrics this often (queue, running, KV utilisation) for "
        "saturation and the load this picker did not book; 0 = off")
    worker_metrics_idle_interval_ms: int = opt("DYN_EPP_WORKER_METRICS_IDLE_INTERVAL_MS", 1000, int,
        "a worker found idle twice in a row (nothing running or waiting, nothing of this picker's) is "
        "scraped at doubling intervals up to this; a booking on it restores the interval at once; at "
        "or below the interval = every worker at the interval")
    worker_metrics_max_rate: float = opt("DYN_EPP_WORKER_METRICS_MAX_RATE", 500.0, float,
        "cap on metric scrapes per second over the whole pool (spread evenly, as the prober's): a pool with "
        "more scrapes due than rate x interval is read less often, e.g. 1,000 idle workers every 2 s")
    worker_metrics_staleness_ms: int = opt("DYN_EPP_WORKER_METRICS_STALENESS_MS", 300, int,
        "a worker's metrics older than this are ignored (it is judged by this picker's bookings only)")
    worker_metrics_path: str = opt("DYN_EPP_WORKER_METRICS_PATH", "/metrics", str,
        "HTTP path of the workers' Prometheus metrics")
    flow_control: bool = opt("DYN_EPP_FLOW_CONTROL", False, _bool,
        "queue requests in the picker while every worker is saturated: priority bands, fairness, TTL")
    flow_control_queue_ttl_s: float = opt("DYN_EPP_FLOW_CONTROL_QUEUE_TTL_S", 30.0, float,
        "longest a request waits in the queue, then 429 (503 when no endpoint exists); keep it below "
        "the gateway's ext_proc message_timeout")
    flow_control_max_queued_requests: int = opt("DYN_EPP_FLOW_CONTROL_MAX_QUEUED_REQUESTS", 512, int,
        "queue bound; when full, a request displaces the newest one of a lower band or gets 429")
    queue_depth_threshold: int = opt("DYN_EPP_QUEUE_DEPTH_THRESHOLD", 5, int,
        "a worker with this many requests waiting in its engine (beyond a full batch) is saturated; 0 = "
        "saturated as soon as its batch is full, so nothing queues where it cannot be reordered")
    kv_cache_util_threshold: float = opt("DYN_EPP_KV_CACHE_UTIL_THRESHOLD", 0.8, float,
        "a worker with this fraction of its KV cache in use is saturated")
    max_num_batched_tokens: int = opt("DYN_EPP_MAX_NUM_BATCHED_TOKENS", 0, int,
        "a worker with this many prompt tokens booked in prefill by this picker is saturated; 0 = off")
    inference_objectives_file: str | None = opt("DYN_EPP_INFERENCE_OBJECTIVES_FILE", None, _opt_str,
        "YAML/JSON objectives (name -> priority, or InferenceObjective manifests), reloaded when it "
        "changes; with --inference-pool-name the InferenceObjective CRDs (llm-d.ai and the deprecated GAIE group) "
        "are read instead")
    model_rewrites_file: str | None = opt("DYN_EPP_MODEL_REWRITES_FILE", None, _opt_str,
        "YAML/JSON InferenceModelRewrite manifests (llm-d.ai or GAIE v1alpha2: rewrite a requested `model` to weighted "
        "targets), reloaded when it changes (a broken edit keeps the rules in service); a request with a "
        "--model-rewrite-session-header header keeps one target; with --inference-pool-name the InferenceModelRewrite CRDs "
        "(both groups) are read instead")
    model_rewrite_session_header: str = opt("DYN_EPP_MODEL_REWRITE_SESSION_HEADER", "x-session-id", str,
        "the request header naming a conversation for model rewrites: requests carrying the same value get the "
        "same target of a weighted split (hashed, never logged); without it each request is drawn at random")

    def __post_init__(self) -> None:
        _coerce_enums(self)

    @property
    def sections(self) -> Sections:
        """This configuration in sections (`config.sections.kv`, ...): what a component is handed instead of the
        whole `Config`. Built on each call, from the values now."""
        return sections_of(self)

    def sync_enabled(self) -> bool:
        return _sync_enabled(self)

    def peer_list(self) -> list[str]:
        return _peer_list(self)

    def validate(self) -> None:
        """Fail at start-up, with a message naming the setting, rather than on the first request. Only the
        values themselves: what reads files or parses with an adapter's grammar (certificates, the endpoints
        spec) is checked by the CLI at start-up (`cli.check_inputs`), so config depends on nothing above it.
        Each message names the flag and its env name (`--flag (ENV)`): the user set one of the two, and
        "not set" rather than `None` when a needed value is missing. Each section's own rules first (`_CHECKS`,
        reading only that section), then the rules across sections."""
        s = self.sections
        for name, check in _CHECKS:
            check(getattr(s, name))
        _check_across(s)

    def tiered_credit_enabled(self) -> bool:
        """`--tiered-credit`, or a tier weight set (Dynamo's way of turning host/disk credit on)."""
        return _tiered_credit_enabled(self)

    def affinity_bounds(self) -> tuple[float, float | None]:
        """`--affinity-load-bound` as set, else 0.5, and the bound while blocks sit off the GPU (2.0 with tier
        credit on and the bound unset; None = the same)."""
        return _affinity_bounds(self)

    def body_modes(self) -> tuple[str, ...]:
        return _body_modes(self)


def _options() -> tuple[Option, ...]:
    out = []
    for f in fields(Config):
        env, parse, help, choices = f.metadata["option"]
        out.append(Option("--" + f.name.replace("_", "-"), env, f.default, parse, help, choices))
    return tuple(out)


OPTIONS: tuple[Option, ...] = _options()  # in field order; --help and the README show them by GROUPS
ENV_NAMES: frozenset[str] = frozenset(o.env for o in OPTIONS if o.env)
_BY_DEST: dict[str, Option] = {o.dest: o for o in OPTIONS}


def setting(dest: str) -> str:
    """How an error names a setting: the flag the user may have typed and the env name they may have set
    (`--endpoints (DYN_EPP_ENDPOINTS)`), so either way they find what to change."""
    o = _BY_DEST[dest]
    return f"{o.flag} ({o.env})" if o.env else o.flag


def _positive(cfg: Any, dest: str) -> None:
    value = getattr(cfg, dest)
    if not value > 0:
        raise ValueError(f"{setting(dest)} must be positive, got {value}")


def _at_least(cfg: Any, dest: str, low: float, note: str) -> None:
    value = getattr(cfg, dest)
    if not value >= low:
        raise ValueError(f"{setting(dest)} must be >= {low}{note}, got {value}")


def show_default(value: Any) -> str:
    """A default as a user would type it (`none`, not `<TokenizerProtocol.NONE: 'none'>`)."""
    if value is None:
        return "unset"
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, str):
        return repr(value) if value == "" else value
    return str(value)


# The configuration's sections: each option sits in exactly one (a unit test checks), listed once here. A
# section is a frozen view of its options (`config.sections.kv`, a `KvSection`) that a component is handed instead
# of the whole `Config`; its help groups are the titles --help and the README's table show, in this order.
SECTIONS: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("serving", (
        ("serving (the ext_proc port Envoy calls)",
         ("grpc_port", "health_port", "bind", "extproc_transport", "event_loop", "extproc_keepalive_s",
          "graceful_shutdown_grace_period_s", "drain_timeout_s")),
        ("limits (what one client can hold)",
         ("max_inflight_requests", "max_incomplete_requests", "max_body_bytes", "max_buffered_body_bytes",
          "request_body_timeout_ms", "allowed_body_modes", "extproc_max_connections")),
        ("TLS (the ext_proc port)",
         ("secure_serving", "cert_path")),
        ("admin and observability",
         ("metrics_port", "admin_port", "admin_bind", "log_level", "log_format")))),
    ("discovery", (
        ("discovery (which workers, and where their KV events are published)",
         ("endpoints", "endpoints_file", "max_endpoints", "inference_pool_name", "namespace", "kubeconfig",
          "endpoint_probe_interval_ms", "endpoint_probe_path", "endpoint_probe_max_rate", "kv_event_port",
          "kv_event_replay_port", "role_label")),)),
    ("renderer", (
        ("renderer (request -> token ids)",
         ("tokenizer_protocol", "tokenizer_service_url", "tokenization_timeout_ms", "tokenizer_max_response_bytes",
          "render_circuit_failures", "render_circuit_open_ms", "render_failure_policy", "render_reject_policy",
          "cache_salt_policy", "prompt_passthrough", "media_credit", "trust_media_uuids",
          "render_fingerprint_refresh_ms")),)),
    ("kv", (
        ("KV index, ingest and predictions (what each worker holds)",
         ("kv_cache_block_size", "max_index_blocks_per_worker", "kv_event_topic", "kv_shared_stores",
          "kv_storage_block_size", "kv_ingest",
          "kv_ingest_shards", "kv_ingest_lookup_timeout_ms", "kv_ingest_worker_cpu_share", "prediction_ttl_s",
          "prediction_lifetime", "prediction_grace_s", "prediction_max_lifetime_s")),
        ("KV event plane (the relays' NATS subjects instead of each worker's socket)",
         ("kv_event_plane", "nats_url", "kv_plane_pool", "kv_plane_fallback")))),
    ("scheduling", (
        ("scheduling (KV overlap against load: cost, picker, tiers, prefill/decode)",
         ("config_file", "kv_overlap_score_credit", "prefill_load_scale", "router_temperature", "cost_model",
          "affinity_load_bound", "affinity_rule", "eviction_aware", "tiered_credit", "router_host_cache_hit_weight",
          "router_disk_cache_hit_weight", "pd_min_uncached_tokens")),
        ("session affinity (a conversation sent back to its worker)",
         ("session_affinity_keys_file", "session_affinity_ttl_s")))),
    ("rewrites", (
        ("model rewrites (weighted splits of a requested model)",
         ("model_rewrites_file", "model_rewrite_session_header")),)),
    ("worker_metrics", (
        ("worker metrics (each worker's queue and KV use, scraped)",
         ("worker_metrics_interval_ms", "worker_metrics_idle_interval_ms", "worker_metrics_max_rate",
          "worker_metrics_staleness_ms", "worker_metrics_path")),)),
    ("flow_control", (
        ("flow control (queue while every worker is saturated)",
         ("flow_control", "flow_control_queue_ttl_s", "flow_control_max_queued_requests", "queue_depth_threshold",
          "kv_cache_util_threshold", "max_num_batched_tokens", "inference_objectives_file")),)),
    ("replicas", (
        ("replicas (several pickers sharing load)",
         ("processes", "peers", "peer_service", "replica_sync_plane", "pod_ip", "replica_sync_port",
          "peer_timeout_ms", "peer_expiry_ms", "replica_sync_linger_ms", "replica_sync_share_metrics",
          "replica_sync_tls_path",
          "replica_sync_server_name")),)),
)

# --help's groups, in order: the sections' help groups.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(g for _, groups in SECTIONS for g in groups)


def _coerce_enums(obj: Any) -> None:
    """Accept plain strings from code and tests; store the enum (`Config`'s and every section's rule)."""
    for f in fields(obj):
        o = _BY_DEST.get(f.name)
        if o is not None and isinstance(o.type, type) and issubclass(o.type, StrEnum):
            try:
                object.__setattr__(obj, f.name, o.type(getattr(obj, f.name)))
            except ValueError:
                raise ValueError(f"{setting(f.name)} must be one of {', '.join(o.choices or ())}; "
                                 f"got {getattr(obj, f.name)!r}") from None


# What a section can answer about its own values (`Config` answers the same, for the callers that hold it).
def _sync_enabled(r: Any) -> bool:
    return bool(r.peers or r.peer_service)


def _peer_list(r: Any) -> list[str]:
    return [p.strip() for p in (r.peers or "").split(",") if p.strip()]


def _tiered_credit_enabled(s: Any) -> bool:
    """`--tiered-credit`, or a tier weight set (Dynamo's way of turning host/disk credit on)."""
    return bool(s.tiered_credit or s.router_host_cache_hit_weight is not None
                or s.router_disk_cache_hit_weight is not None)


# --affinity-load-bound when unset: 0.5 was swept on GPU-only pools (docs/bounded-affinity.md). With tier credit
# and blocks off the GPU, a prefix the GPU evicted is still loadable from host memory at a fraction of its
# prefill, so holding requests on its worker further past the average keeps more of that reuse
# (bench/README.md "Tiered KV credit", stop 60); a GPU-only pool keeps 0.5 with the flag on or off.
AFFINITY_LOAD_BOUND = 0.5
AFFINITY_LOAD_BOUND_TIERED = 2.0


def _affinity_bounds(s: Any) -> tuple[float, float | None]:
    """(the load bound, the bound while any worker holds blocks off the GPU or None for the same): a bound
    set is used as set; unset, 0.5, and 2.0 off the GPU when tier credit is on."""
    if s.affinity_load_bound is not None:
        return float(s.affinity_load_bound), None
    return AFFINITY_LOAD_BOUND, AFFINITY_LOAD_BOUND_TIERED if _tiered_credit_enabled(s) else None


def _body_modes(s: Any) -> tuple[str, ...]:
    return tuple(m.strip().upper() for m in s.allowed_body_modes.split(",") if m.strip())


_SECTION_METHODS: dict[str, dict[str, Callable[..., Any]]] = {
    "serving": {"body_modes": _body_modes},
    "scheduling": {"tiered_credit_enabled": _tiered_credit_enabled, "affinity_bounds": _affinity_bounds},
    "replicas": {"sync_enabled": _sync_enabled, "peer_list": _peer_list},
}


def _section_base(name: str) -> Any:
    """The frozen dataclass of section `name`'s options (from `SECTIONS`), each typed and defaulted as its
    `Config` field, so a component or a test can build one alone: `KvSection(kv_ingest="apart")`."""
    by_name = {f.name: f for f in fields(Config)}
    dests = [d for _, ds in dict(SECTIONS)[name] for d in ds]
    cls = make_dataclass(f"_{name}_fields", [(d, by_name[d].type, field(default=by_name[d].default)) for d in dests],
                         frozen=True, namespace={"__post_init__": _coerce_enums,
                                                 **_SECTION_METHODS.get(name, {})})
    cls.__module__ = __name__
    return cls


class ServingSection(_section_base("serving")):  # type: ignore[misc]
    """The ext_proc, health, metrics and admin listeners, their limits and TLS."""


class DiscoverySection(_section_base("discovery")):  # type: ignore[misc]
    """Which workers there are, how they are probed, and where their KV events are published."""


class RendererSection(_section_base("renderer")):  # type: ignore[misc]
    """Request -> token ids: the renderer, its circuit, and what a failure does."""


class KvSection(_section_base("kv")):  # type: ignore[misc]
    """The KV index (what each worker holds), where events are ingested, predictions, the event plane."""


class SchedulingSection(_section_base("scheduling")):  # type: ignore[misc]
    """How a worker is chosen: the cost, the picker, tiers, prefill/decode, session affinity."""


class RewritesSection(_section_base("rewrites")):  # type: ignore[misc]
    """Weighted splits of a requested model."""


class WorkerMetricsSection(_section_base("worker_metrics")):  # type: ignore[misc]
    """The workers' own Prometheus metrics: saturation, and the load this picker did not book."""


class FlowControlSection(_section_base("flow_control")):  # type: ignore[misc]
    """Queueing in the picker while every worker is saturated."""


class ReplicasSection(_section_base("replicas")):  # type: ignore[misc]
    """Several pickers sharing load: processes on a host, peers, and their sync."""


@dataclass(frozen=True)
class Sections:
    """Every section of one `Config`, by name (`config.sections.kv`); the names are `SECTIONS`' (a unit test
    checks)."""

    serving: ServingSection
    discovery: DiscoverySection
    renderer: RendererSection
    kv: KvSection
    scheduling: SchedulingSection
    rewrites: RewritesSection
    worker_metrics: WorkerMetricsSection
    flow_control: FlowControlSection
    replicas: ReplicasSection


SECTION_CLASSES: dict[str, type] = get_type_hints(Sections)  # name -> its class, in SECTIONS' order


def sections_of(config: Config) -> Sections:
    """The `Sections` of `config`: frozen copies of its values now (a later change to `config` is not seen)."""
    return Sections(**{name: cls(**{f.name: getattr(config, f.name) for f in fields(cls)})
                       for name, cls in SECTION_CLASSES.items()})


# Each section's rules, reading that section only; a message names the flag and its env (`setting`).
def _check_renderer(r: Any) -> None:
    n = setting
    if r.tokenizer_protocol is not TokenizerProtocol.NONE:
        need = (f"{n('tokenizer_protocol')} {r.tokenizer_protocol.value} needs the renderer's absolute "
                "http(s) base URL, e.g. http://127.0.0.1:8000 (or --tokenizer-protocol none: route by load)")
        if not r.tokenizer_service_url:
            raise ValueError(f"{n('tokenizer_service_url')} is not set: {need}")
        url = urlparse(r.tokenizer_service_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"{n('tokenizer_service_url')} must be an absolute http(s) URL, got "
                             f"{r.tokenizer_service_url!r}: {need}")
    _at_least(r, "render_circuit_failures", 0, " (0 = never open)")
    _positive(r, "render_circuit_open_ms")
    _positive(r, "render_fingerprint_refresh_ms")


def _check_serving(s: Any) -> None:
    n = setting
    if s.cert_path is not None:
        if not s.secure_serving:
            raise ValueError(f"{n('cert_path')} is set but secure serving is off (--secure-serving=false or "
                             "DYN_EPP_SECURE_SERVING is off): the ext_proc port "
                             "would serve plain h2c; enable secure serving or drop the cert path")
    if s.admin_port == s.metrics_port != 0 and s.admin_bind != s.bind:
        raise ValueError(f"{n('admin_port')} equals {n('metrics_port')} ({s.admin_port}) on a different "
                         f"address: set {n('admin_bind')} to the --bind address ({s.bind}) to serve "
                         "/debug on the metrics listener, or choose another admin port")
    listeners = ["grpc_port", "health_port", "metrics_port"]
    if (s.admin_bind, s.admin_port) != (s.bind, s.metrics_port):  # else one listener, on purpose
        listeners.append("admin_port")
    seen: dict[int, str] = {}
    for dest in listeners:
        port = getattr(s, dest)
        if port and port in seen:  # two servers on one port: connections would land on either
            raise ValueError(f"{n(seen[port])} and {n(dest)} are both {port}: each listener needs its own "
                             "port")
        seen.setdefault(port, dest)
    _positive(s, "extproc_max_connections")
    _at_least(s, "extproc_keepalive_s", 0, " (0 = off)")
    _positive(s, "max_inflight_requests")
    _positive(s, "max_incomplete_requests")
    _positive(s, "max_body_bytes")
    if s.max_buffered_body_bytes < s.max_body_bytes:
        raise ValueError(f"{n('max_buffered_body_bytes')} must be at least {n('max_body_bytes')} "
                         f"({s.max_body_bytes}): one largest body must fit; got {s.max_buffered_body_bytes}")
    _positive(s, "request_body_timeout_ms")
    _at_least(s, "drain_timeout_s", 0, "")
    _at_least(s, "graceful_shutdown_grace_period_s", 0, "")
    modes = _body_modes(s)
    bad = [m for m in modes if m not in BODY_MODES]
    if bad or not modes:
        what = f"unknown mode(s) {', '.join(bad)}" if bad else "no mode given"
        raise ValueError(f"{n('allowed_body_modes')}: {what}; choose from {', '.join(BODY_MODES)}")


def _check_kv(k: Any) -> None:
    n = setting
    _positive(k, "kv_cache_block_size")
    _positive(k, "kv_storage_block_size")
    _positive(k, "kv_ingest_shards")
    _positive(k, "kv_ingest_lookup_timeout_ms")
    _positive(k, "kv_ingest_worker_cpu_share")
    if k.kv_shared_stores:
        from kvindex.tiers import parse_shared_stores

        try:
            parse_shared_stores(k.kv_shared_stores)
        except ValueError as e:
            raise ValueError(f"{n('kv_shared_stores')}: {e}") from None
    _at_least(k, "prediction_grace_s", 0, "")
    _positive(k, "prediction_max_lifetime_s")
    if k.kv_event_plane == "nats" and k.kv_ingest != "inprocess":
        raise ValueError(f"{n('kv_event_plane')} nats feeds the in-process index: it needs {n('kv_ingest')} "
                         "inprocess")
    if k.prediction_lifetime == "queue" and k.kv_ingest == "apart":
        raise ValueError(f"{n('prediction_lifetime')} queue needs the in-process index ({n('kv_ingest')} "
                         "inprocess): the ingest processes take a fixed ttl per prediction")


def _check_discovery(d: Any) -> None:
    n = setting
    _at_least(d, "endpoint_probe_interval_ms", 0, " (0 = off)")
    _positive(d, "endpoint_probe_max_rate")
    _positive(d, "max_endpoints")
    if not d.role_label or len(d.role_label) > 317:  # a Kubernetes label key: prefix/name
        raise ValueError(f"{n('role_label')} must be a label key, got {d.role_label!r}")
    sources = [x for x in ("endpoints", "endpoints_file", "inference_pool_name") if getattr(d, x)]
    if len(sources) > 1:
        raise ValueError("choose one endpoint source, not " + " and ".join(n(x) for x in sources))


def _check_scheduling(s: Any) -> None:
    n = setting
    _at_least(s, "router_temperature", 0, "")
    _at_least(s, "pd_min_uncached_tokens", 0, " (0 = never disaggregate)")
    _positive(s, "session_affinity_ttl_s")
    if s.eviction_aware and s.cost_model == "time":
        raise ValueError(f"{n('eviction_aware')} prices flushed prefixes in KV blocks and {n('cost_model')} "
                         "time prices in seconds: the two cannot be added; use one of them")
    for dest in ("router_host_cache_hit_weight", "router_disk_cache_hit_weight"):
        if getattr(s, dest) is not None:
            _at_least(s, dest, 0, "")
    if _tiered_credit_enabled(s) and s.cost_model == "time":
        raise ValueError(f"{n('tiered_credit')} adds to the credited overlap, which {n('cost_model')} time "
                         "does not read: use the block cost with tier weights")
    if s.affinity_load_bound is not None:
        _at_least(s, "affinity_load_bound", 0, " (0 = off)")


def _check_worker_metrics(w: Any) -> None:
    _at_least(w, "worker_metrics_interval_ms", 0, " (0 = off)")
    _at_least(w, "worker_metrics_idle_interval_ms", 0, "")
    _positive(w, "worker_metrics_max_rate")
    _positive(w, "worker_metrics_staleness_ms")


def _check_flow_control(f: Any) -> None:
    n = setting
    if not 0 < f.flow_control_queue_ttl_s < 600:
        raise ValueError(f"{n('flow_control_queue_ttl_s')} must be in (0, 600), got "
                         f"{f.flow_control_queue_ttl_s}: the shipped Envoy configs wait 600 s "
                         "(message_timeout) for the picker's answer")
    _positive(f, "flow_control_max_queued_requests")
    _at_least(f, "queue_depth_threshold", 0, "")
    if not 0 < f.kv_cache_util_threshold <= 1:
        raise ValueError(f"{n('kv_cache_util_threshold')} must be in (0, 1], got {f.kv_cache_util_threshold}")
    _at_least(f, "max_num_batched_tokens", 0, " (0 = off)")


def _check_replicas(r: Any) -> None:
    n = setting
    _at_least(r, "processes", 1, "")
    if r.replica_sync_plane == "nats" and (r.processes > 1 or _sync_enabled(r)):
        raise ValueError(f"{n('replica_sync_plane')} nats finds its peers on NATS: it takes neither "
                         f"{n('peers')}/{n('peer_service')} nor {n('processes')} > 1")
    if r.peers and r.peer_service:
        raise ValueError(f"choose one peer source: {n('peers')} or {n('peer_service')}, not both")
    if r.processes > 1 and (r.peers or r.peer_service):
        raise ValueError(f"{n('processes')} > 1 cannot be combined with {n('peers')} or "
                         f"{n('peer_service')} yet")
    _positive(r, "peer_timeout_ms")
    _at_least(r, "peer_expiry_ms", 0, "")
    _at_least(r, "replica_sync_linger_ms", 0, " (0 = off)")
    if r.replica_sync_linger_ms >= r.peer_timeout_ms / 4:  # a held change must not outlast the heartbeat
        raise ValueError(f"{n('replica_sync_linger_ms')} must be under a quarter of {n('peer_timeout_ms')} "
                         f"(the heartbeat), got {r.replica_sync_linger_ms} >= {r.peer_timeout_ms / 4}")


_CHECKS: tuple[tuple[str, Callable[[Any], None]], ...] = (
    ("renderer", _check_renderer), ("serving", _check_serving), ("kv", _check_kv), ("discovery", _check_discovery),
    ("scheduling", _check_scheduling), ("worker_metrics", _check_worker_metrics),
    ("flow_control", _check_flow_control), ("replicas", _check_replicas))


def _check_across(s: Any) -> None:
    """The rules between two sections: each names both settings."""
    n = setting
    f, w, k, sched = s.flow_control, s.worker_metrics, s.kv, s.scheduling
    if f.flow_control and w.worker_metrics_interval_ms == 0 and f.max_num_batched_tokens == 0:
        raise ValueError(f"{n('flow_control')} needs a saturation signal: worker metrics "
                         f"({n('worker_metrics_interval_ms')} > 0) or {n('max_num_batched_tokens')} > 0")
    if sched.eviction_aware and k.kv_ingest != "inprocess":
        raise ValueError(f"{n('eviction_aware')} reads the in-process KV index's removals: it needs "
                         f"{n('kv_ingest')} inprocess")
    if s.replicas.processes > 1 and s.serving.grpc_port == 0:
        raise ValueError(f"{n('processes')} > 1 needs a fixed {n('grpc_port')} (the processes share it); "
                         "got port 0")


EPILOG = """\
a picker for two local mock workers, rendering with the first one's render endpoint:
  trtllm-mock --port 8001 --enable-render-endpoints --kv-events-endpoint tcp://127.0.0.1:5557 &
  trtllm-mock --port 8002 --enable-render-endpoints --kv-events-endpoint tcp://127.0.0.1:5558 &
  epp-extproc --endpoints 'w0=127.0.0.1:8001;kv=tcp://127.0.0.1:5557,w1=127.0.0.1:8002;kv=tcp://127.0.0.1:5558' \\
      --tokenizer-protocol trtllm-render --tokenizer-service-url http://127.0.0.1:8001

then an Envoy in front of it (OpenAI requests on :8080):
  epp-extproc envoy-config --listen-port 8080 > envoy.yaml && envoy -c envoy.yaml
  (`epp-extproc envoy-config --help` lists its options)"""


def grouped_options() -> list[tuple[str, list[Option]]]:
    """OPTIONS by --help section; one missing from GROUPS still reaches the parser (under "other") rather
    than silently not existing, and a unit test fails until it is placed."""
    out = [(title, [_BY_DEST[d] for d in dests]) for title, dests in GROUPS]
    placed = {d for _, dests in GROUPS for d in dests}
    rest = [o for o in OPTIONS if o.dest not in placed]
    return out + [("other", rest)] if rest else out


def version() -> str:
    """The installed distribution's version (what `pip show epp-extproc` says)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("epp-extproc")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """A bad flag value is one line naming the flag (argparse's default prints the whole usage first: with
    this many options, the error scrolls out of sight)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="epp-extproc",
        usage="%(prog)s [options]  |  %(prog)s envoy-config [options]",
        description="KV-cache-aware endpoint picker for Envoy (ext_proc). Every flag can also be set\n"
                    "through the environment variable shown in brackets; a flag wins over its variable.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    for title, options in grouped_options():
        g = p.add_argument_group(title)
        for o in options:
            env = f" [env {o.env}]" if o.env else ""
            kw: dict[str, Any] = {"dest": o.dest, "default": None,
                                  "help": f"{o.help} (default {show_default(o.default)}){env}"}
            if o.choices:
                kw["choices"] = list(o.choices)
            kw["type"] = o.type
            if o.type is _bool:  # `--secure-serving` alone means true; `--secure-serving=false` also works
                kw.update(nargs="?", const=True)
            g.add_argument(o.flag, **kw)
    return p


def _parse_env(o: Option, raw: str) -> Any:
    """One env value, read with its flag's parser; a bad one is one line naming the variable and its flag."""
    if o.choices and raw not in o.choices:
        raise SystemExit(f"epp-extproc: {o.env} ({o.flag}) must be one of {', '.join(o.choices)}; got {raw!r}")
    try:
        return o.type(raw)
    except ValueError as e:
        expected = {int: "an integer", float: "a number"}.get(o.type)  # type: ignore[call-overload]
        why = f"expected {expected}" if expected else str(e)
        raise SystemExit(f"epp-extproc: {o.env} ({o.flag}): {why}, got {raw!r}") from None


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    args = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    for o in OPTIONS:
        v = getattr(args, o.dest)
        if v is None and o.env and env.get(o.env) is not None:
            v = _parse_env(o, env[o.env])
        if v is None:
            v = o.default
        values[o.dest] = v
    cfg = Config(**values)
    try:
        cfg.validate()
    except ValueError as e:
        raise SystemExit(f"epp-extproc: {e}") from None
    return cfg
