"""The Director: the only caller of the request stages, in order, and of the three steps around them.

    propose:  parse -> model rewrite -> media -> render plan -> schedule -> body      (no side effects)
    admit:    flow control's ticket; a proposal that waited is scheduled again
    commit:   book the load, then the commit hooks (KV prediction, time observation, decision metrics)

`propose()` does everything that can fail and changes nothing; `admit()` may wait and re-schedule; `commit()`
changes state and cannot fail. A request that fails anywhere therefore leaves no booking and no prediction
behind, and `/debug/score` is a proposal that is never committed (core/debug_view.py renders it). The request's
life around the decision (in-flight caps, body budget, response signals) is the picker's (core/picker.py);
what a lookup and a booking are is written in core/contract.py. The scheduling itself is a profile handler
with its plugins (core/scheduling/), built from one EndpointPickerConfig (core/scheduling/build.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from epp_extproc.core.body import BodyError, ParsedBody, parse_object, replace_string_value
from epp_extproc.core.contract import BookingHandle, KvLookup, PromptKey
from epp_extproc.core.decision import Decision, Stopwatch
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.flow_queue import Ticket
from epp_extproc.core.forward import Forwarder
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.model_rewrite import ModelRewriter, Rewrite
from epp_extproc.core.plan import Plan, Planner
from epp_extproc.core.proposal import Proposal
from epp_extproc.core.render import render_kind
from epp_extproc.core.request import RequestContext, clip
from epp_extproc.core.scheduling.result import SchedulingResult
from epp_extproc.core.scheduling.table import SchedulingRequest
from epp_extproc.core.session import SessionTokens

IDENTITY_ENCODINGS = frozenset({"", "identity"})

# Flow control's admission (core/flow_queue.FlowController.admit, keyed by the request's objective): a
# proposal waits for a ticket while every worker is saturated; None = no flow control.
Admission = Callable[[RequestContext], Awaitable[Ticket]]


class ProfileHandler(Protocol):
    """Schedules a request over its profiles (core/scheduling/*_profile_handler.py)."""

    def candidates(self, req: SchedulingRequest) -> Sequence[str]: ...

    def schedule(self, req: SchedulingRequest, addresses: Sequence[str]) -> SchedulingResult: ...


class CommitHook(Protocol):
    """Runs at commit, after the booking, and cannot fail; may return the response's stopwatch."""

    def committed(self, p: Proposal, booking: BookingHandle) -> Stopwatch | None: ...


@dataclass(frozen=True, slots=True)
class DirectorSettings:
    max_body_bytes: int = 32 * 1024 * 1024
    kv_cache_block_size: int = 32  # an unrendered prompt's estimate is booked in blocks of this size


def predicted_cached_tokens(result: SchedulingResult, prompt: PromptKey | None, kv: KvLookup | None) -> int | None:
    """The cached tokens the answer should report: the destination's overlap, or, when a prefill worker
    computes the prompt, that worker's (the P/D sidecar reports the prefill leg's hits as the answer's
    cached_tokens, as llm-d's does: epp_extproc/pd_sidecar/usage.py). A trace's decision span says it too."""
    if prompt is None or kv is None:
        return None
    served = result.pd.prefill if result.pd.prefill is not None else result.primary
    return int(served.table.overlap[served.chosen]) * kv.block_size(served.address)


class Director:
    def __init__(self, settings: DirectorSettings, registry: EndpointRegistry, load: LoadTracker, *,
                 planner: Planner, scheduler: ProfileHandler, forwarder: Forwarder,
                 rewriter: ModelRewriter | None = None, admission: Admission | None = None,
                 hooks: Sequence[CommitHook] = (), kv: KvLookup | None = None,
                 sessions: SessionTokens | None = None,
                 sheddable: Callable[[RequestContext], bool] | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.load = load
        self.planner = planner
        self.scheduler = scheduler
        self.forwarder = forwarder
        self.rewriter = rewriter  # model rewrites and weighted splits (core/model_rewrite.py)
        self.admission = admission
        self.hooks = hooks
        self.kv = kv
        self.sessions = sessions  # session affinity on: the picker seals a token into each answer
        self.sheddable = sheddable  # does the request's objective say it may be dropped (priority < 0)?

    # ---------------------------------------------------------------- propose: no side effects
    async def propose(self, ctx: RequestContext, *, tokens: list[int] | None = None, count: bool = True,
                      temperature: float | None = None) -> Proposal:
        """The pick this request would get, with its forwarded body; raises PickError, changes nothing.

        `tokens` skips parsing and rendering (a debug request that brings its own ids); `count=False` keeps
        the render call out of the traffic metrics; `temperature` overrides every picker's (debug: 0).
        """
        started = time.perf_counter()
        rewritten: Rewrite | None = None
        if tokens is not None:
            parsed, plan = None, Plan(tokens=tokens)
            self.planner.key(plan)
        else:
            parsed = self.parse(ctx)
            ctx, parsed, rewritten = self.rewrite_model(ctx, parsed)
            ctx, parsed, media = await self.planner.prepare_media(ctx, parsed)
            self._addresses(SchedulingRequest(ctx))  # fail fast, before any render call (filters read the hint)
            plan = await self.planner.plan(ctx, parsed, count=count, media=media)
        req = self.scheduling_request(ctx, plan, temperature)
        score_started = time.perf_counter()
        result = self.schedule(req)
        score_seconds = time.perf_counter() - score_started
        body, verdict = self.forwarder.body(plan, parsed, ctx.body, result.address)
        model = parsed.values.get("model") if parsed is not None else None
        p = Proposal(body, self._booked_blocks(result, plan), plan, req, result,
                     model if isinstance(model, str) else None, started, score_seconds, parsed=parsed,
                     passthrough=verdict, rewrite=rewritten)
        p.predicted_cached_tokens = self._predicted_cached(result, plan)
        return p

    def parse(self, ctx: RequestContext) -> ParsedBody | None:
        if not ctx.body:
            if ctx.body is not None and render_kind(ctx.path) is not None:
                raise PickError(Problem.BAD_REQUEST, "request body must be a JSON object")
            return None  # an empty body outside the inference routes is routed like a body-less request
        limit = self.settings.max_body_bytes
        if len(ctx.body) > limit:
            raise PickError(Problem.BODY_TOO_LARGE, f"request body larger than {limit} bytes")
        encoding = ",".join(ctx.headers.get("content-encoding", [])).strip().lower()
        if encoding not in IDENTITY_ENCODINGS:
            # FastAPI (trtllm-serve, vLLM, SGLang) does not decode request bodies either: the worker would
            # answer a misleading JSON error, and the picker cannot read the prompt to route it.
            raise PickError(Problem.UNSUPPORTED_ENCODING,
                            f"request bodies with Content-Encoding {clip(encoding, 40)!r} are not supported; "
                            "send the JSON body unencoded")
        try:
            return parse_object(ctx.body)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None

    def rewrite_model(self, ctx: RequestContext, parsed: ParsedBody | None
                      ) -> tuple[RequestContext, ParsedBody | None, Rewrite | None]:
        """The request as it is rendered, scored and forwarded once its `model` is rewritten: only the model's
        string value changes in the body (core/body.replace_string_value), so everything after this step, LoRA
        identity included, sees the target as if the client had asked for it. The caller's context is not
        changed (flow control still reads its headers)."""
        if self.rewriter is None or parsed is None:
            return ctx, parsed, None
        rw = self.rewriter.choose(parsed.values.get("model"), ctx.headers)
        if rw is None or not rw.changes:
            return ctx, parsed, rw
        try:
            parsed = replace_string_value(parsed, "model", rw.target)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None
        return replace(ctx, body=parsed.raw), parsed, rw

    def scheduling_request(self, ctx: RequestContext, plan: Plan,
                           temperature: float | None = None) -> SchedulingRequest:
        """What the plugins see of the request (a bench times `schedule` on it alone)."""
        rendered = len(plan.tokens) if plan.tokens is not None else None
        return SchedulingRequest(ctx, plan.prompt, plan.prompt_tokens or rendered or 0, rendered, plan.est_tokens,
                                 bool(ctx.body) and render_kind(ctx.path) is not None, temperature,
                                 self.sheddable, plan.load_reason)

    def _addresses(self, req: SchedulingRequest) -> Sequence[str]:
        """The destinations the request may have; raises PickError (503) when there are none."""
        addresses = self.scheduler.candidates(req)
        if not addresses:
            if req.ctx.subset is not None:
                raise PickError(Problem.NO_ENDPOINT, "no endpoint of the gateway's subset hint is available")
            raise PickError(Problem.NO_ENDPOINT, "no endpoint available")
        return addresses

    def schedule(self, req: SchedulingRequest) -> SchedulingResult:
        """The profile handler's answer over the destinations of this moment (they may have changed during
        the render call, so they are asked again)."""
        return self.scheduler.schedule(req, self._addresses(req))

    def _booked_blocks(self, result: SchedulingResult, plan: Plan) -> float:
        """What this request adds to the chosen worker: only the blocks it must compute (Dynamo books the
        new tokens the same way). Booking the whole prompt would let one extra request in flight cancel the
        overlap credit of a long cached prefix, spreading every group over every worker."""
        if plan.tokens is None:
            return plan.est_tokens / self.settings.kv_cache_block_size
        r = result.primary
        return max(float(r.table.prompt_blocks[r.chosen] - r.table.overlap[r.chosen]), 1.0)

    def _predicted_cached(self, result: SchedulingResult, plan: Plan) -> int | None:
        return predicted_cached_tokens(result, plan.prompt, self.kv)

    # ---------------------------------------------------------------- flow control, between the two
    async def admit(self, p: Proposal, ctx: RequestContext) -> tuple[Proposal, Ticket | None]:
        """Wait for flow control's admission (raises PickError: 429 / 503); hold the ticket until committed.

        A proposal that had to wait is scheduled again against the load of the moment it was let through
        (the render is not repeated): the worker it chose before waiting may be the one that is now full.
        """
        if self.admission is None:
            return p, None
        ticket = await self.admission(ctx)
        if ticket.waited_s <= 0:
            return p, ticket
        try:
            return self._reschedule(p, ticket.waited_s), ticket
        except BaseException:
            ticket.release()
            raise

    def _reschedule(self, p: Proposal, waited_s: float) -> Proposal:
        score_started = time.perf_counter()
        req = replace(p.request, temperature=None)
        result = self.schedule(req)
        q = replace(p, request=req, result=result, booked_blocks=self._booked_blocks(result, p.plan),
                    started=p.started + waited_s, score_seconds=time.perf_counter() - score_started)
        q.predicted_cached_tokens = self._predicted_cached(result, p.plan)
        return q

    # ---------------------------------------------------------------- commit: side effects, cannot fail
    def commit(self, p: Proposal) -> Decision:
        pd = p.result.pd
        prefill = pd.address
        address = p.result.address
        if prefill is None:
            booking = self.load.book(address, p.booked_blocks)
        else:  # one booking per leg (core/contract.py, Roles)
            booking = self.load.book_pair(address, p.booked_blocks, prefill, pd.prefill_blocks)
        timing = None
        for hook in self.hooks:
            t = hook.committed(p, booking)
            if t is not None:
                timing = t
        return Decision(address, p.body, booking, p.model, p.predicted_cached_tokens,
                        session=p.session is not None, prefill=prefill, timing=timing)
