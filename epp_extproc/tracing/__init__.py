"""Tracing: OpenTelemetry spans for the request path, off unless the standard `OTEL_*` variables ask for it.

Why a package of its own: when tracing is off, nothing of the OpenTelemetry SDK is imported and no span object
is made on any request (the request path holds `None` where a tracer would be, and checks it once). Only
`from_env` is light; everything that touches the SDK lives in `spans.py` and is imported when tracing is on.

Tracing is on when an OTLP endpoint is configured (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The
protocol is `http/protobuf` unless `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` (spans.py `_exporter`); the
exporters read the rest themselves (headers, timeout, TLS, compression); the picker reads the sampler
(`OTEL_TRACES_SAMPLER`, default `parentbased_always_on`: the gateway decides, see the README's "Tracing")
and the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`; the service defaults to `epp-extproc`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from epp_extproc.tracing.spans import Tracing

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def enabled_by(environ: Mapping[str, str]) -> bool:
    """Whether these variables turn tracing on (an endpoint is set and nothing turns the SDK off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() in ("none", ""):
        return False
    return any(environ.get(v, "").strip() for v in ENDPOINT_VARS)


def from_env(environ: Mapping[str, str], registry: CollectorRegistry | None = None) -> Tracing | None:
    """The picker's tracing as the environment configures it; None (and no SDK import) when it is off."""
    if not enabled_by(environ):
        return None
    from epp_extproc.dev.otel_protos import REPAIR, installed_version, intact

    if not intact():  # xds-protos' older copy of the OTLP protos won the install: the exporters cannot load
        logging.getLogger(__name__).error(
            "tracing is configured but stays off: opentelemetry.proto is xds-protos' older copy (both packages "
            "ship it); repair with: %s", REPAIR.format(version=installed_version() or "<version>"))
        return None
    from epp_extproc.tracing.spans import Tracing

    return Tracing.from_env(environ, registry)


__all__ = ["ENDPOINT_VARS", "enabled_by", "from_env"]
