"""Session affinity tokens: a client that opts in is told, in a token only the picker can read, which worker
served it, and its later requests carrying that token go back there while that worker can take them.

llm-d's session-affinity filter names its pod in plain base64 in `x-session-token`, so a client can read a pool
address from it and forge one naming any pod (its security discussion, llm-d #1656). Here the token is sealed
with AES-256-GCM under a key the replicas share: a client can neither read it nor make one, and a token that
fails to open (tampered, cut, another deployment's key) is just a request without affinity, counted.

The sealed plaintext is ``version | expiry (u32 unix seconds) | address (utf-8)``; the token is
``key id (4 bytes) | nonce (12) | ciphertext+tag``, base64url without padding. The key id (the first bytes of
the key's SHA-256) picks the key to open with, so keys rotate without a flag day: seal with the first key, open
with any listed one. Tokens are bounded (`MAX_TOKEN_CHARS`) before any decoding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
import time
from collections.abc import Callable, Sequence
from enum import StrEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SESSION_HEADER = "x-session-token"  # llm-d's session-affinity header: the request's token, the answer's new one
KEY_BYTES = 32
_VERSION = 1
_KEY_ID = 4
_NONCE = 12
_TAG = 16
_AAD = b"epp-extproc session-affinity v1"
MAX_ADDRESS_BYTES = 255  # `ip:port`, or a DNS name and port: far below
MAX_TOKEN_CHARS = 4 * ((_KEY_ID + _NONCE + 1 + 4 + MAX_ADDRESS_BYTES + _TAG + 2) // 3)


class SessionOutcome(StrEnum):
    """What a request's token came to (the metric's label): only `honoured` keeps the worker."""

    NEW = "new"  # opted in without a token (or with a placeholder): picked as usual, a token is issued
    HONOURED = "honoured"  # back to the token's worker
    UNAVAILABLE = "unavailable"  # its worker is unhealthy, saturated, outside the subset or gone: re-picked
    EXPIRED = "expired"
    TAMPERED = "tampered"  # does not open: altered, cut, or sealed with a key this picker does not hold
    OVERSIZED = "oversized"


class SessionKeyError(ValueError):
    """A key list the picker cannot use; the message names what is wrong (never the key)."""


def parse_keys(text: str) -> list[bytes]:
    """One key per line (blank lines and `#` comments ignored), each 32 bytes in base64 (standard or url-safe)
    or 64 hex digits; the first seals, all open."""
    keys: list[bytes] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key = _decode_key(line)
        if key is None:
            raise SessionKeyError(f"line {n}: not a {KEY_BYTES}-byte key in base64 or hex "
                                  f"(make one with: head -c {KEY_BYTES} /dev/urandom | base64)")
        keys.append(key)
    if not keys:
        raise SessionKeyError("no key in it")
    if len({_key_id(k) for k in keys}) != len(keys):
        raise SessionKeyError("the same key is listed twice")
    return keys


def _decode_key(text: str) -> bytes | None:
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_" if ("-" in text or "_" in text)
                               else None, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key if len(key) == KEY_BYTES else None


def _key_id(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:_KEY_ID]


class SessionTokens:
    """Seals and opens tokens under a rotatable key list; `clock` is injectable so expiry is testable."""

    def __init__(self, keys: Sequence[bytes], ttl_s: float, *, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.set_keys(keys)

    def set_keys(self, keys: Sequence[bytes]) -> None:
        """Replace the key list at once (a reload): the first key seals from now on."""
        if not keys:
            raise SessionKeyError("no key")
        self._seal_id = _key_id(keys[0])
        self._by_id = {_key_id(k): AESGCM(k) for k in keys}

    def seal(self, address: str) -> str:
        raw = address.encode()
        if len(raw) > MAX_ADDRESS_BYTES:
            raise ValueError("address too long for a session token")
        plain = struct.pack(">BI", _VERSION, int(self.clock() + self.ttl_s) & 0xFFFFFFFF) + raw
        nonce = os.urandom(_NONCE)
        sealed = self._by_id[self._seal_id].encrypt(nonce, plain, _AAD)
        return base64.urlsafe_b64encode(self._seal_id + nonce + sealed).rstrip(b"=").decode()

    def open(self, token: str) -> tuple[SessionOutcome, str | None]:
        """(outcome, the worker's address when it opened and has not expired)."""
        token = token.strip()
        if not token or token.lower() in ("new", "1", "true"):
            return SessionOutcome.NEW, None
        if len(token) > MAX_TOKEN_CHARS:
            return SessionOutcome.OVERSIZED, None
        try:
            blob = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            return SessionOutcome.TAMPERED, None
        aead = self._by_id.get(blob[:_KEY_ID])
        if aead is None or len(blob) < _KEY_ID + _NONCE + _TAG + 5:
            return SessionOutcome.TAMPERED, None
        try:
            plain = aead.decrypt(blob[_KEY_ID:_KEY_ID + _NONCE], blob[_KEY_ID + _NONCE:], _AAD)
        except InvalidTag:
            return SessionOutcome.TAMPERED, None
        version, expiry = struct.unpack_from(">BI", plain)
        if version != _VERSION:
            return SessionOutcome.TAMPERED, None
        if expiry <= self.clock():
            return SessionOutcome.EXPIRED, None
        try:
            return SessionOutcome.HONOURED, plain[5:].decode()
        except UnicodeDecodeError:
            return SessionOutcome.TAMPERED, None
