"""From a buffered request to a routing decision: parse, salt, render, score, pick, book, rewrite.

This is the only place that knows the order of the steps; each step lives in its own module and works on
plain values, so the ext_proc edge stays a thin protocol translator.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epp_extproc.adapters.kv_routing import KvRouting, Prompt
from epp_extproc.adapters.render_client import RenderClient, RenderError, render_kind
from epp_extproc.config import Config
from epp_extproc.core.body import BodyError, ParsedBody, parse_object, rewrite
from epp_extproc.core.cost import Candidate, CostParams, choose, eligible, loads_for
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.flow_control import Ticket
from epp_extproc.core.load import Booking, LoadTracker
from epp_extproc.core.request import Rejection, RequestContext
from epp_extproc.core.salt import resolve_salt
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)

DROP_MEMBERS = frozenset({"nvext"})
TRTLLM_SALT_MESSAGE = "cache_salt is not supported with TensorRT-LLM workers"
BYTES_PER_TOKEN_ESTIMATE = 4  # load weight of a request whose prompt could not be rendered


@dataclass(slots=True)
class Decision:
    address: str
    body: bytes | None  # the body to forward (None: the request has none)
    booking: Booking
    model: str | None = None
    predicted_cached_tokens: int | None = None


@dataclass(slots=True)
class Plan:
    """What the request needs before scoring: its tokens (if any), salt handling and body injections."""

    tokens: list[int] | None = None
    prompt: Prompt | None = None  # the tokens packed and hashed for the index (KV routing only)
    hash_salt: str | None = None
    inject: dict[str, Any] = field(default_factory=dict)
    est_tokens: int = 0
    route: str = "load"  # "kv" when scored against the index


class Pipeline:
    def __init__(self, config: Config, registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics,
                 *, renderer: RenderClient | None = None, kv: KvRouting | None = None) -> None:
        self.config = config
        self.registry = registry
        self.load = load
        self.metrics = metrics
        self.renderer = renderer
        self.kv = kv
        self.params = CostParams(config.kv_overlap_score_credit, config.prefill_load_scale,
                                 config.router_temperature)
        self.admission: Callable[[RequestContext], Awaitable[Ticket]] | None = None  # set by app.py

    # ---------------------------------------------------------------- steps
    def parse(self, ctx: RequestContext) -> ParsedBody | None:
        if not ctx.body:
            if ctx.body is not None and render_kind(ctx.path) is not None:
                raise Rejection(400, "request body must be a JSON object", "bad_request")
            return None  # an empty body outside the inference routes is routed like a body-less request
        if len(ctx.body) > self.config.max_body_bytes:
            raise Rejection(413, f"request body larger than {self.config.max_body_bytes} bytes",
                            "body_too_large")
        try:
            return parse_object(ctx.body)
        except BodyError as e:
            raise Rejection(400, str(e), "bad_request") from None

    async def plan(self, ctx: RequestContext, parsed: ParsedBody | None) -> Plan:
        plan = Plan(est_tokens=len(ctx.body or b"") // BYTES_PER_TOKEN_ESTIMATE)
        kind = render_kind(ctx.path)
        if self.renderer is None or parsed is None or kind is None:
            return plan
        protocol = self.renderer.protocol
        salt = resolve_salt(ctx.headers, parsed.values)
        if salt is not None:
            if protocol == "trtllm-render":
                if self.config.cache_salt_policy == "reject":
                    raise Rejection(400, TRTLLM_SALT_MESSAGE, "cache_salt_rejected")
                # load-only policy: the worker isolates the tenant, the index cannot, so no KV credit
                if kind == "chat":
                    plan.inject["cache_salt"] = salt
                self.metrics.requests.labels("salted_load_only").inc()
                return plan
            if protocol == "vllm-render":
                plan.inject["cache_salt"] = salt
            plan.hash_salt = salt
        render_body = rewrite(parsed, ctx.body or b"", drop=DROP_MEMBERS)
        try:
            plan.tokens = await self.renderer.render(kind, render_body)
        except RenderError as e:
            self._render_failed(e, ctx)
            return plan
        plan.route = "kv"
        if self.kv is not None:
            plan.prompt = Prompt(plan.tokens, plan.hash_salt)
        return plan

    def _render_failed(self, e: RenderError, ctx: RequestContext) -> None:
        policy = self.config.render_reject_policy if e.kind == "rejected" else self.config.render_failure_policy
        if policy == "fail":
            raise Rejection(e.status, f"tokenizer: {e.detail}"[:500], f"render_{e.kind}") from None
        log.warning("%s %s routed by load only: %s", ctx.method, ctx.path, e)

    def candidates(self, addresses: Sequence[str], plan: Plan) -> list[Candidate]:
        cands = loads_for(addresses, self.load.loads())
        if plan.tokens is None or self.kv is None:
            return cands
        if plan.prompt is None:
            plan.prompt = Prompt(plan.tokens, plan.hash_salt)
        overlaps = self.kv.overlap(plan.prompt, addresses)
        n = len(plan.tokens)
        for c in cands:
            c.prompt_blocks = n / self.kv.block_size(c.address)
            c.overlap_blocks = overlaps.get(c.address, 0)
        return cands

    def _booked_blocks(self, chosen: Candidate, plan: Plan) -> float:
        """What this request adds to the chosen worker: only the blocks it must compute (Dynamo books the
        new tokens the same way). Booking the whole prompt would let one extra request in flight cancel the
        overlap credit of a long cached prefix, spreading every group over every worker."""
        if plan.tokens is None:
            return plan.est_tokens / self.config.kv_cache_block_size
        return max(chosen.prompt_blocks - chosen.overlap_blocks, 1.0)

    # ---------------------------------------------------------------- decide
    def _eligible(self, ctx: RequestContext) -> list[str]:
        addresses = eligible([ep.address for ep in self.registry.routable()], ctx.subset)
        if not addresses:
            if ctx.subset is not None:
                raise Rejection(503, "no endpoint of the gateway's subset hint is available", "no_endpoint")
            raise Rejection(503, "no endpoint available", "no_endpoint")
        return addresses

    async def decide(self, ctx: RequestContext) -> Decision:
        started = time.perf_counter()
        parsed = self.parse(ctx)
        self._eligible(ctx)  # fail fast, before any render call
        if self.admission is None:
            return await self._decide(ctx, parsed, started)
        # flow control (core/flow_control.py): wait while the pool is saturated; the ticket is held until
        # the booking is made so requests admitted together cannot overshoot the workers' headroom
        ticket = await self.admission(ctx)
        try:
            return await self._decide(ctx, parsed, time.perf_counter())
        finally:
            ticket.release()

    async def _decide(self, ctx: RequestContext, parsed: ParsedBody | None, started: float) -> Decision:
        plan = await self.plan(ctx, parsed)
        addresses = self._eligible(ctx)  # endpoints may have changed during the render call
        score_started = time.perf_counter()
        cands = self.candidates(addresses, plan)
        chosen = choose(cands, self.params)
        booking = self.load.book(chosen.address, self._booked_blocks(chosen, plan))
        predicted = None
        if plan.prompt is not None and self.kv is not None:
            self.kv.predict(chosen.address, plan.prompt)
            predicted = chosen.overlap_blocks * self.kv.block_size(chosen.address)
        now = time.perf_counter()
        self.metrics.score_seconds.observe(now - score_started)
        self.metrics.decision_seconds.observe(now - started)
        self.metrics.picks.labels(chosen.address).inc()
        body = ctx.body
        if parsed is not None and body is not None:
            body = rewrite(parsed, body, drop=DROP_MEMBERS, set_members=plan.inject)
        model = parsed.values.get("model") if parsed is not None else None
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s -> %s via %s (cost %.2f, overlap %d blocks)", ctx.method, ctx.path, chosen.address,
                      plan.route, chosen.cost, chosen.overlap_blocks)
        return Decision(chosen.address, body, booking, model if isinstance(model, str) else None, predicted)

    # ---------------------------------------------------------------- debug
    async def score_only(self, payload: dict[str, Any]) -> dict[str, Any]:
        """What the picker would do with this request, without booking or predicting anything."""
        addresses = [ep.address for ep in self.registry.routable()]
        if isinstance(payload.get("token_ids"), list):
            tokens = payload["token_ids"]
            if not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
                raise ValueError("token_ids must be a list of u32 integers")
            plan = Plan(tokens=tokens, route="kv")
        else:
            body = json.dumps({k: v for k, v in payload.items() if k != "nvext"}).encode()
            path = "/v1/completions" if "prompt" in payload and "messages" not in payload else \
                "/v1/chat/completions"
            ctx = RequestContext("POST", path, {}, body, None)
            try:
                plan = await self.plan(ctx, self.parse(ctx))
            except Rejection as rej:
                raise ValueError(str(rej)) from None
        cands = self.candidates(addresses, plan)
        names = {ep.address: ep.name for ep in self.registry.all()}
        out: dict[str, Any] = {"route": plan.route, "prompt_tokens": len(plan.tokens or []), "workers": []}
        if not cands:
            out["pick"] = None
            return out
        chosen = choose(cands, CostParams(self.params.overlap_credit, self.params.prefill_load_scale, 0.0))
        for c in cands:
            out["workers"].append({"name": names.get(c.address), "address": c.address,
                                   "overlap_blocks": c.overlap_blocks,
                                   "block_size": self.kv.block_size(c.address) if self.kv else None,
                                   "prompt_blocks": round(c.prompt_blocks, 3), "inflight": c.load.inflight,
                                   "prefill_blocks": round(c.load.prefill_blocks, 3),
                                   "decode_blocks": round(c.load.decode_blocks, 3), "cost": round(c.cost, 4)})
        out["pick"] = chosen.address
        return out
