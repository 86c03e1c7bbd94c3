"""TLS for the ext_proc port ("secure serving", on by default as in GAIE's EPP and Dynamo's).

With `--cert-path DIR` the server key pair is read from DIR/tls.crt and DIR/tls.key (the layout of a
Kubernetes `kubernetes.io/tls` Secret mounted as a volume) and re-read when either file changes (a renewed
Secret: kubelet swaps the `..data` symlink, which changes the inode we stat). New connections get the new pair;
established ones keep theirs. A pair that does not load (half-written, key not matching the certificate) is
logged and the previous one stays in service.

Without it a self-signed certificate (P-256, CN=epp-extproc, SAN localhost/127.0.0.1/::1) is minted in memory
with `cryptography` at start-up: the private key never touches the disk. Only the certificate is written to a
private temporary directory (removed again by `close()`), so a client that wants to verify the picker can be
given it as its trusted CA; a gateway that does not verify (the usual GAIE setup) simply gets encryption.
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import hashlib
import ipaddress
import logging
import shutil
import ssl
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from epp_extproc.file_watch import FileWatch, file_stamp
from epp_extproc.tls_files import check_pair

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerCert:
    cert_pem: bytes
    key_pem: bytes
    cert_file: Path | None  # where the certificate can be read, e.g. as a client's CA (None: not written)
    self_signed: bool

    def fingerprint(self) -> str:
        der = ssl.PEM_cert_to_DER_cert(self.cert_pem.decode())
        return hashlib.sha256(der).hexdigest()


def cert_files(cert_path: str) -> tuple[Path, Path]:
    """(certificate, key) inside a --cert-path directory; raises ValueError when either is missing."""
    d = Path(cert_path)
    if not d.is_dir():
        raise ValueError(f"DYN_EPP_CERT_PATH={cert_path!r} is not a directory (it must hold {CERT_FILE} and "
                         f"{KEY_FILE})")
    crt, key = d / CERT_FILE, d / KEY_FILE
    missing = [p.name for p in (crt, key) if not p.is_file()]
    if missing:
        raise ValueError(f"DYN_EPP_CERT_PATH={cert_path!r} lacks {', '.join(missing)}")
    return crt, key


def load(cert_path: str) -> ServerCert:
    """Read and check a provided pair: PEM, and the key is the certificate's (else ValueError)."""
    crt, key = cert_files(cert_path)
    cert_pem, key_pem = crt.read_bytes(), key.read_bytes()
    try:
        check_pair(cert_pem, key_pem)
    except ValueError as e:
        raise ValueError(f"DYN_EPP_CERT_PATH={cert_path!r}: {e}") from None
    return ServerCert(cert_pem, key_pem, crt, self_signed=False)


def self_signed(common_name: str = "epp-extproc", cert_dir: Path | None = None) -> ServerCert:
    """Mint a P-256 certificate valid for a year; only the certificate is written (into `cert_dir`, if any)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                       x509.IPAddress(ipaddress.ip_address("::1"))])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    crt: Path | None = None
    if cert_dir is not None:
        crt = cert_dir / CERT_FILE
        crt.write_bytes(cert_pem)
    return ServerCert(cert_pem, key_pem, crt, self_signed=True)


class CertSource:
    """The certificate the ext_proc port serves, as gRPC server credentials that follow file changes.

    gRPC calls `_fetch` on each new TLS handshake (from one of its own threads); it only hands over a pair
    the poller (`run`, on the event loop, file reads in a worker thread) has already loaded and checked, so a
    handshake never does I/O.
    """

    def __init__(self, cert_path: str | None, *, poll_interval_s: float = 1.0) -> None:
        self.cert_path = cert_path
        self.poll_interval_s = poll_interval_s
        self._tmpdir: Path | None = None
        self._watch: FileWatch[ServerCert] | None = None
        if cert_path:
            paths = cert_files(cert_path)
            stamp = file_stamp(paths)
            self.current = load(cert_path)
            self._watch = FileWatch(paths, lambda: load(cert_path), self._put_in_service, on_error=self._refused,
                                    interval_s=poll_interval_s, retry_failed=True, stamp=stamp)
        else:
            try:
                self._tmpdir = Path(tempfile.mkdtemp(prefix="epp-tls-"))
                atexit.register(self.close)  # also when the owner never calls close() (crash, no stop)
            except OSError as e:  # e.g. a read-only root filesystem without a /tmp volume: serve anyway
                log.warning("cannot write the self-signed certificate to a temporary folder (%s); serving "
                            "it without a copy on disk", e)
            self.current = self_signed(cert_dir=self._tmpdir)
        self.reloads = 0
        self._pending: ServerCert | None = None
        self._lock = threading.Lock()

    def ssl_context(self) -> ssl.SSLContext:
        """For the h2 transport: a server context that hands each new handshake the pair in service now
        (its SNI callback, which OpenSSL calls on every ClientHello, swaps in the context of a reloaded pair)."""
        return reloading_ssl_context(lambda: self.current)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config(self.current), self._fetch,
                                                   require_client_authentication=False)

    @staticmethod
    def _config(c: ServerCert) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(c.key_pem, c.cert_pem)])

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return None if pending is None else self._config(pending)

    async def check_once(self) -> bool:
        """Reload when the files changed; True when a new pair was put in service."""
        return False if self._watch is None else await self._watch.check()

    def _refused(self, e: Exception) -> None:
        # the version is read again at the next poll (retry_failed): a half-written Secret completes
        log.warning("TLS certificate in %s changed but does not load (%s); keeping the previous one",
                    self.cert_path, e)

    def _put_in_service(self, new: ServerCert) -> bool:
        if new.cert_pem == self.current.cert_pem and new.key_pem == self.current.key_pem:
            return False
        with self._lock:
            self._pending = new
        self.current = new
        self.reloads += 1
        log.info("TLS certificate reloaded from %s (sha256 %s); new connections use it", self.cert_path,
                 new.fingerprint())
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.check_once()

    def close(self) -> None:
        """Remove the temporary directory of a self-signed certificate."""
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
            atexit.unregister(self.close)


# --- the h2 transport's server context (issue 25 item 3: moved here from envoy/h2server.py) ---------------

def server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """An h2 server context (TLS 1.2+, ALPN h2) from PEM in memory: the key goes through an anonymous memfd,
    never a file."""
    import os

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    fds = []
    try:
        for name, pem in (("crt", cert_pem), ("key", key_pem)):
            fd = os.memfd_create(f"epp-tls-{name}", os.MFD_CLOEXEC)
            fds.append(fd)
            os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)
    return ctx


def reloading_ssl_context(current: Any) -> ssl.SSLContext:
    """A server context that hands each new handshake the pair `current()` returns now: its SNI callback, which
    OpenSSL calls on every ClientHello, swaps in the context of a reloaded pair (built once per pair)."""
    first = current()
    base = server_ssl_context(first.cert_pem, first.key_pem)
    state: list[Any] = [first, base]  # the pair last built, and its context

    def pick(sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        cur = current()
        if state[0] is not cur:
            state[:] = [cur, server_ssl_context(cur.cert_pem, cur.key_pem)]
            state[1].sni_callback = pick
        if state[1] is not ctx:
            sslobj.context = state[1]

    base.sni_callback = pick
    return base
