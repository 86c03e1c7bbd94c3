"""The documented module `epp_extproc.envoy.h2server` keeps working for a release: it re-exports the server
(logging under its old name) and the TLS context, now in `epp_extproc.envoy.tls`."""

from __future__ import annotations

import logging
import ssl

import h2grpc
from epp_extproc.envoy import h2server, tls


def test_the_old_module_re_exports_the_server_and_logs_under_its_old_name() -> None:
    server = h2server.H2GrpcServer(max_concurrent_rpcs=1)
    assert isinstance(server, h2grpc.H2GrpcServer)
    assert server.log is logging.getLogger("epp_extproc.envoy.h2server")


def test_the_old_module_re_exports_the_tls_context_with_alpn_h2() -> None:
    cert = tls.self_signed()
    assert h2server.server_ssl_context is tls.server_ssl_context
    ctx = h2server.server_ssl_context(cert.cert_pem, cert.key_pem)
    assert isinstance(ctx, ssl.SSLContext) and ctx.minimum_version == ssl.TLSVersion.TLSv1_2


def test_the_package_imports_nothing_from_the_application() -> None:
    import pathlib

    for path in pathlib.Path(h2grpc.__file__).parent.glob("*.py"):
        assert "epp_extproc" not in path.read_text(), path


def test_the_reloading_context_hands_new_handshakes_the_pair_in_service_now() -> None:
    """`tls.reloading_ssl_context` (issue 25 item 3): its SNI callback swaps in a context built once per pair."""
    pairs = [tls.self_signed()]
    base = tls.reloading_ssl_context(lambda: pairs[-1])
    assert base.sni_callback is not None

    class Handshake:
        context = base

    first = Handshake()
    base.sni_callback(first, None, base)  # type: ignore[arg-type]
    assert first.context is base  # the pair it was built with: no swap
    pairs.append(tls.self_signed())
    second, third = Handshake(), Handshake()
    base.sni_callback(second, None, base)  # type: ignore[arg-type]
    base.sni_callback(third, None, base)  # type: ignore[arg-type]
    assert second.context is not base and third.context is second.context  # one new context per new pair
    assert second.context.sni_callback is base.sni_callback
