"""Why the picker answers a request itself instead of routing it: facts, not statuses.

The core raises `PickError(problem, detail)` saying what happened; the edge (`envoy/errors.py`) is the one
place that turns a problem into an HTTP status, a body shape and a metric label. That keeps the reference
status mapping (Dynamo's `PickError`) in one table and lets the core be tested without any protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from epp_extproc.core.render import RenderError


class Problem(StrEnum):
    BAD_REQUEST = "bad_request"  # not a JSON object, malformed, not UTF-8
    BODY_TOO_LARGE = "body_too_large"  # one body above --max-body-bytes
    BODY_BUDGET = "body_budget"  # all bodies being buffered together above --max-buffered-body-bytes
    BODY_TIMEOUT = "body_timeout"  # the request body did not complete within --request-body-timeout-ms
    UNSUPPORTED_ENCODING = "unsupported_encoding"  # Content-Encoding the picker cannot read
    SALT_REJECTED = "cache_salt_rejected"  # salted request, TensorRT-LLM workers, reject policy
    NO_ENDPOINT = "no_endpoint"  # nothing discovered / healthy
    OVERLOADED = "overloaded"  # above --max-inflight-requests
    FLOW_SATURATED = "flow_saturated"  # flow control: sheddable while saturated, or the queue full (429)
    FLOW_TTL_EXPIRED = "flow_ttl_expired"  # flow control: waited past --flow-control-queue-ttl-s (429)
    SLO_UNMET = "slo_unmet"  # --cost-model time: no worker predicted to meet a sheddable request's SLO (429)
    FLOW_SHUTDOWN = "flow_shutting_down"  # flow control: the picker stopped while the request was queued
    RENDER_FAILED = "render_failed"  # the renderer failed and the policy says fail (see `render`)
    UNSUPPORTED_MODE = "unsupported_mode"  # Envoy announced a body mode this picker does not serve
    PROTOCOL = "protocol_error"  # the gateway broke the ext_proc contract (e.g. two requests on a stream)
    INTERNAL = "internal_error"  # a bug: never expected


@dataclass(slots=True)
class PickError(Exception):
    problem: Problem
    detail: str
    render: RenderError | None = None  # the renderer's failure, for RENDER_FAILED
    headers: tuple[tuple[str, str], ...] = ()  # extra response headers (flow control says why it dropped)

    def __str__(self) -> str:
        return f"{self.problem.value}: {self.detail}"
