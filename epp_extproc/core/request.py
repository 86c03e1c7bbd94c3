"""The picker's plain-Python view of one HTTP request, built at the protobuf edge."""

from __future__ import annotations

from dataclasses import dataclass, field

DEST_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"


@dataclass(slots=True)
class RequestContext:
    method: str = ""
    path: str = ""
    headers: dict[str, list[str]] = field(default_factory=dict)  # lower-case names, in arrival order
    body: bytes | None = None
    subset: list[str] | None = None  # the gateway's subset hint, None = no hint

    def header(self, name: str) -> str | None:
        """Last value of a header (what a proxy that overwrites would keep)."""
        values = self.headers.get(name)
        return values[-1] if values else None

    def spoofed_headers(self) -> list[str]:
        """Client-sent headers in the picker's namespace: always stripped before routing."""
        return [h for h in self.headers if h.startswith(DEST_HEADER)]


@dataclass(slots=True)
class Rejection(Exception):
    """An answer the picker gives itself instead of routing (ImmediateResponse)."""

    status: int
    message: str
    outcome: str  # metric label

    def __str__(self) -> str:
        return f"{self.status} {self.message}"
