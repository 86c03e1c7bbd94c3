"""From a buffered request to a routing decision: parse, (render, score), pick, book, rewrite.

This is the only place that knows the order of the steps; each step lives in its own module and works on
plain values, so the ext_proc edge can stay a thin protocol translator.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .body import BodyError, ParsedBody, parse_object, rewrite
from .config import Config
from .endpoints import EndpointRegistry
from .load import Booking, LoadTracker
from .metrics import PickerMetrics
from .picker import CostParams, choose, eligible, loads_for
from .request import Rejection, RequestContext

log = logging.getLogger(__name__)

DROP_MEMBERS = frozenset({"nvext"})


@dataclass(slots=True)
class Decision:
    address: str
    body: bytes | None  # the body to forward (None: the request has none)
    booking: Booking
    model: str | None = None
    predicted_cached_tokens: int | None = None


class Pipeline:
    def __init__(self, config: Config, registry: EndpointRegistry, load: LoadTracker,
                 metrics: PickerMetrics) -> None:
        self.config = config
        self.registry = registry
        self.load = load
        self.metrics = metrics
        self.params = CostParams(config.kv_overlap_score_credit, config.prefill_load_scale,
                                 config.router_temperature)

    def parse(self, ctx: RequestContext) -> ParsedBody | None:
        if ctx.body is None:
            return None
        if len(ctx.body) > self.config.max_body_bytes:
            raise Rejection(413, f"request body larger than {self.config.max_body_bytes} bytes",
                            "body_too_large")
        try:
            return parse_object(ctx.body)
        except BodyError as e:
            raise Rejection(400, str(e), "bad_request") from None

    async def decide(self, ctx: RequestContext) -> Decision:
        started = time.perf_counter()
        parsed = self.parse(ctx)
        addresses = eligible([ep.address for ep in self.registry.all()], ctx.subset)
        if not addresses:
            if ctx.subset is not None:
                raise Rejection(503, "no endpoint of the gateway's subset hint is available", "no_endpoint")
            raise Rejection(503, "no endpoint available", "no_endpoint")
        score_started = time.perf_counter()
        candidates = loads_for(addresses, self.load.loads())
        chosen = choose(candidates, self.params)
        booking = self.load.book(chosen.address, chosen.prompt_blocks)
        now = time.perf_counter()
        self.metrics.score_seconds.observe(now - score_started)
        self.metrics.decision_seconds.observe(now - started)
        self.metrics.picks.labels(chosen.address).inc()
        body = ctx.body
        if parsed is not None and ctx.body is not None:
            body = rewrite(parsed, ctx.body, drop=DROP_MEMBERS)
        model = parsed.values.get("model") if parsed is not None else None
        return Decision(chosen.address, body, booking, model if isinstance(model, str) else None)
