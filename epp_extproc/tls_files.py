"""What the picker's two TLS users (the ext_proc port, replica sync) share about key pairs read from files:
what makes a pair usable (how a change of the files is noticed: `file_watch`, re-exported here). No gRPC,
no event loop."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from epp_extproc.file_watch import Stamp, file_stamp

__all__ = ["Stamp", "check_pair", "file_stamp"]


def check_pair(cert_pem: bytes, key_pem: bytes) -> None:
    """ValueError naming the fault: PEM that does not load, or a tls.key that is not tls.crt's key."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        private = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"tls.crt/tls.key do not load as PEM: {e}") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*spki) != private.public_key().public_bytes(*spki):
        raise ValueError("tls.key is not the key of tls.crt")
