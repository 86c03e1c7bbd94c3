"""Moved: the ext_proc port's HTTP/2 gRPC server is the package `h2grpc` (its README.md says what it offers
servicers and every bound it holds a peer to); its TLS context is `epp_extproc.envoy.tls.server_ssl_context`.
This module re-exports them for one release, so imports of the documented module keep working."""

from __future__ import annotations

import logging

from epp_extproc.envoy.tls import server_ssl_context
from h2grpc import H2GrpcServer as _H2GrpcServer
from h2grpc import Limits
from h2grpc.codec import (  # noqa: F401 - re-exported for one release
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
)
from h2grpc.limits import DEFAULT

log = logging.getLogger(__name__)

STREAM_WINDOW = DEFAULT.stream_window
MAX_HEADER_LIST_BYTES = DEFAULT.max_header_list_bytes
MAX_HEADER_FRAMES = DEFAULT.max_header_frames


class H2GrpcServer(_H2GrpcServer):
    """`h2grpc.H2GrpcServer` logging to this module's logger unless given another (the picker's log names)."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: object) -> None:
        super().__init__(logger=logger or log, **kwargs)  # type: ignore[arg-type]


__all__ = ["H2GrpcServer", "Limits", "server_ssl_context"]
