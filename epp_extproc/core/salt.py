"""Which cache salt (KV-cache tenant namespace) a request asks for, in the reference's order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TENANT_HEADER = "x-tenant-id"


def resolve_salt(headers: Mapping[str, list[str]], body: Mapping[str, Any] | None) -> str | None:
    """Last non-empty trimmed `x-tenant-id` > non-empty `nvext.cache_salt` > non-empty top-level `cache_salt`."""
    for value in reversed(headers.get(TENANT_HEADER, [])):
        if value.strip():
            return value.strip()
    if body is None:
        return None
    nvext = body.get("nvext")
    if isinstance(nvext, dict):
        s = nvext.get("cache_salt")
        if isinstance(s, str) and s.strip():
            return s.strip()
    s = body.get("cache_salt")
    if isinstance(s, str) and s.strip():
        return s.strip()
    return None
