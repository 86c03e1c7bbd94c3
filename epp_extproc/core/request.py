"""The picker's plain-Python view of one HTTP request, built at the protobuf edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from epp_extproc.core.time_cost import Slo
from epp_extproc.gaie import DEST_HEADER, PREFILLER_HEADER

LOG_CLIP = 200  # characters of a client-controlled value (path, header) that a log line may carry


def clip(value: str, limit: int = LOG_CLIP) -> str:
    """A client-controlled string cut for logging: a 30 MB `:path` must not become a 30 MB log line."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}...(+{len(value) - limit} chars)"


@dataclass(slots=True)
class RequestContext:
    method: str = ""
    path: str = ""
    headers: dict[str, list[str]] = field(default_factory=dict)  # lower-case names, in arrival order
    body: bytes | None = None
    subset: list[str] | None = None  # the gateway's subset hint, None = no hint
    slo: Slo | None = None  # x-slo-ttft-ms / x-slo-tpot-ms, parsed at the edge (core/time_cost.parse_slo)
    slo_malformed: tuple[str, ...] = ()  # SLO headers whose value was not a number (ignored, counted)

    def spoofed_headers(self) -> list[str]:
        """Client-sent headers in the picker's namespace: always stripped before routing. That includes the
        prefill worker's header: a client naming its own prefiller would steer the decode-side sidecar."""
        return [h for h in self.headers if h.startswith(DEST_HEADER) or h == PREFILLER_HEADER]
