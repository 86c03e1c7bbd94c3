"""Disaggregated serving in the mock: context-only and generation-only requests, as trtllm-serve runs them.

What the real server does (TensorRT-LLM, checked at the source; see docs/pd-sidecar.md for the version):
``tensorrt_llm/serve/openai_protocol.py`` ``DisaggregatedParams`` is the wire object (pydantic, extra fields
forbidden); ``tensorrt_llm/serve/openai_disagg_service.py`` (``_get_ctx_request`` / ``_get_gen_request`` /
``_need_gen``) is the orchestrator that sends a copy of the client's request with ``request_type =
"context_only"`` to a context server, then the client's request with the returned params (``request_type =
"generation_only"``, ``ctx_usage`` = the context answer's usage, ``prompt_token_ids`` = the context answer's)
to a generation server. The real engines move the KV blocks themselves (UCX / NIXL between the two
executors, addressed by the context's ``opaque_state`` / ``ctx_info_endpoint``); the mock moves them with one
HTTP call from the generation worker to the context worker (``POST /mock/disagg/fetch``), charging
``disagg_transfer_ms_per_block`` per block.

Fidelity rules (seed 001, the Dynamo TensorRT-LLM mocker) the mock follows:

* the generation leg replays the context phase's first token (and its logprob only if the context phase
  computed one), so both legs' token accounting matches the engine's;
* the handoff state survives a JSON round trip with its types intact (a string, a whole-valued and a
  fractional float, a list) and a corrupted or retyped field is refused, not guessed;
* handoff token ids are whole numbers in the u32 range;
* a request with no handoff sent to a generation worker is served as an aggregated one;
* a cache hit is at most prompt length - 1 (the cache's own rule);
* a capacity rejection (a context the cache could never hold) is an internal, non-retryable error (500
  InternalServerError), as the real server reports a post-acceptance failure; a cache that is only full for
  now makes the generation leg wait for room, as TensorRT-LLM's scheduler does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .engine import Engine, Prefilled
from .events import KvEventPublisher
from .kvcache import KVCache

U32 = 1 << 32
# Every field of ``DisaggregatedParams`` in tensorrt_llm/serve/openai_protocol.py (the pinned version): the
# model forbids extra fields, so the mock refuses anything else like pydantic does.
DISAGG_FIELDS = frozenset({
    "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
    "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint",
    "schedule_style", "conversation_id", "ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking",
})
REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")
OPAQUE_VERSION = "mock-kv-1"


class HandoffRefused(Exception):
    """The request's handoff is malformed, unknown or expired: trtllm-serve's handler answers its generic
    ``create_error_response(str(e))`` (400, flat ErrorResponse)."""


class CapacityRejected(Exception):
    """No KV room for a disaggregated leg: an internal, non-retryable error (500 InternalServerError)."""


@dataclass
class Handoff:
    """What a context worker keeps for one context-only request until the generation worker fetches it."""

    ctx_request_id: int
    session: str
    prompt: list[int]
    salt: str | None
    first_token: int
    first_logprob: float | None
    blocks: int
    fetched: asyncio.Event = field(default_factory=asyncio.Event)


def _whole(v: Any) -> bool:
    """A whole number as JSON may carry it (an int, or a float with no fraction); never a bool."""
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, float) and math.isfinite(v) and v.is_integer()


def token_ids(value: Any, what: str) -> list[int]:
    """Handoff token ids: a list of whole numbers in the u32 range, else refused (never rounded)."""
    if not isinstance(value, list) or not value:
        raise HandoffRefused(f"{what} must be a non-empty list of token ids, got {value!r:.80}")
    out = []
    for v in value:
        if not _whole(v) or not 0 <= v < U32:
            raise HandoffRefused(f"{what} must hold whole numbers in the u32 range, got {v!r}")
        out.append(int(v))
    return out


def parse_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``disaggregated_params`` checked like the pydantic model, or None when absent."""
    dp = body.get("disaggregated_params")
    if dp is None:
        return None
    if not isinstance(dp, dict):
        raise HandoffRefused("disaggregated_params must be an object")
    extra = sorted(set(dp) - DISAGG_FIELDS)
    if extra:
        raise HandoffRefused(f"disaggregated_params: extra inputs are not permitted: {extra}")
    rt = dp.get("request_type")
    if not isinstance(rt, str) or rt.lower() not in REQUEST_TYPES:
        raise HandoffRefused(f"Unknown request type: {rt}. Must be context_only, generation_only or "
                             "context_and_generation")
    for name in ("ctx_request_id", "disagg_request_id", "ctx_dp_rank"):
        v = dp.get(name)
        if v is not None and not _whole(v):
            raise HandoffRefused(f"disaggregated_params.{name} must be an integer, got {v!r}")
    return {**dp, "request_type": rt.lower()}


def encode_opaque(h: Handoff, ctx_url: str) -> str:
    """The opaque state as base64 JSON. Four attributes pin the relay hazards of seed 001: a string (``s``),
    a whole-valued float (``w``), a deliberately fractional float (``f``), a list (``l``)."""
    doc = {"v": OPAQUE_VERSION, "s": h.session, "u": ctx_url, "id": h.ctx_request_id,
           "w": float(h.blocks), "f": h.blocks + 0.25, "l": [len(h.prompt), h.first_token]}
    return base64.b64encode(json.dumps(doc).encode()).decode()


def decode_opaque(state: Any) -> dict[str, Any]:
    """Parse and type-check the opaque state; anything retyped or corrupted is refused."""
    if not isinstance(state, str):
        raise HandoffRefused("encoded_opaque_state must be a string")
    try:
        doc = json.loads(base64.b64decode(state, validate=True))
    except (binascii.Error, ValueError):
        raise HandoffRefused("encoded_opaque_state is not a state this server issued") from None
    if not isinstance(doc, dict) or doc.get("v") != OPAQUE_VERSION:
        raise HandoffRefused("encoded_opaque_state has an unknown version")
    types = {"s": str, "u": str, "id": int, "w": float, "f": float, "l": list}
    for k, t in types.items():
        v = doc.get(k)
        if type(v) is not t:  # exact types: an int where a float was sent is a retyped field
            raise HandoffRefused(f"encoded_opaque_state field {k!r} lost its type ({type(v).__name__})")
    if not doc["w"].is_integer() or doc["f"].is_integer() or doc["f"] != doc["w"] + 0.25:
        raise HandoffRefused("encoded_opaque_state numbers were altered")
    if len(doc["l"]) != 2 or not all(type(x) is int for x in doc["l"]):
        raise HandoffRefused("encoded_opaque_state list was altered")
    return doc


class Disagg:
    """One worker's disaggregated serving: the handoffs it holds (context side) and the fetch it makes
    (generation side). The HTTP side calls :meth:`context_leg` / :meth:`generation_leg`."""

    def __init__(self, engine: Engine, cache: KVCache, publisher: KvEventPublisher | None, name: str,
                 handoff_timeout_s: float, transfer_ms_per_block: float, speedup: float) -> None:
        self.engine = engine
        self.cache = cache
        self.publisher = publisher
        self.name = name
        self.handoff_timeout_s = handoff_timeout_s
        self.transfer_ms_per_block = transfer_ms_per_block
        self.speedup = speedup
        self.url = ""  # the worker's own base URL, set once it listens
        self.pending: dict[int, Handoff] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = {"context_served": 0, "generation_served": 0, "fetched": 0, "expired": 0,
                      "refused": 0, "blocks_transferred": 0}

    # ----------------------------------------------------------------- context side
    async def context_leg(self, prompt: list[int], salt: str | None, params: dict[str, Any],
                          stop_token_ids: list[int], want_logprob: bool) -> tuple[Handoff, int, bool]:
        """Prefill, sample the first token, keep the blocks for the generation worker.

        Returns the handoff, the prompt tokens served from cache, and whether the answer is already final
        (the first token is a stop token). The blocks stay held until fetched or ``handoff_timeout_s``."""
        if not self.engine.fits_at_all(len(prompt) + 1):
            raise CapacityRejected(f"Request needs {self.cache.blocks_needed(len(prompt) + 1)} KV blocks but "
                                   f"the cache only has {self.cache.num_blocks}.")
        gen = self.engine.generate(prompt, salt, 1)
        try:
            pre = await anext(gen)
            first = await anext(gen)
        except BaseException:
            await gen.aclose()
            raise
        assert isinstance(pre, Prefilled) and isinstance(first, int)
        rid = params.get("disagg_request_id")
        rid = int(rid) if rid is not None else next(self._ids)
        h = Handoff(ctx_request_id=rid, session=f"{self.name}-{rid}-{time.monotonic_ns()}", prompt=prompt,
                    salt=salt, first_token=first, first_logprob=-0.5 if want_logprob else None,
                    blocks=len(prompt) // self.cache.tokens_per_block)
        final = first in stop_token_ids
        self.stats["context_served"] += 1
        if final:
            await _drain(gen)  # nothing to hand over: the answer is complete
            return h, pre.cached_tokens, True
        self.pending[rid] = h
        task = asyncio.get_running_loop().create_task(self._hold(h, gen))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return h, pre.cached_tokens, False

    async def _hold(self, h: Handoff, gen: AsyncIterator[Prefilled | int]) -> None:
        """Keep the context's blocks (the engine request stays open) until fetched or timed out."""
        try:
            async with asyncio.timeout(self.handoff_timeout_s):
                await h.fetched.wait()
        except TimeoutError:
            self.stats["expired"] += 1
        finally:
            self.pending.pop(h.ctx_request_id, None)
            await _drain(gen)

    def abandon(self, h: Handoff) -> None:
        """Release a held context at once (its requester is gone)."""
        if self.pending.get(h.ctx_request_id) is h:
            h.fetched.set()

    def fetch(self, ctx_request_id: Any, session: Any) -> dict[str, Any] | None:
        """The generation worker's pull (``POST /mock/disagg/fetch``): the blocks' contents, once."""
        h = self.pending.get(ctx_request_id) if isinstance(ctx_request_id, int) else None
        if h is None or h.session != session or h.fetched.is_set():
            return None
        h.fetched.set()
        self.stats["fetched"] += 1
        return {"prompt": h.prompt, "salt": h.salt, "blocks": h.blocks, "first_token": h.first_token,
                "first_logprob": h.first_logprob}

    # -------------------------------------------------------------- generation side
    async def generation_leg(self, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Check the handoff, pull the context's blocks, charge the transfer, store them here (published as
        BlockStored, as the decode engine keeps what it received), and return what the context sent."""
        try:
            first_tokens = token_ids(params.get("first_gen_tokens"), "first_gen_tokens")
            state = decode_opaque(params.get("encoded_opaque_state"))
            ctx_id = params.get("ctx_request_id")
            if not _whole(ctx_id) or int(ctx_id) != state["id"]:
                raise HandoffRefused("ctx_request_id does not match the opaque state")
            got = await self._pull(state["u"], state["id"], state["s"])
            if got is None:
                raise HandoffRefused(f"Unknown or expired context request {state['id']}: its KV cache is gone")
            if got["prompt"] != prompt or got["first_token"] != first_tokens[0]:
                raise HandoffRefused("The handoff does not match this request's prompt or first token")
        except HandoffRefused:
            self.stats["refused"] += 1
            raise
        total = len(prompt) + 1
        if not self.engine.fits_at_all(total):
            raise CapacityRejected("No KV cache room for the transferred context")
        # A full cache makes the context wait for room, not fail: TensorRT-LLM's scheduler prepares KV for a
        # generation-init request only once it fits (tensorrt_llm/_torch/pyexecutor/py_executor.py
        # `_prepare_disagg_gen_init(fitting_disagg_gen_init_requests)` @9521caf), like any other request here.
        alloc = await self.engine.hold(prompt, got["salt"], total)
        try:
            await asyncio.sleep(got["blocks"] * self.transfer_ms_per_block / 1000.0 / self.speedup)
            events = self.cache.commit_prefill(alloc)
        finally:
            self.engine.release(alloc)
        if events and self.publisher is not None:
            self.publisher.publish(events)
        self.stats["blocks_transferred"] += got["blocks"]
        self.stats["generation_served"] += 1
        lps = params.get("first_gen_log_probs")
        got["first_logprob"] = got["first_logprob"] if lps is not None else None
        return got

    async def _pull(self, ctx_url: str, ctx_id: int, session: str) -> dict[str, Any] | None:
        """One HTTP call to the context worker (the real engines use UCX/NIXL, not HTTP)."""
        timeout = aiohttp.ClientTimeout(total=30)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, s.post(
                ctx_url + "/mock/disagg/fetch", json={"ctx_request_id": ctx_id, "session": session}
            ) as r:
                if r.status != 200:
                    return None
                return await r.json()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def close(self) -> None:
        """Release every held context (shutdown)."""
        for h in list(self.pending.values()):
            h.fetched.set()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t


async def _drain(gen: AsyncIterator[Any]) -> None:
    """Run a generation to its end (so the engine counts it served) and release it."""
    try:
        async for _ in gen:
            pass
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ HTTP answers
def usage_doc(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """trtllm-serve's ``UsageInfo`` with ``prompt_tokens_details``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def ctx_usage_of(params: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt_tokens, cached_tokens) from ``ctx_usage``; the generation worker reports these instead of its
    own (TensorRT-LLM PR #14177: the transferred prompt is not a cache hit). Mistyped: refused."""
    cu = params.get("ctx_usage")
    if cu is None:
        return None
    if not isinstance(cu, dict) or not isinstance(cu.get("prompt_tokens"), int):
        raise HandoffRefused("ctx_usage must be a UsageInfo object")
    details = cu.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else None
    if not isinstance(cached, int):
        raise HandoffRefused("ctx_usage.prompt_tokens_details.cached_tokens must be an integer")
    return cu["prompt_tokens"], cached


def want_logprobs(kind: str, body: dict[str, Any]) -> bool:
    """Whether the request asked for logprobs (chat: ``logprobs: true``; completions: ``logprobs: n``)."""
    lp = body.get("logprobs")
    return bool(lp) if kind == "chat" else lp is not None and lp is not False


def context_answer(kind: str, model: str, prompt: list[int], h: Handoff, cached: int, final: bool,
                   max_tokens: int, params_in: dict[str, Any], opaque: str) -> dict[str, Any]:
    """A context-only answer: the first token, ``disaggregated_params`` for the generation leg (absent when
    the answer is final) and ``prompt_token_ids`` (TensorRT-LLM PR #14844 echoes them on chat too)."""
    from .tokenizer import detokenize

    finish = "stop" if final else ("length" if max_tokens == 1 else "not_finished")
    dp: dict[str, Any] | None = None
    if not final:
        dp = {"request_type": "context_only", "first_gen_tokens": [h.first_token],
              "ctx_request_id": h.ctx_request_id, "encoded_opaque_state": opaque, "draft_tokens": None,
              "disagg_request_id": params_in.get("disagg_request_id"), "ctx_dp_rank": 0,
              "ctx_info_endpoint": None}
        if h.first_logprob is not None:
            dp["first_gen_log_probs"] = [[{str(h.first_token): {"logprob": h.first_logprob}}]]
    text = detokenize([h.first_token])
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + f"ctx{h.ctx_request_id}"
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                          "reasoning_content": None, "tool_calls": []},
                                  "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    if dp is not None:
        choice["disaggregated_params"] = dp
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage_doc(len(prompt), 1, cached), "prompt_token_ids": prompt}


def _error(message: str, status: int) -> web.Response:
    """trtllm-serve's flat ``ErrorResponse`` (``create_error_response``)."""
    err_type = "BadRequestError" if status == 400 else "InternalServerError"
    return web.json_response({"object": "error", "message": message, "type": err_type, "param": None,
                              "code": status}, status=status)


async def serve_disaggregated(disagg: Disagg, model: str, request: web.Request, kind: str, body: dict[str, Any],
                              prompt: list[int], salt: str | None,
                              max_tokens: int) -> web.StreamResponse | None:
    """The server's hook: answer a context-only or generation-only request; None for anything else (no
    ``disaggregated_params``, or ``context_and_generation``), which the server serves as aggregated."""
    try:
        params = parse_params(body)
        if params is None or params["request_type"] == "context_and_generation":
            return None
        if params["request_type"] == "context_only":
            stops = body.get("stop_token_ids") or []
            h, cached, final = await disagg.context_leg(prompt, salt, params, stops, want_logprobs(kind, body))
            if request.transport is None or request.transport.is_closing():
                disagg.abandon(h)  # trtllm-serve aborts a request whose client left: nobody will fetch it
                return web.Response(status=499)
            opaque = encode_opaque(h, disagg.url)
            return web.json_response(context_answer(kind, model, prompt, h, cached, final, max_tokens, params,
                                                    opaque))
        ctx_usage = ctx_usage_of(params)
        got = await disagg.generation_leg(prompt, params)
    except HandoffRefused as exc:
        return _error(str(exc), 400)
    except CapacityRejected as exc:
        return _error(str(exc), 500)
    return await _generation_answer(disagg, model, request, kind, body, prompt, salt, max_tokens, got,
                                    ctx_usage)


async def _generation_answer(disagg: Disagg, model: str, request: web.Request, kind: str, body: dict[str, Any],
                             prompt: list[int], salt: str | None, max_tokens: int, got: dict[str, Any],
                             ctx_usage: tuple[int, int] | None) -> web.StreamResponse:
    """Decode after the handoff: the first token is the context's (replayed, not regenerated), the rest come
    from this engine, which finds the transferred blocks in its cache."""
    from .tokenizer import detokenize

    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + f"gen{int(time.monotonic_ns())}"
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    stream = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    include_usage = body.get("stream_options") is not None and opts.get("include_usage", True) is not False
    resp: web.StreamResponse | None = None
    tokens: list[int] = []
    cached = 0

    def choice_of(piece: str, finish: str | None, lp: float | None) -> dict[str, Any]:
        logprobs = None if lp is None else {"content": [{"token": piece, "logprob": lp}]}
        if kind == "chat":
            return {"index": 0, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}

    async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
        assert resp is not None
        doc: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
        if usage is not None:
            doc["usage"] = usage
        await resp.write(f"data: {json.dumps(doc)}\n\n".encode())

    try:
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
        async with contextlib.aclosing(disagg.engine.generate(prompt, salt, max_tokens)) as gen:
            async for item in gen:
                if isinstance(item, Prefilled):
                    cached = item.cached_tokens
                    if stream and kind == "chat":
                        await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}])
                    continue
                first = not tokens
                tok = got["first_token"] if first else item
                tokens.append(tok)
                if stream:
                    fin = "length" if len(tokens) == max_tokens else None
                    await send([choice_of(detokenize([tok]), fin, got["first_logprob"] if first else None)])
        p_tokens, c_tokens = ctx_usage if ctx_usage is not None else (len(prompt), cached)
        usage = usage_doc(p_tokens, len(tokens), c_tokens)
        if stream:
            if include_usage:
                await send([], usage)
            await resp.write(b"data: [DONE]\n\n")  # type: ignore[union-attr]
            await resp.write_eof()  # type: ignore[union-attr]
            return resp  # type: ignore[return-value]
    except (ConnectionResetError, ConnectionError):
        return resp if resp is not None else web.Response(status=499)
    text = detokenize(tokens)
    lp = got["first_logprob"]
    logprobs = None if lp is None else {"content": [{"token": detokenize(tokens[:1]), "logprob": lp}]}
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                          "reasoning_content": None, "tool_calls": []},
                                  "logprobs": logprobs, "finish_reason": "length", "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length", "stop_reason": None}
    return web.json_response({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                              "usage": usage})


async def fetch_route(disagg: Disagg, request: web.Request) -> web.Response:
    """``POST /mock/disagg/fetch``: the mock's stand-in for the engines' KV transfer (context side)."""
    try:
        doc = await request.json()
    except ValueError:
        return _error("bad fetch body", 400)
    got = disagg.fetch(doc.get("ctx_request_id"), doc.get("session")) if isinstance(doc, dict) else None
    if got is None:
        return _error("unknown or expired context request", 404)
    return web.json_response(got)
