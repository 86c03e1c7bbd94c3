"""The render plan: what a request needs before it is scheduled (its tokens, salt handling, media identities,
body injections), per the engine's rules (core/engine.py). Two Director stages live here, in request order:
`prepare_media` (each media item's allowed identity in the body) and `plan` (salt rules, render, the prompt
as the index keys it). Neither changes anything outside the request."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from epp_extproc.config import MediaCredit, RenderPolicy, SaltPolicy
from epp_extproc.core.body import BodyError, ParsedBody, rewrite, set_content_part_member
from epp_extproc.core.contract import KvLookup, MediaItem, PromptIdentity, PromptKey
from epp_extproc.core.engine import EngineProfile, SaltRule
from epp_extproc.core.errors import PickError, Problem
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
from epp_extproc.core.render import Rendered, Renderer, RenderError, render_kind
from epp_extproc.core.request import RequestContext, clip
from epp_extproc.core.salt import resolve_salt

log = logging.getLogger(__name__)
_throttled = Throttled(log)

DROP_MEMBERS = frozenset({"nvext"})
# The reference's words first (clients match on them), then what counts as a salt and the operator's way out.
TRTLLM_SALT_MESSAGE = ("cache_salt is not supported with TensorRT-LLM workers: an x-tenant-id header counts as a "
                       "salt, as do cache_salt and nvext.cache_salt; a picker started with --cache-salt-policy "
                       "load-only routes such requests by load (the worker still isolates the tenant's cache)")
BYTES_PER_TOKEN_ESTIMATE = 4  # load weight of a request whose prompt could not be rendered
MEDIA_OFF_LOOP_BYTES = 1 << 20  # bodies larger than this have their data URIs hashed off the event loop


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """The render plan's own section of the configuration."""

    cache_salt_policy: SaltPolicy = SaltPolicy.REJECT
    media_credit: MediaCredit = MediaCredit.EXACT
    trust_media_uuids: bool = False
    render_failure_policy: RenderPolicy = RenderPolicy.LOAD_ONLY
    render_reject_policy: RenderPolicy = RenderPolicy.LOAD_ONLY


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
    def load_reason(self) -> str | None:
        """Why the request is routed by load only (None: its prompt is scored against the index). A trace's
        decision span says it, so an operator sees why a request got no cache credit."""
        if self.prompt is not None:
            return None
        if self.salted_load_only:
            return "salted_load_only"
        if self.media_scored is not None and self.media_scored[0] is Scored.LOAD_ONLY:
            return self.media_scored[1]
        if self.kind is None:
            return "not_rendered"  # no renderer, or not an inference request
        if self.tokens is None:
            return "render_failed"
        return "no_kv_index"

    @property
    def route(self) -> str:
        """`kv` when the prompt is known and scored against the index, else `load`."""
        return "kv" if self.tokens is not None else "load"

    def identity(self) -> PromptIdentity:
        return PromptIdentity(self.hash_salt, self.model if isinstance(self.model, str) else None,
                              tuple(item for _, item in self.media_items))


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


class Planner:
    """The render plan of one request, against one renderer and (optionally) one KV index."""

    def __init__(self, settings: PlanSettings, renderer: Renderer | None, engine: EngineProfile | None,
                 kv: KvLookup | None) -> None:
        self.settings = settings
        self.renderer = renderer
        self.engine = engine if renderer is not None else None
        self.kv = kv

    async def prepare_media(self, ctx: RequestContext, parsed: ParsedBody | None
                            ) -> tuple[RequestContext, ParsedBody | None, MediaRequest | None]:
        """The chat request as it is rendered and forwarded once each media item carries the identity the
        picker allows (core/media.py): only the parts' `uuid` members change (core/body.set_content_part_member).
        Raises PickError (400) for an untrusted uuid-only item reference."""
        if parsed is None or render_kind(ctx.path) != "chat" or not has_content_parts(parsed.values):
            return ctx, parsed, None
        salt = resolve_salt(ctx.headers, parsed.values)
        derive = self.engine is not None and self.engine.derives_media_uuids
        args = (parsed, self.settings.trust_media_uuids, salt, derive)
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
        if self.renderer is None or self.engine is None or parsed is None or kind is None:
            return plan
        plan.kind = kind
        salt = resolve_salt(ctx.headers, parsed.values)
        if salt is not None:
            rule = self.engine.salt
            if rule is SaltRule.UNINDEXABLE:
                if self.settings.cache_salt_policy is SaltPolicy.REJECT:
                    raise PickError(Problem.SALT_REJECTED, TRTLLM_SALT_MESSAGE)
                # load-only policy: the worker isolates the tenant, the index cannot, so no KV credit
                if kind == "chat":
                    plan.inject["cache_salt"] = salt
                plan.salted_load_only = True
                return plan
            if rule is SaltRule.HASHED_AND_FORWARDED:
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
        self.key(plan)
        return plan

    def key(self, plan: Plan) -> None:
        """The prompt as the index keys it (KV routing with known tokens only)."""
        if plan.tokens is not None and self.kv is not None and plan.prompt is None:
            plan.prompt = self.kv.prompt(plan.tokens, plan.identity())

    async def _plan_media(self, plan: Plan, ctx: RequestContext, parsed: ParsedBody, media: MediaRequest,
                          base: str | None, count: bool) -> None:
        """Tokens and items of a request with media: the render's spans (vLLM), or the text before the first
        item (renderers that report no spans), or nothing (video, audio, embeddings: routed by load)."""
        assert self.renderer is not None and self.engine is not None and plan.kind is not None
        reason = media.load_only_reason
        if reason is not None:
            plan.media_scored = Scored.LOAD_ONLY, reason
            return
        try:
            if self.engine.media_spans:
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
                self._media_prefix(plan, prefix, None, self.engine.media_prefix_reason)
        except BodyError as e:
            raise PickError(Problem.BAD_REQUEST, str(e)) from None
        except RenderError as e:
            plan.media_scored = Scored.LOAD_ONLY, "render_failed"
            self._render_failed(e, ctx)
        self.key(plan)

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
        if self.settings.media_credit is MediaCredit.TEXT_PREFIX:
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

    def _render_failed(self, e: RenderError, ctx: RequestContext) -> None:
        policy = self.settings.render_reject_policy if e.rejected else self.settings.render_failure_policy
        if policy is RenderPolicy.FAIL:
            raise PickError(Problem.RENDER_FAILED, f"tokenizer: {e.detail}"[:500], e) from None
        _throttled.warning(f"render-{e.label}", "%s %s routed by load only: %s", clip(ctx.method, 16),
                           clip(ctx.path), clip(str(e), 300))
