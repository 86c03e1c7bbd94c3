"""What the picker's two TLS users (the ext_proc port, replica sync) share about key pairs read from files:
how a change of the files is noticed, and what makes a pair usable. No gRPC, no event loop."""

from __future__ import annotations

import os
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

Stamp = tuple[tuple[float, int, int], ...]


def file_stamp(paths: Iterable[str | os.PathLike[str]]) -> Stamp | None:
    """(mtime, size, inode) of each file: a renewed Kubernetes Secret swaps its `..data` link, which changes
    the inode even when the size and second do not. None while any file is missing (mid-swap)."""
    try:
        return tuple((st.st_mtime, st.st_size, st.st_ino) for st in (os.stat(p) for p in paths))
    except OSError:
        return None


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
