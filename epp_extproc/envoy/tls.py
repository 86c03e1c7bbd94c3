"""TLS for the ext_proc port ("secure serving", as the Gateway API Inference Extension's EPP offers it).

With `--cert-path DIR` the server key pair is read from DIR/tls.crt and DIR/tls.key (the layout of a
Kubernetes `kubernetes.io/tls` Secret mounted as a volume). Without it a self-signed certificate (P-256,
CN=epp-extproc, SAN localhost/127.0.0.1/::1) is minted at start-up with the `openssl` command-line tool and
written to a private temporary directory, so a gateway that does not verify the picker (the usual GAIE
setup) gets encryption, and one that does can be given that file as its trusted CA.
"""

from __future__ import annotations

import hashlib
import shutil
import ssl
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"


@dataclass(frozen=True)
class ServerCert:
    cert_pem: bytes
    key_pem: bytes
    cert_file: Path  # where the certificate can be read (the self-signed one too), e.g. as a client's CA
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
    crt, key = cert_files(cert_path)
    cert_pem, key_pem = crt.read_bytes(), key.read_bytes()
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem or b"PRIVATE KEY-----" not in key_pem:
        raise ValueError(f"DYN_EPP_CERT_PATH={cert_path!r}: {CERT_FILE}/{KEY_FILE} are not PEM")
    return ServerCert(cert_pem, key_pem, crt, self_signed=False)


def self_signed(common_name: str = "epp-extproc") -> ServerCert:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("secure serving without DYN_EPP_CERT_PATH needs the `openssl` tool to mint a "
                           "self-signed certificate; install it or provide tls.crt/tls.key")
    d = Path(tempfile.mkdtemp(prefix="epp-tls-"))
    crt, key = d / CERT_FILE, d / KEY_FILE
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "365", "-subj", f"/CN={common_name}",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True, timeout=30)
    key.chmod(0o600)
    return ServerCert(crt.read_bytes(), key.read_bytes(), crt, self_signed=True)


def server_cert(cert_path: str | None) -> ServerCert:
    return load(cert_path) if cert_path else self_signed()
