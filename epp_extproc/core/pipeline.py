"""From a buffered request to a routing decision, in three steps: propose, admit, commit.

`propose()` does everything that can fail (parse, salt, render, score, choose, prepare the forwarded body) and
changes nothing; `admit()` waits for flow control and may re-score; `commit()` does everything that changes
state (book the load, predict the prompt's blocks, count) and cannot fail. A request that fails anywhere
therefore leaves no booking and no prediction behind, and `/debug/score` is just a proposal that is never
committed. The request's life around the decision (in-flight cap, body budget, response signals) is the
picker's (core/picker.py); what a lookup and a booking are is written in core/contract.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from epp_extproc.config import Config, MediaCredit, RenderPolicy, SaltPolicy, TokenizerProtocol
from epp_extproc.core.body import (
    BodyError,
    ParsedBody,
    parse_object,
    replace_string_value,
    rewrite,
    set_content_part_member,
)
from epp_extproc.core.contract import (
    BookingHandle,
    Bookings,
    KvLookup,
    MediaItem,
    PromptIdentity,
    PromptKey,
    Role,
)
from epp_extproc.core.cost import Candidate, CostParams, choose, choose_bounded, eligible, loads_for
from epp_extproc.core.decision import Decision
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.eviction import EvictionAware
from epp_extproc.core.flow_control import Ticket
from epp_extproc.core.load import BookingChange, EndpointLoad
from epp_extproc.core.logs import Throttled
from epp_extproc.core.media import (
    SENTINELS,
    MediaRequest,
    Scored,
    certain_prefix,
    has_content_parts,
    truncated_conversation,
)
from epp_extproc.core.media import inspect as inspect_media
from epp_extproc.core.model_rewrite import ModelRewriter, Rewrite
from epp_extproc.core.passthrough import ORIGINAL, FingerprintId, Verdict, decide
from epp_extproc.core.pd import AGGREGATED, PdChoice, decide_pair
from epp_extproc.core.render import Rendered, Renderer, RenderError, render_kind
from epp_extproc.core.request import RequestContext, clip
from epp_extproc.core.salt import resolve_salt
from epp_extproc.core.session import SESSION_HEADER, SessionOutcome, SessionTokens
from epp_extproc.core.time_cost import SloUnmet, TimeCost
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)
_throttled = Throttled(log)

DROP_MEMBERS = frozenset({"nvext"})
# The reference's words first (clients match on them), then what counts as a salt and the operator's way out.
TRTLLM_SALT_MESSAGE = ("cache_salt is not supported with TensorRT-LLM workers: an x-tenant-id header counts as a "
                       "salt, as do cache_salt and nvext.cache_salt; a picker started with --cache-salt-policy "
                       "load-only routes such requests by load (the worker still isolates the tenant's cache)")
BYTES_PER_TOKEN_ESTIMATE = 4  # load weight of a request whose prompt could not be rendered
IDENTITY_ENCODINGS = frozenset({"", "identity"})
MEDIA_OFF_LOOP_BYTES = 1 << 20  # bodies larger than this have their data URIs hashed off the event loop

# Flow control's admission (core/flow_control.FlowController.admit, keyed by the request's objective): a
# proposal waits for a ticket while every worker is saturated; None = no flow control.
Admission = Callable[[RequestContext], Awaitable[Ticket]]


def _render_body(parsed: ParsedBody, raw: bytes, set_members: dict[str, Any]) -> bytes:
    """The body the renderer is sent for a request with media: its values re-encoded in C (the renderer only
    reads them, and the megabytes of base64 are not walked again); the byte-preserving rewrite only for the
    rare body orjson cannot encode (values the stdlib parser let through)."""
    try:
        return orjson.dumps({**{k: v for k, v in parsed.values.items() if k not in DROP_MEMBERS}, **set_members})
    except (TypeError, orjson.JSONEncodeError):
        return rewrite(parsed, raw, drop=DROP_MEMBERS, set_members=set_members)


def _media_identities(parsed: ParsedBody, trust: bool, salt: str | None, derive: bool
                      ) -> tuple[MediaRequest | None, ParsedBody]:
    """The request's media (None: it has none) and the body with each item's allowed identity; raises
    PickError (400) for an untrusted uuid-only item reference or a body whose parts cannot be edited."""
    media = inspect_media(parsed.values, trust_uuids=trust, salt=salt, derive=derive)
    if not media.parts:
        return None, parsed
    if media.refused:
        raise PickError(Problem.BAD_REQUEST, media.refused)
    edits = media.edits()
    if not edits:
        return media, parsed
    try:
        return media, set_content_part_member(parsed, "uuid", edits)
    except BodyError as e:
        raise PickError(Problem.BAD_REQUEST, str(e)) from None


class LoadView(Bookings):
    """What the decision needs from the load tracker (core/load.LoadTracker): bookings and the loads."""

    def loads(self) -> dict[str, EndpointLoad]: ...

    def book_pair(self, decode: str, decode_blocks: float, prefill: str,
                  prefill_blocks: float) -> BookingHandle: ...

    def add_listener(self, fn: Callable[[BookingChange], None]) -> None: ...


@dataclass(slots=True)
class Plan:
    """What the request needs before scoring: its tokens (if any), salt handling and body injections."""

    tokens: list[int] | None = None
    prompt: PromptKey | None = None  # the tokens packed and hashed for the index (KV routing only)
    hash_salt: str | None = None
    inject: dict[str, Any] = field(default_factory=dict)
    est_tokens: int = 0
    salted_load_only: bool = False
    model: object = None  # the body's `model`: a LoRA adapter a worker serves is hashed into its blocks
    kind: str | None = None  # "chat" | "completion" when the renderer was (to be) asked
    rendered: Rendered | None = None  # the render answer (None: not rendered, or the render failed)
    media: MediaRequest | None = None  # the request's media parts (None: none), core/media.py
    media_items: tuple[tuple[str, MediaItem], ...] = ()  # (modality, item) credited with their spans
    media_scored: tuple[Scored, str] | None = None  # how an image request was scored, and why
    prompt_tokens: int | None = None  # the whole prompt's length when `tokens` is only its text prefix

    def media_outcome(self) -> tuple[Scored, str]:
        """(scored, reason) of a request with media (metric `epp_media_requests`, `/debug/score`)."""
        if self.media_scored is not None:
            return self.media_scored
        if self.salted_load_only:
            return Scored.LOAD_ONLY, "salted_load_only"
        return Scored.LOAD_ONLY, "render_failed" if self.kind is not None else "no_renderer"

    @property
    def route(self) -> str:
        """`kv` when the prompt is known and scored against the index, else `load`."""
        return "kv" if self.tokens is not None else "load"


@dataclass(slots=True)
class Proposal:
    """Everything a pick needs, computed without side effects."""

    address: str
    body: bytes | None
    booked_blocks: float
    plan: Plan
    candidates: list[Candidate]
    chosen: Candidate
    model: str | None
    started: float
    score_seconds: float
    predicted_cached_tokens: int | None = None  # what the chosen worker should reuse (KV routing only)
    parsed: ParsedBody | None = None
    passthrough: Verdict | None = None  # whether the forwarded body carries the rendered prompt
    rewrite: Rewrite | None = None  # the model rewrite applied before render and scoring (counted at commit)
    session: SessionOutcome | None = None  # None: the client did not opt in to session affinity
    pd: PdChoice = AGGREGATED  # disaggregated pools: the decider's verdict and the prefill worker (core/pd.py)
    slo: str | None = None  # --cost-model time with SLO headers: `met` or `best_effort` (counted at commit)


class Pipeline:
    """The decision, on plain values; every collaborator is handed in, none is patched in later."""

    def __init__(self, config: Config, registry: EndpointRegistry, load: LoadView, metrics: PickerMetrics,
                 *, renderer: Renderer | None = None, kv: KvLookup | None = None,
                 fingerprint_of: Callable[[str], FingerprintId | None] | None = None,
                 admission: Admission | None = None, rewriter: ModelRewriter | None = None,
                 sessions: SessionTokens | None = None, saturated: Callable[[str], bool] | None = None,
                 sheddable: Callable[[RequestContext], bool] | None = None,
                 eviction: EvictionAware | None = None) -> None:
        self.config = config
        self.registry = registry
        self.load = load
        self.metrics = metrics
        self.renderer = renderer
        self.kv = kv
        self.fingerprint_of = fingerprint_of  # a worker's render fingerprint, for prompt passthrough
        self.admission = admission
        self.rewriter = rewriter  # model rewrites and weighted splits (core/model_rewrite.py)
        self.sessions = sessions  # session affinity on: tokens are read and issued
        self.saturated = saturated  # is a worker saturated (flow control's detector)? asked for affinity only
        self.eviction = eviction  # --eviction-aware: discount overlap likely evicted, price flushes (core/eviction.py)
        self.params = CostParams(config.kv_overlap_score_credit, config.prefill_load_scale,
                                 config.router_temperature)
        self.sheddable = sheddable  # does the request's objective say it may be dropped (priority < 0)?
        self.time_cost: TimeCost | None = None  # --cost-model time (core/time_cost.py)
        if config.cost_model == "time":
            error = metrics.ttft_prediction_error
            tc = self.time_cost = TimeCost(
                on_error=lambda a, seen, predicted: error.labels(a).observe((seen - predicted) * 1000.0))
            # the booking's first-chunk signal stops the stopwatch, whichever way it came (response chunk or
            # lean mode's observer stream)
            load.add_listener(lambda ch: tc.on_booking(ch.kind, ch.id, ch.address))

    # ---------------------------------------------------------------- propose: no side effects
    def parse(self, ctx: RequestContext) -> ParsedBody | None:
        if not ctx.body:
            if ctx.body is not None and render_kind(ctx.path) is not None:
                raise PickError(Problem.BAD_REQUEST, "request body must be a JSON object")
            return None  # an empty body outside the inference routes is routed like a body-less request
        if len(ctx.body) > self.config.max_body_bytes:
            raise PickError(Problem.BODY_TOO_LARGE, f"request body larger than {self.config.max_body_bytes} bytes")
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

    async def prepare_media(self, ctx: RequestContext, parsed: ParsedBody | None
                            ) -> tuple[RequestContext, ParsedBody | None, MediaRequest | None]:
        """The chat request as it is rendered and forwarded once each media item carries the identity the
        picker allows (core/media.py): only the parts' `uuid` members change (core/body.set_content_part_member).
        Raises PickError (400) for an untrusted uuid-only item reference."""
        if parsed is None or render_kind(ctx.path) != "chat" or not has_content_parts(parsed.values):
            return ctx, parsed, None
        salt = resolve_salt(ctx.headers, parsed.values)
        derive = self.renderer is not None and self.renderer.protocol == TokenizerProtocol.VLLM
        args = (parsed, self.config.trust_media_uuids, salt, derive)
        if len(ctx.body or b"") > MEDIA_OFF_LOOP_BYTES:  # megabytes of base64 to decode, hash and skip
            media, edited = await asyncio.to_thread(_media_identities, *args)
        else:
            media, edited = _media_identities(*args)
        if media is None:
            return ctx, parsed, None
        if edited is not parsed:
            parsed = edited
            ctx = replace(ctx, body=parsed.raw)
        return ctx, parsed, media

    async def plan(self, ctx: RequestContext, parsed: ParsedBody | None, *, count: bool = True,
                   media: MediaRequest | None = None) -> Plan:
        plan = Plan(est_tokens=len(ctx.body or b"") // BYTES_PER_TOKEN_ESTIMATE,
                    model=parsed.values.get("model") if parsed is not None else None, media=media)
        kind = render_kind(ctx.path)
        if self.renderer is None or parsed is None or kind is None:
            return plan
        protocol = self.renderer.protocol
        plan.kind = kind
        salt = resolve_salt(ctx.headers, parsed.values)
        if salt is not None:
            if protocol == TokenizerProtocol.TRTLLM:
                if self.config.cache_salt_policy is SaltPolicy.REJECT:
                    raise PickError(Problem.SALT_REJECTED, TRTLLM_SALT_MESSAGE)
                # load-only policy: the worker isolates the tenant, the index cannot, so no KV credit
                if kind == "chat":
                    plan.inject["cache_salt"] = salt
                plan.salted_load_only = True
                return plan
            if protocol == TokenizerProtocol.VLLM:
                plan.inject["cache_salt"] = salt
            plan.hash_salt = salt
        base = self.kv.base_model_for(plan.model) if self.kv is not None else None
        if media is not None:
            await self._plan_media(plan, ctx, parsed, media, base, count)
            return plan
        try:  # a LoRA adapter is rendered under its base model: renderers do not know adapters
            render_body = rewrite(parsed, ctx.body or b"", drop=DROP_MEMBERS,
                                  set_members={"model": base} if base else None)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None
        try:
            plan.rendered = await self.renderer.render(kind, render_body, count=count)
            plan.tokens = plan.rendered.token_ids
        except RenderError as e:
            self._render_failed(e, ctx)
            return plan
        if self.kv is not None:
            plan.prompt = self.kv.prompt(plan.tokens, self._identity(plan))
        return plan

    async def _plan_media(self, plan: Plan, ctx: RequestContext, parsed: ParsedBody, media: MediaRequest,
                          base: str | None, count: bool) -> None:
        """Tokens and items of a request with media: the render's spans (vLLM), or the text before the first
        item (renderers that report no spans), or nothing (video, audio, embeddings: routed by load)."""
        assert self.renderer is not None and plan.kind is not None
        reason = media.load_only_reason
        if reason is not None:
            plan.media_scored = Scored.LOAD_ONLY, reason
            return
        protocol = self.renderer.protocol
        try:
            if protocol == TokenizerProtocol.VLLM:
                # `mm_payload: none`: vLLM's render answers the items' hashes and placeholder ranges without
                # serialising the processed tensors (vllm 0.32.0 chat_completion/protocol.py `mm_payload`)
                set_members: dict[str, Any] = {"mm_payload": "none"}
                if base:
                    set_members["model"] = base
                body = _render_body(parsed, ctx.body or b"", set_members)
                rendered = await self.renderer.render(plan.kind, body, count=count)
                self._media_spans(plan, media, rendered)
            else:
                values = {**parsed.values, "model": base} if base else parsed.values
                bodies = [orjson.dumps(truncated_conversation(values, media.first_message, s)) for s in SENTINELS]
                a, b = await self._render_all(plan.kind, bodies, count)
                prefix = certain_prefix(a.token_ids, b.token_ids)
                why = "renderer_refuses_media" if protocol == TokenizerProtocol.TRTLLM else "renderer_has_no_spans"
                self._media_prefix(plan, prefix, None, why)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None
        except RenderError as e:
            plan.media_scored = Scored.LOAD_ONLY, "render_failed"
            self._render_failed(e, ctx)
        if plan.tokens is not None and self.kv is not None:
            plan.prompt = self.kv.prompt(plan.tokens, self._identity(plan))

    async def _render_all(self, kind: str, bodies: list[bytes], count: bool) -> list[Rendered]:
        """Render several bodies at once; the first failure is raised and the other calls are cancelled."""
        assert self.renderer is not None
        tasks = [asyncio.create_task(self.renderer.render(kind, b, count=count)) for b in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()  # no-op for finished calls
            await asyncio.gather(*tasks, return_exceptions=True)

    def _media_spans(self, plan: Plan, media: MediaRequest, rendered: Rendered) -> None:
        """Score with the vLLM render's items: exact, or the text before the first one (`--media-credit`)."""
        items = rendered.media
        if rendered.media_invalid is not None or items is None or len(items) != len(media.parts):
            why = ("invalid_features" if rendered.media_invalid is not None else
                   "no_features" if items is None else "mismatched_items")
            plan.media_scored = Scored.LOAD_ONLY, why
            return
        plan.rendered = rendered
        if self.config.media_credit is MediaCredit.TEXT_PREFIX:
            self._media_prefix(plan, rendered.token_ids[:items[0][1].offset], len(rendered.token_ids),
                               "flag_text_prefix")
            return
        plan.tokens, plan.media_items = rendered.token_ids, items
        plan.media_scored = Scored.EXACT, "spans"

    @staticmethod
    def _media_prefix(plan: Plan, prefix: list[int], total: int | None, why: str) -> None:
        if not prefix:
            plan.media_scored = Scored.LOAD_ONLY, "empty_prefix"
            return
        plan.tokens, plan.prompt_tokens = prefix, total
        plan.media_scored = Scored.TEXT_PREFIX, why

    @staticmethod
    def _identity(plan: Plan) -> PromptIdentity:
        return PromptIdentity(plan.hash_salt, plan.model if isinstance(plan.model, str) else None,
                              tuple(item for _, item in plan.media_items))

    def _render_failed(self, e: RenderError, ctx: RequestContext) -> None:
        policy = self.config.render_reject_policy if e.rejected else self.config.render_failure_policy
        if policy is RenderPolicy.FAIL:
            raise PickError(Problem.RENDER_FAILED, f"tokenizer: {e.detail}"[:500], e) from None
        _throttled.warning(f"render-{e.label}", "%s %s routed by load only: %s", clip(ctx.method, 16),
                           clip(ctx.path), clip(str(e), 300))

    def candidates(self, addresses: Sequence[str], plan: Plan) -> list[Candidate]:
        cands = loads_for(addresses, self.load.loads())
        if plan.tokens is None or self.kv is None:
            return cands
        if plan.prompt is None:
            plan.prompt = self.kv.prompt(plan.tokens, self._identity(plan))
        overlaps = self.kv.overlap(plan.prompt, addresses)
        n = plan.prompt_tokens or len(plan.tokens)
        block_size, overlap = self.kv.block_size, overlaps.get  # once per candidate: a thousand in a large pool
        for c in cands:
            c.prompt_blocks = n / block_size(c.address)
            c.overlap_blocks = overlap(c.address, 0)
        if self.eviction is not None:
            self.eviction.apply(cands)
        return cands

    def _booked_blocks(self, chosen: Candidate, plan: Plan) -> float:
        """What this request adds to the chosen worker: only the blocks it must compute (Dynamo books the
        new tokens the same way). Booking the whole prompt would let one extra request in flight cancel the
        overlap credit of a long cached prefix, spreading every group over every worker."""
        if plan.tokens is None:
            return plan.est_tokens / self.config.kv_cache_block_size
        return max(chosen.prompt_blocks - chosen.overlap_blocks, 1.0)

    def _eligible(self, ctx: RequestContext) -> list[str]:
        # a prefill-only worker is never a destination: it is named in x-prefiller-host-port (core/pd.py)
        addresses = eligible(self.registry.destinations(), ctx.subset)
        if not addresses:
            if ctx.subset is not None:
                raise PickError(Problem.NO_ENDPOINT, "no endpoint of the gateway's subset hint is available")
            raise PickError(Problem.NO_ENDPOINT, "no endpoint available")
        return addresses

    async def propose(self, ctx: RequestContext, *, tokens: list[int] | None = None, count: bool = True,
                      temperature: float | None = None) -> Proposal:
        """The pick this request would get, with its forwarded body; raises PickError, changes nothing.

        `tokens` skips parsing and rendering (a debug request that brings its own ids); `count=False` keeps
        the render call out of the traffic metrics.
        """
        started = time.perf_counter()
        rewritten: Rewrite | None = None
        if tokens is not None:
            parsed, plan = None, Plan(tokens=tokens)
        else:
            parsed = self.parse(ctx)
            ctx, parsed, rewritten = self.rewrite_model(ctx, parsed)
            ctx, parsed, media = await self.prepare_media(ctx, parsed)
            self._eligible(ctx)  # fail fast, before any render call
            plan = await self.plan(ctx, parsed, count=count, media=media)
        addresses = self._eligible(ctx)  # endpoints may have changed during the render call
        score_started = time.perf_counter()
        cands = self.candidates(addresses, plan)
        params = self.params if temperature is None else CostParams(self.params.overlap_credit,
                                                                     self.params.prefill_load_scale, temperature)
        chosen, session, slo = self._choose(ctx, cands, params)
        pd = self._pair(ctx, plan, chosen, params)
        score_seconds = time.perf_counter() - score_started
        body = ctx.body
        verdict = self.passthrough(plan, parsed, chosen.address)
        if parsed is not None and body is not None:
            inject = {**plan.inject, **verdict.inject} if verdict is not None and verdict.inject else plan.inject
            try:
                forwarded = rewrite(parsed, body, drop=DROP_MEMBERS, set_members=inject)
                if verdict is not None and verdict.inject and len(forwarded) > self.config.max_body_bytes:
                    # the ids would push the body past the size every hop is sized for: send the original
                    verdict = Verdict(ORIGINAL, "too_large")
                    forwarded = rewrite(parsed, body, drop=DROP_MEMBERS, set_members=plan.inject)
            except BodyError as e:
                raise PickError(Problem.BAD_REQUEST, str(e)) from None
            body = forwarded
        model = parsed.values.get("model") if parsed is not None else None
        p = Proposal(chosen.address, body, self._booked_blocks(chosen, plan), plan, cands, chosen,
                     model if isinstance(model, str) else None, started, score_seconds, parsed=parsed,
                     passthrough=verdict, rewrite=rewritten, session=session, pd=pd, slo=slo)
        if plan.prompt is not None and self.kv is not None:
            p.predicted_cached_tokens = self._predicted_cached(self.kv, chosen, pd)
        return p

    @staticmethod
    def _predicted_cached(kv: KvLookup, chosen: Candidate, pd: PdChoice) -> int:
        """The cached tokens the answer should report: the destination's overlap, or, when a prefill worker
        computes the prompt, that worker's (the P/D sidecar reports the prefill leg's hits as the answer's
        cached_tokens, as llm-d's does: epp_extproc/pd_sidecar/usage.py)."""
        served = pd.prefill if pd.prefill is not None else chosen
        return served.overlap_blocks * kv.block_size(served.address)

    def _pair(self, ctx: RequestContext, plan: Plan, decode: Candidate, params: CostParams) -> PdChoice:
        """Disaggregated pools only (core/pd.py): whether a prefill worker computes the prompt, and which."""
        if not self.registry.has_prefill():
            return AGGREGATED
        if plan.tokens is not None:
            tokens: int | None = len(plan.tokens)
        else:
            tokens = plan.est_tokens if ctx.body and render_kind(ctx.path) is not None else None
        prefill = eligible([ep.address for ep in self.registry.routable() if ep.role is Role.PREFILL],
                           ctx.subset)
        return decide_pair(decode, prompt_tokens=tokens,
                           block_size=self.kv.block_size(decode.address) if self.kv is not None else None,
                           min_uncached=self.config.pd_min_uncached_tokens, prefill_addresses=prefill,
                           score=lambda a: self.candidates(a, plan), params=params,
                           unknown_prompt_blocks=plan.est_tokens / self.config.kv_cache_block_size)

    def _choose(self, ctx: RequestContext, cands: list[Candidate],
                params: CostParams) -> tuple[Candidate, SessionOutcome | None, str | None]:
        """The cost rule's pick, unless the request's session token names a worker among the candidates
        (healthy, inside the subset) that is not saturated: then that one. The third value is the SLO
        outcome under --cost-model time (None without SLO headers or under the block cost)."""
        chosen, slo = self._pick(ctx, cands, params)
        if self.sessions is None:
            return chosen, None, slo
        tokens = ctx.headers.get(SESSION_HEADER)
        if not tokens:
            return chosen, None, slo
        outcome, address = self.sessions.open(tokens[0])
        if outcome is not SessionOutcome.HONOURED:
            return chosen, outcome, slo
        pinned = next((c for c in cands if c.address == address), None)
        if pinned is None or (self.saturated is not None and self.saturated(pinned.address)):
            return chosen, SessionOutcome.UNAVAILABLE, slo
        return pinned, outcome, slo

    def _pick(self, ctx: RequestContext, cands: list[Candidate],
              params: CostParams) -> tuple[Candidate, str | None]:
        """The block cost's argmin, or under --cost-model time the least predicted time among the workers
        predicted to meet the request's SLO; raises PickError(SLO_UNMET) for a sheddable request none meets."""
        if self.time_cost is None:
            bound = self.config.affinity_load_bound
            return (choose_bounded(cands, params, bound) if bound > 0 else choose(cands, params)), None
        sheddable = ctx.slo is not None and self.sheddable is not None and self.sheddable(ctx)
        try:
            return self.time_cost.choose(cands, params, self._block_size, ctx.slo, sheddable)
        except SloUnmet as e:
            raise PickError(Problem.SLO_UNMET, str(e)) from None

    def _block_size(self, address: str) -> float:
        return float(self.kv.block_size(address) if self.kv is not None else self.config.kv_cache_block_size)

    # ---------------------------------------------------------------- flow control, between the two
    async def admit(self, p: Proposal, ctx: RequestContext) -> tuple[Proposal, Ticket | None]:
        """Wait for flow control's admission (raises PickError: 429 / 503); hold the ticket until committed.

        A proposal that had to wait is re-scored against the load of the moment it was let through (the
        render is not repeated): the worker it chose before waiting may be the one that is now full.
        """
        if self.admission is None:
            return p, None
        ticket = await self.admission(ctx)
        if ticket.waited_s <= 0:
            return p, ticket
        try:
            return self._rescore(p, ctx, ticket.waited_s), ticket
        except BaseException:
            ticket.release()
            raise

    def _rescore(self, p: Proposal, ctx: RequestContext, waited_s: float) -> Proposal:
        score_started = time.perf_counter()
        cands = self.candidates(self._eligible(ctx), p.plan)
        chosen, session, slo = self._choose(ctx, cands, self.params)
        q = replace(p, address=chosen.address, candidates=cands, chosen=chosen, session=session, slo=slo,
                    pd=self._pair(ctx, p.plan, chosen, self.params),
                    booked_blocks=self._booked_blocks(chosen, p.plan), started=p.started + waited_s,
                    score_seconds=time.perf_counter() - score_started)
        if p.plan.prompt is not None and self.kv is not None:
            q.predicted_cached_tokens = self._predicted_cached(self.kv, chosen, q.pd)
        return q

    # ---------------------------------------------------------------- commit: side effects, cannot fail
    def commit(self, p: Proposal) -> Decision:
        prefill = p.pd.address
        if prefill is None:
            booking = self.load.book(p.address, p.booked_blocks)
        else:  # one booking per leg (core/contract.py, Roles)
            booking = self.load.book_pair(p.address, p.booked_blocks, prefill, p.pd.prefill_blocks)
        if p.plan.prompt is not None and self.kv is not None:
            if prefill is not None:
                self.kv.predict(prefill, p.plan.prompt)
            if prefill is None or self._decode_keeps_transferred_blocks():
                # an aggregated request's prediction follows its booking (queue lifetime); a disaggregated
                # one's decode booking sees no prefill end of its own, so it keeps the fixed ttl
                self.kv.predict(p.address, p.plan.prompt, booking.id if prefill is None else None)
        self.metrics.pd_decisions.labels(p.pd.path.value, p.pd.reason.value).inc()
        timing = None
        if self.time_cost is not None:
            timing = self.time_cost.observe(p.address, p.chosen, self.params, self._block_size(p.address),
                                            booking.id)
            if p.slo is not None:
                self.metrics.slo_decisions.labels(p.slo).inc()
        self.metrics.score_seconds.observe(p.score_seconds)
        self.metrics.decision_seconds.observe(time.perf_counter() - p.started)
        self.metrics.picks.labels(p.address).inc()
        self.metrics.requests.labels("routed").inc()
        if p.plan.salted_load_only:
            self.metrics.requests.labels("salted_load_only").inc()
        if p.rewrite is not None:
            rw = p.rewrite
            self.metrics.model_rewrites.labels(rw.resource, rw.label_model, rw.target).inc()
        if p.session is not None:
            self.metrics.session_affinity.labels(p.session.value).inc()
        if p.passthrough is not None:
            self.metrics.prompt_passthrough.labels(p.passthrough.forward, p.passthrough.reason).inc()
        if p.plan.media is not None:
            scored, why = p.plan.media_outcome()
            self.metrics.media_requests.labels(scored.value, why).inc()
            for part in p.plan.media.parts:
                self.metrics.media_items.labels(part.modality, part.source.value).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("-> %s via %s (cost %.2f, overlap %d blocks)", p.address, p.plan.route, p.chosen.cost,
                      p.chosen.overlap_blocks)
        return Decision(p.address, p.body, booking, p.model, p.predicted_cached_tokens,
                        session=p.session is not None, prefill=prefill, timing=timing)

    def _decode_keeps_transferred_blocks(self) -> bool:
        """Does a decode worker's cache hold the prompt blocks a prefill worker sent it as soon as they land, so
        that the next request sharing the prefix finds them there? vLLM (NIXL connector): yes, the scheduler
        caches the received blocks once the load finishes (vllm 0.32.0 v1/core/sched/scheduler.py,
        `_update_waiting_for_remote_kv` -> `kv_cache_manager.cache_blocks`), so they are predicted on the
        decode worker too. TensorRT-LLM: no; a generation server's blocks enter its reuse tree when the sequence
        is released at the request's end (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp @b35ac1b,
        `BlockManager::releaseBlocks` -> `storeBlocksForReuse`), and its own KV events report them then.
        SGLang: not predicted (unchecked). See docs/pd-pools.md."""
        return self.renderer is not None and self.renderer.protocol == TokenizerProtocol.VLLM

    def passthrough(self, plan: Plan, parsed: ParsedBody | None, address: str) -> Verdict | None:
        """May the body sent to `address` carry the rendered prompt (core/passthrough.py)? None when the
        question does not arise: no TensorRT-LLM renderer, or not an inference request with a body."""
        if (plan.kind is None or parsed is None or self.renderer is None
                or self.renderer.protocol != TokenizerProtocol.TRTLLM):
            return None
        worker = self.fingerprint_of(address) if self.fingerprint_of is not None else None
        return decide(self.config.prompt_passthrough, plan.kind, parsed.values, plan.rendered,
                      salted_load_only=plan.salted_load_only, worker=worker, has_media=plan.media is not None)

    # ---------------------------------------------------------------- debug
    def explain(self, p: Proposal) -> dict[str, Any]:
        """A proposal as `/debug/score` shows it: scored, never committed, so its blocks are what the pick
        WOULD book (`would_book_blocks`; `booked_blocks` is the same value under its old, misleading name,
        kept for one release)."""
        names = {ep.address: ep.name for ep in self.registry.all()}

        def row(c: Candidate) -> dict[str, Any]:
            return {"name": names.get(c.address), "address": c.address, "overlap_blocks": c.overlap_blocks,
                    "block_size": self.kv.block_size(c.address) if self.kv else None,
                    "prompt_blocks": round(c.prompt_blocks, 3), "inflight": c.load.inflight,
                    "prefill_blocks": round(c.load.prefill_blocks, 3),
                    "decode_blocks": round(c.load.decode_blocks, 3), "cost": round(c.cost, 4),
                    **({} if c.ttft_s is None else {"predicted_ttft_ms": round(c.ttft_s * 1000.0, 3),
                                                     "predicted_tpot_ms": round((c.tpot_s or 0.0) * 1000.0, 3)})}

        workers = [row(c) for c in p.candidates]
        credit = self.kv.credit(p.plan.prompt, [c.address for c in p.candidates]) \
            if self.kv is not None and p.plan.prompt is not None else None
        for w, c in zip(workers, p.candidates, strict=True):
            if c.eviction is not None:  # --eviction-aware: the figures behind its discount and penalty
                w["eviction"] = c.eviction.explain(c)
            address = str(w["address"])
            if credit is not None:  # where each worker's overlap comes from: its events, or predictions
                c = credit.get(address)
                w["confirmed_blocks"], w["predicted_blocks"] = (c.confirmed, c.predicted) if c else (0, 0)
                # queue lifetime: the worker's predicted blocks alive because their request still waits there
                w["held_prediction_blocks"] = self.kv.held(address) if self.kv is not None else 0
            v = self.passthrough(p.plan, p.parsed, address)
            if v is not None:
                w["prompt_passthrough"] = {"forwarded": v.forward, "reason": v.reason}
        v = p.passthrough
        injected = sorted({*p.plan.inject, *(v.inject if v is not None else ())})
        # what the picked worker would receive: the rendered prompt (`tokens`) or the original body
        forwarded = None if v is None else {"body": v.forward, "reason": v.reason, "members": sorted(v.inject)}
        return {"route": p.plan.route, "prompt_tokens": len(p.plan.tokens or []), "workers": workers,
                "pick": p.address, "would_book_blocks": round(p.booked_blocks, 3),
                "booked_blocks": round(p.booked_blocks, 3),  # deprecated: would_book_blocks
                "predicted_cached_tokens": p.predicted_cached_tokens, "injected_members": injected,
                "forwarded": forwarded,
                "model_rewrite": None if p.rewrite is None else {"rewrite": p.rewrite.resource,
                                                                 "model": p.rewrite.model,
                                                                 "target": p.rewrite.target},
                "session": p.session.value if p.session is not None else None,
                "cost_model": self.config.cost_model, "slo": p.slo,
                "media": self._explain_media(p),
                "pd": self._explain_pd(p, row)}

    def _explain_media(self, p: Proposal) -> dict[str, Any] | None:
        """Each item's identity and source, its span and the picked worker's blocks it keys (first..last)."""
        plan = p.plan
        if plan.media is None:
            return None
        scored, why = plan.media_outcome()
        bs = self.kv.block_size(p.address) if self.kv is not None else self.config.kv_cache_block_size
        spans = iter(plan.media_items)
        items = []
        for part in plan.media.parts:
            doc: dict[str, Any] = {"message": part.message, "part": part.part, "modality": part.modality,
                                   "origin": part.origin, "identity_source": part.source.value,
                                   "forwarded_uuid": part.forward_uuid}
            span = next(spans, None) if plan.media_items else None
            if span is not None:
                item = span[1]
                doc.update(identifier=item.identifier, offset=item.offset, length=item.length,
                           blocks=[item.offset // bs, (item.offset + item.length - 1) // bs], block_size=bs)
            items.append(doc)
        return {"scored": scored.value, "reason": why, "credited_tokens": len(plan.tokens or []),
                "prompt_tokens": plan.prompt_tokens or len(plan.tokens or []), "items": items}

    def _explain_pd(self, p: Proposal, row: Callable[[Candidate], dict[str, Any]]) -> dict[str, Any]:
        """Both choices of a disaggregated pool and the decider's reason (`workers` above are the decode
        candidates; `prefill_workers` the prefill ones, scored only when the decider disaggregates)."""
        pd = p.pd
        return {"path": pd.path.value, "reason": pd.reason.value, "decode": p.address, "prefill": pd.address,
                "uncached_tokens": pd.uncached_tokens,
                "min_uncached_tokens": self.config.pd_min_uncached_tokens,
                "would_book_prefill_blocks": round(pd.prefill_blocks, 3) if pd.address else None,
                "prefill_workers": [row(c) for c in pd.prefill_candidates]}
