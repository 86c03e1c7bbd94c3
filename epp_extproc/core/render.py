"""What the core needs from a renderer, and what a render failure is (a fact, mapped to a status at the edge).

The adapter (`adapters/render_client.py`) speaks HTTP; the core sees only `Renderer.render()` and
`RenderError`, so a test can hand the pipeline any renderer without a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from epp_extproc.core.contract import MediaItem


class RenderFailure(StrEnum):
    TIMEOUT = "timeout"  # no complete answer within the timeout
    UNAVAILABLE = "unavailable"  # cannot connect
    UPSTREAM_STATUS = "upstream_status"  # the renderer answered a non-200 status (see `status`)
    INVALID_ANSWER = "invalid_answer"  # 200, but not a usable answer (not JSON, no ids, too large)
    CIRCUIT_OPEN = "circuit_open"  # not called: it failed repeatedly, the circuit breaker skips it for a while


@dataclass(slots=True)
class RenderError(Exception):
    failure: RenderFailure
    detail: str
    status: int | None = None  # the renderer's HTTP status, for UPSTREAM_STATUS

    @property
    def rejected(self) -> bool:
        """The renderer refused this request (its 4xx, e.g. multimodal content): the request's fault, not the
        renderer's; governed by the reject policy. 401/403/404 are a misconfigured renderer, 429 is load."""
        s = self.status
        return (self.failure is RenderFailure.UPSTREAM_STATUS and s is not None and 400 <= s < 500
                and s not in (401, 403, 404, 429))

    @property
    def label(self) -> str:
        """Metric label: `rejected`, `unavailable` (incl. 429/503), `timeout`, `circuit_open`, `bad_gateway`."""
        if self.failure is RenderFailure.UPSTREAM_STATUS:
            if self.rejected:
                return "rejected"
            return "unavailable" if self.status in (429, 503) else "bad_gateway"
        return {RenderFailure.TIMEOUT: "timeout", RenderFailure.UNAVAILABLE: "unavailable",
                RenderFailure.CIRCUIT_OPEN: "circuit_open"}.get(self.failure, "bad_gateway")

    def __str__(self) -> str:
        return f"render {self.label}: {self.detail}"


@dataclass(slots=True)
class Rendered:
    """What a render answer says about the prompt, beyond the ids the picker routes on.

    The extra fields decide whether the forwarded request may carry the ids (prompt passthrough, see
    core/passthrough.py). Missing fields take the value that forbids forwarding ids: a renderer that does not
    say its ids are trusted (vLLM, SGLang, older builds) or that has no render context is never trusted.
    """

    token_ids: list[int]  # the prompt to route on (completions: the first prompt)
    fingerprint: dict[str, Any] | None = None
    tokens_trusted: bool = False
    resolved_thinking: bool | None = None
    prompt_tokens_excluded_from_usage: int = 0
    has_context: bool = False  # the answer carried a `context` object
    prompts: list[list[int]] | None = None  # completions: every prompt's ids; None if one is unusable
    # vLLM render answers' `features` (core/media.spans_from_features): (modality, item) per multimodal item,
    # sorted by offset; None when the answer carried none. `media_invalid` says why they were not believed.
    media: tuple[tuple[str, MediaItem], ...] | None = None
    media_invalid: str | None = None


class Renderer(Protocol):
    protocol: str

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        """The rendered prompt; `count=False` keeps a debug call out of the traffic metrics."""
        ...


def render_kind(path: str) -> str | None:
    """Which render route a request path needs; None for paths that are not rendered."""
    p = path.split("?", 1)[0].rstrip("/")
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/completions"):
        return "completion"
    return None
