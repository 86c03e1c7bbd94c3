"""The one mapping from what went wrong (a `PickError` fact) to what the client sees.

Statuses follow the references (GAIE/llm-d and Dynamo's `PickError`): 400 for a request the picker cannot
route, 413 too large, 415 encoded body, 503 no endpoint / overloaded / busy, 408 body too slow, and the render
failures under the `fail` policy: renderer 4xx -> 400, unreachable / 429 / 503 / circuit open -> 503, timeout -> 504,
anything else -> 502. On the OpenAI routes the body is OpenAI's error JSON, which SDKs show to their users;
elsewhere it is one line of text.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.render import RenderError, RenderFailure

_STATUS: dict[Problem, int] = {
    Problem.BAD_REQUEST: 400,
    Problem.BODY_TOO_LARGE: 413,
    Problem.BODY_BUDGET: 503,
    Problem.BODY_TIMEOUT: 408,
    Problem.UNSUPPORTED_ENCODING: 415,
    Problem.SALT_REJECTED: 400,
    Problem.NO_ENDPOINT: 503,
    Problem.OVERLOADED: 503,
    Problem.FLOW_SATURATED: 429,  # GAIE: capacity exists but is contended (back-pressure)
    Problem.FLOW_TTL_EXPIRED: 429,
    Problem.SLO_UNMET: 429,  # llm-d's latency-slo-admitter rejects a sheddable request no endpoint can serve
    Problem.FLOW_SHUTDOWN: 503,
    Problem.RENDER_FAILED: 502,  # only without the renderer's failure attached: `render_status` decides else
    Problem.PROTOCOL: 400,
    Problem.UNSUPPORTED_MODE: 500,
    Problem.INTERNAL: 500,
}

# OpenAI's error `type` by status class: what the official SDKs and their users expect to read.
_OPENAI_TYPE = {400: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error"}


def render_status(e: RenderError) -> int:
    """Dynamo's mapping of a render failure to the client status."""
    if e.failure is RenderFailure.TIMEOUT:
        return 504
    if e.failure in (RenderFailure.UNAVAILABLE, RenderFailure.CIRCUIT_OPEN):  # not called: unavailable
        return 503
    if e.failure is RenderFailure.UPSTREAM_STATUS and e.status is not None:
        if e.status in (400, 422) or e.rejected:
            return 400
        if e.status in (429, 503):
            return 503
    return 502


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    message: str
    code: str  # machine-readable reason: the metric label and OpenAI's `error.code`
    openai: bool  # answer OpenAI-shaped JSON (the request was on an OpenAI route)
    headers: tuple[tuple[str, str], ...] = ()  # extra response headers the core asked for

    @property
    def content_type(self) -> bytes:
        return b"application/json" if self.openai else b"text/plain; charset=utf-8"

    def body(self) -> bytes:
        if not self.openai:
            return (self.message + "\n").encode()
        kind = _OPENAI_TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return orjson.dumps({"error": {"message": self.message, "type": kind, "param": None, "code": self.code}})


def is_openai_route(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1"


def http_error(err: PickError, path: str) -> HttpError:
    if err.render is not None:
        status, code = render_status(err.render), f"render_{err.render.label}"
    else:
        status, code = _STATUS[err.problem], err.problem.value
    return HttpError(status, err.detail, code, is_openai_route(path), err.headers)
