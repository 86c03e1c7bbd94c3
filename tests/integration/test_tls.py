"""TLS on the ext_proc port ("secure serving", the default), exercised by a real Envoy speaking TLS to it.

Envoy's `picker` cluster gets an UpstreamTlsContext (epp_extproc.dev.envoy_config `picker_tls`, with
`picker_tls_ca` as the trusted CA), so a 200 through the gateway proves the handshake, the certificate check
and gRPC over TLS; Envoy's own cluster stats confirm the handshake happened. Certificate reloads and the
health service on the ext_proc port are checked with a plain gRPC client (what Envoy's health checker is).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_extproc.app import PickerApp
from epp_extproc.cli import load
from epp_extproc.config import Config, load_config
from epp_extproc.dev import envoy_config
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess

pytestmark = pytest.mark.transport  # also run on --extproc-transport grpcio by `make test`

BODY = b'{"model":"m","messages":[{"role":"user","content":"over tls"}]}'


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    crt, key = d / f"{name}.crt", d / f"{name}.key"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days",
            "2", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(crt))
    return crt, key


def make_server_cert(d: Path, ca: tuple[Path, Path]) -> Path:
    """d/tls.crt + d/tls.key, signed by `ca`, valid for 127.0.0.1: the layout of a kubernetes.io/tls Secret."""
    d.mkdir(exist_ok=True)
    key, csr, crt, ext = d / "tls.key", d / "tls.csr", d / "tls.crt", d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj",
            "/CN=epp-extproc", "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
            "-days", "2", "-extfile", str(ext), "-out", str(crt))
    return d


class TlsGateway:
    def __init__(self, picker: dict[str, object]) -> None:
        self.bg = BackgroundLoop()
        self.up = EchoUpstream("a")
        self.bg.run(self.up.start())
        cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                     endpoints=f"a={self.up.address}", endpoint_probe_interval_ms=0, **picker)  # type: ignore
        cfg.validate()
        self.app = PickerApp(cfg)
        self.bg.run(self.app.start())
        self.envoy: EnvoyProcess | None = None

    def start_envoy(self, tls: bool, ca: Path | None) -> EnvoyProcess:
        if self.envoy is not None:
            self.envoy.stop()
        self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self.app.grpc_port, picker_tls=tls,
                                                            picker_tls_ca=str(ca) if ca else None)).start()
        return self.envoy

    def post(self) -> int:
        assert self.envoy is not None
        return request(self.envoy.url, body=BODY).status

    def routed(self) -> int:
        return len(self.up.seen)

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        self.bg.run(self.app.stop())
        self.bg.run(self.up.stop())
        self.bg.close()


@pytest.fixture(scope="module")
def self_signed() -> Iterator[TlsGateway]:
    g = TlsGateway({"secure_serving": True})
    yield g
    g.close()


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("ca")
    return {"good": make_ca(d, "good-ca"), "other": make_ca(d, "other-ca")}


@pytest.fixture(scope="module")
def provided(tmp_path_factory: pytest.TempPathFactory, cas: dict[str, tuple[Path, Path]]) -> Iterator[TlsGateway]:
    certs = make_server_cert(tmp_path_factory.mktemp("certs") / "epp", cas["good"])
    g = TlsGateway({"secure_serving": True, "cert_path": str(certs)})
    yield g
    g.close()


def test_self_signed_certificate_is_minted_when_no_cert_path_is_given(self_signed: TlsGateway) -> None:
    tls = self_signed.app.tls
    assert tls is not None and tls.self_signed
    assert tls.cert_file is not None and tls.cert_file.read_bytes() == tls.cert_pem
    assert b"BEGIN CERTIFICATE" in tls.cert_pem and len(tls.fingerprint()) == 64


def test_envoy_trusting_the_self_signed_certificate_routes_through_the_tls_picker(
        self_signed: TlsGateway) -> None:
    assert self_signed.app.tls is not None
    envoy = self_signed.start_envoy(tls=True, ca=self_signed.app.tls.cert_file)
    before = self_signed.routed()
    assert self_signed.post() == 200
    assert self_signed.routed() == before + 1
    assert envoy.stats().get("cluster.picker.ssl.handshake", 0) >= 1


def test_envoy_without_verification_still_gets_an_encrypted_channel(self_signed: TlsGateway) -> None:
    envoy = self_signed.start_envoy(tls=True, ca=None)  # the usual GAIE setup: TLS, no picker verification
    assert self_signed.post() == 200
    assert envoy.stats().get("cluster.picker.ssl.handshake", 0) >= 1


def test_plaintext_envoy_gets_500_from_a_tls_picker_and_nothing_is_routed(self_signed: TlsGateway) -> None:
    self_signed.start_envoy(tls=False, ca=None)
    before = self_signed.routed()
    assert self_signed.post() == 500  # FailClose: a picker Envoy cannot talk to routes nothing
    assert self_signed.routed() == before


def test_provided_certificate_is_served_and_verified_against_its_ca(
        provided: TlsGateway, cas: dict[str, tuple[Path, Path]]) -> None:
    tls = provided.app.tls
    assert tls is not None and not tls.self_signed and tls.cert_file.name == "tls.crt"
    envoy = provided.start_envoy(tls=True, ca=cas["good"][0])
    assert provided.post() == 200
    assert envoy.stats().get("cluster.picker.ssl.handshake", 0) >= 1


def test_envoy_trusting_another_ca_refuses_the_picker_and_routes_nothing(
        provided: TlsGateway, cas: dict[str, tuple[Path, Path]]) -> None:
    envoy = provided.start_envoy(tls=True, ca=cas["other"][0])
    before = provided.routed()
    assert provided.post() == 500
    assert provided.routed() == before
    assert envoy.stats().get("cluster.picker.ssl.fail_verify_error", 0) >= 1


def test_envoy_with_the_generated_default_config_routes_through_the_default_picker(
        self_signed: TlsGateway) -> None:
    """Both defaults together: picker TLS on, generator TLS on without verification (GAIE's setup)."""
    if self_signed.envoy is not None:
        self_signed.envoy.stop()
    self_signed.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self_signed.app.grpc_port)).start()
    assert self_signed.post() == 200
    assert self_signed.envoy.stats().get("cluster.picker.ssl.handshake", 0) >= 1


def _health(port: int, ca: bytes, service: str = "envoy.service.ext_proc.v3.ExternalProcessor") -> int:
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                   timeout=5).status


def test_ext_proc_port_answers_grpc_health_for_the_ext_proc_service(self_signed: TlsGateway) -> None:
    """GAIE's Envoy health-checks `envoy.service.ext_proc.v3.ExternalProcessor` on the ext_proc port."""
    tls = self_signed.app.tls
    assert tls is not None
    assert _health(self_signed.app.grpc_port, tls.cert_pem) == health_pb2.HealthCheckResponse.SERVING
    assert _health(self_signed.app.grpc_port, tls.cert_pem, "readiness") == health_pb2.HealthCheckResponse.SERVING


def test_self_signed_private_key_is_never_written_and_the_cert_folder_goes_at_stop() -> None:
    g = TlsGateway({})
    tls = g.app.tls
    assert tls is not None and tls.self_signed
    folder = tls.cert_file.parent
    assert [p.name for p in folder.iterdir()] == ["tls.crt"]  # the key stays in memory
    g.close()
    assert not folder.exists()


def test_provided_certificate_is_reloaded_when_its_files_change(
        tmp_path: Path, cas: dict[str, tuple[Path, Path]]) -> None:
    certs = make_server_cert(tmp_path / "epp", cas["good"])
    g = TlsGateway({"cert_path": str(certs)})
    try:
        good, other = cas["good"][0].read_bytes(), cas["other"][0].read_bytes()
        assert _health(g.app.grpc_port, good) == health_pb2.HealthCheckResponse.SERVING
        fresh = make_server_cert(tmp_path / "renewed", cas["other"])
        for name in ("tls.key", "tls.crt"):  # a renewed Secret: new files under the same names
            shutil.copy(fresh / name, certs / f".{name}.new")
            (certs / f".{name}.new").rename(certs / name)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert _health(g.app.grpc_port, other) == health_pb2.HealthCheckResponse.SERVING
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with pytest.raises(grpc.RpcError):  # new connections no longer get the old certificate
            _health(g.app.grpc_port, good)
    finally:
        g.close()


def test_a_broken_replacement_keeps_the_previous_certificate(
        tmp_path: Path, cas: dict[str, tuple[Path, Path]]) -> None:
    certs = make_server_cert(tmp_path / "epp", cas["good"])
    g = TlsGateway({"cert_path": str(certs)})
    try:
        (certs / "tls.key").write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
        assert g.bg.run(g.app.cert_source.check_once()) is False  # type: ignore[union-attr]
        assert _health(g.app.grpc_port, cas["good"][0].read_bytes()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        g.close()


# ------------------------------------------------------------------------------------------ configuration
def test_secure_serving_is_on_by_default() -> None:
    assert load_config([], env={}).secure_serving is True
    assert Config().secure_serving is True


@pytest.mark.parametrize(("argv", "env"), [(["--secure-serving=false"], {}), (["--secure-serving", "false"], {}),
                                           ([], {"DYN_EPP_SECURE_SERVING": "false"})])
def test_secure_serving_is_disabled_by_flag_or_env(argv: list[str], env: dict[str, str]) -> None:
    assert load_config(argv, env=env).secure_serving is False


def test_plaintext_picker_serves_h2c_to_a_plaintext_envoy() -> None:
    g = TlsGateway({"secure_serving": False})
    try:
        assert g.app.tls is None
        g.start_envoy(tls=False, ca=None)
        assert g.post() == 200
    finally:
        g.close()


def test_cert_path_without_secure_serving_is_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="DYN_EPP_SECURE_SERVING is off"):
        load_config(["--secure-serving=false", "--cert-path", str(tmp_path)], env={})


def test_cert_path_missing_the_key_is_refused_at_start_up(tmp_path: Path) -> None:
    (tmp_path / "tls.crt").write_text("x")
    with pytest.raises(SystemExit, match="lacks tls.key"):
        load(["--cert-path", str(tmp_path)], env={})


def test_a_failed_start_leaves_no_certificate_folder(tmp_path: Path) -> None:
    """The ext_proc port is taken: start fails, and the self-signed certificate's folder is removed."""
    import asyncio
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        app = PickerApp(Config(grpc_port=s.getsockname()[1], health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                               endpoint_probe_interval_ms=0))

        async def go() -> None:
            with pytest.raises(RuntimeError):
                await app.start()

        asyncio.run(go())
    assert app.cert_source is not None
    assert app.cert_source.current.cert_file is not None and not app.cert_source.current.cert_file.parent.exists()


def test_the_certificate_folder_is_removed_at_exit_even_without_stop(tmp_path: Path) -> None:
    """A process that never stops its picker (a crash path, a script) still leaves no folder behind."""
    script = ("from epp_extproc.envoy.tls import CertSource\n"
              "c = CertSource(None)\n"
              "print(c.current.cert_file.parent)\n")
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    folder = Path(out.stdout.strip())
    assert folder.name.startswith("epp-tls-") and not folder.exists()
