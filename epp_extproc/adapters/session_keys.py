"""The session-affinity key file: read at start-up (a bad one stops it, naming the flag) and followed while
running, so a rotated Secret (new key first, the old one kept below it until the tokens it sealed expire)
goes into service without a restart and without turning every live session into a re-pick."""

from __future__ import annotations

import logging

from epp_extproc.core.session import SessionKeyError, SessionTokens, parse_keys
from epp_extproc.file_watch import FileWatch

log = logging.getLogger(__name__)


def read_keys_file(path: str) -> list[bytes]:
    """The keys in `path`; ValueError naming what is wrong (never a key's bytes)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text: one base64 or hex key per line") from None
    try:
        return parse_keys(text)
    except SessionKeyError as e:
        raise ValueError(f"{path}: {e}") from None


class SessionKeysFile:
    """Follows the key file for a `SessionTokens`; a version that does not load keeps the keys in service."""

    def __init__(self, tokens: SessionTokens, path: str, interval_s: float = 2.0) -> None:
        self.tokens = tokens
        self.path = path
        self._watch: FileWatch[list[bytes]] = FileWatch(
            [path], lambda: read_keys_file(path), self._apply, on_error=self._refused, interval_s=interval_s)

    def _apply(self, keys: list[bytes]) -> None:
        self.tokens.set_keys(keys)
        log.info("session affinity: %d key(s) in service from %s", len(keys), self.path)

    def _refused(self, e: Exception) -> None:
        log.error("session affinity keys not reloaded (the previous ones stay in service): %s", e)

    def load_once(self) -> None:
        self._watch.check_sync()

    async def run(self) -> None:
        await self._watch.run()
