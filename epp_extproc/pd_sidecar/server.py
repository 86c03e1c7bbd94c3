"""The sidecar's HTTP side: a transparent proxy to the local decode worker, and the two-leg handover when the
request names a prefill worker. Errors inside are exceptions and outcomes; statuses are chosen here only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import generate_latest

from . import trtllm, vllm
from .allowlist import DEFAULT_MAX_ALLOWED, DEFAULT_ROLE_LABEL, Allowlist, PoolWatch, parse_pool_ref
from .metrics import SidecarMetrics
from .sse import answer_as_sse
from .target import PREFILLER_HEADER, TargetRefused, prefill_target
from .usage import SseUsageRewriter, cached_tokens, rewrite_json

log = logging.getLogger("epp_extproc.pd_sidecar")

Engine = Literal["trtllm", "vllm"]
PD_PATHS = ("/v1/chat/completions", "/v1/completions")
RETRY_STATUSES = frozenset({502, 503, 504})
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length"})
DECODE_UNAVAILABLE = ("The decode node is not ready. Please check that the inference service is running and the "
                      "port configuration is correct.")  # llm-d's errors.go, for the same 503


@dataclass
class SidecarConfig:
    """Everything the sidecar is told; the CLI fills it in."""

    decode_url: str = "http://127.0.0.1:8200"
    engine: Engine = "trtllm"
    allowed_prefillers: frozenset[str] = field(default_factory=frozenset)
    max_body_bytes: int = 32 * 1024 * 1024
    prefill_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    trtllm_ctx_usage: bool = True  # send ctx_usage on the generation leg (TensorRT-LLM PR #14177 and later)
    inference_pool: str | None = None  # [namespace/]name: also allow the pool's prefill pods, kept current
    role_label: str = DEFAULT_ROLE_LABEL  # the pod label that says prefill (the picker's --role-label)
    kubeconfig: str | None = None  # outside a cluster; in one, the pod's service account
    max_allowed_prefillers: int = DEFAULT_MAX_ALLOWED  # cap on the pool's part of the allowlist


class PrefillFailed(Exception):
    """The prefill leg did not produce a usable answer; ``reason`` labels the fallback."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Passthrough:
    """A prefill worker's 4xx: the request's own fault, answered to the client as it came (llm-d does so)."""

    status: int
    body: bytes
    content_type: str


def error_response(status: int, code: str, message: str) -> web.Response:
    """The OpenAI-shaped error the picker answers too (``{"error": {message, type, param, code}}``)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    return web.Response(status=status, body=body, content_type="application/json")


def leg_headers(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """Headers for a leg whose answer the sidecar reads or rewrites: no ``accept-encoding``, so the answer comes
    back as JSON / SSE text (the client's own encoding preference applies to the local relay only)."""
    out = headers.copy()
    out.popall("accept-encoding", None)
    return out


def forward_headers(headers: Any) -> CIMultiDict[str]:
    """The client's headers minus hop-by-hop ones and the prefiller header (never forwarded, to either leg)."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk not in HOP_BY_HOP and lk != PREFILLER_HEADER:
            out.add(k, v)
    return out


class Sidecar:
    """One sidecar: an aiohttp app plus the client session it calls both workers with."""

    def __init__(self, config: SidecarConfig, *, api_client_factory: Callable[[], Any] | None = None,
                 **watch_kw: Any) -> None:
        """``api_client_factory`` and ``watch_kw`` reach the pool reflector (tests point it at a fake API
        server and shorten its backoff); the CLI passes neither."""
        self.config = config
        self.decode_url = config.decode_url.rstrip("/")
        self.metrics = SidecarMetrics()
        self.allowlist = Allowlist(config.allowed_prefillers, cap=config.max_allowed_prefillers,
                                   metrics=self.metrics, from_pool=config.inference_pool is not None)
        self.pool_watch: PoolWatch | None = None
        if config.inference_pool is not None:
            namespace, name = parse_pool_ref(config.inference_pool)
            self.pool_watch = PoolWatch(self.allowlist, name, namespace, role_label=config.role_label,
                                        kubeconfig=config.kubeconfig, api_client_factory=api_client_factory,
                                        **watch_kw)
        self.session: aiohttp.ClientSession | None = None
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics_route)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)
        self.app.on_startup.append(self._open)
        self.app.on_cleanup.append(self._close)

    async def _open(self, app: web.Application) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                             timeout=aiohttp.ClientTimeout(total=None))
        if self.pool_watch is not None:
            self.pool_watch.start()

    async def _close(self, app: web.Application) -> None:
        if self.pool_watch is not None:
            await self.pool_watch.stop()
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        """The sidecar's own readiness (it does not probe the decode worker: that has its own probe). With
        ``--inference-pool`` it is 503 until the pool has been listed once: a decode pod that joined the pool
        before its sidecar knew the prefill pods would answer 403 to the picker's first prefill picks."""
        if not self.allowlist.synced:
            return web.json_response({"status": "syncing", "engine": self.config.engine,
                                      "reason": "the InferencePool's prefill pods are not listed yet"}, status=503)
        return web.json_response({"status": "ok", "engine": self.config.engine})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain",
                            charset="utf-8")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every other request: local, or the two legs when a prefill worker is named."""
        m = self.metrics
        try:
            target = prefill_target(request.headers.getall(PREFILLER_HEADER, []), self.allowlist.current)
        except TargetRefused as e:
            m.requests.labels("refused", e.reason).inc()
            log.warning("refused %s %s: %s (client %s)", request.method, request.path, e, request.remote)
            return error_response(e.status, e.reason, str(e))
        body = await request.read()  # bounded by client_max_size (413 beyond it)
        headers = forward_headers(request.headers)
        if target is None or request.method != "POST" or request.path not in PD_PATHS:
            reason = "no_prefiller" if target is None else "not_an_inference_route"
            m.requests.labels("local", reason).inc()
            return await self._local(request, body, headers, "local")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            m.requests.labels("local", "not_a_json_object").inc()
            return await self._local(request, body, headers, "local")
        if self.config.engine == "trtllm":
            return await self._trtllm(request, doc, body, headers, target)
        return await self._vllm(request, doc, body, headers, target)

    # --------------------------------------------------------------------------------------- TensorRT-LLM
    async def _trtllm(self, request: web.Request, doc: dict[str, Any], body: bytes, headers: CIMultiDict[str],
                      target: str) -> web.StreamResponse:
        m = self.metrics
        reason = trtllm.local_reason(request.path, doc)
        if reason is not None:
            m.requests.labels("local", reason).inc()
            return await self._local(request, body, headers, "local")
        rid = trtllm.new_disagg_request_id()
        try:
            ctx = await self._prefill(target, request.path, trtllm.context_request(doc, rid), headers, str(rid))
            if isinstance(ctx, Passthrough):
                m.requests.labels("disaggregated", "prefill_client_error").inc()
                return web.Response(status=ctx.status, body=ctx.body, headers={"Content-Type": ctx.content_type})
            if trtllm.is_final(ctx):
                m.requests.labels("disaggregated", "final_from_context").inc()
                answer = trtllm.final_answer(ctx)
                if doc.get("stream"):
                    opts = doc.get("stream_options")
                    include = isinstance(opts, dict) and opts.get("include_usage", True) is not False
                    sse = answer_as_sse(answer, request.path == "/v1/chat/completions", include)
                    return web.Response(body=sse, content_type="text/event-stream")
                return web.Response(body=orjson.dumps(answer), content_type="application/json")
            gen = trtllm.generation_request(doc, request.path, ctx, rid, self.config.trtllm_ctx_usage)
        except trtllm.BadContextAnswer:
            return await self._fallback(request, body, headers, "bad_prefill_answer")
        except PrefillFailed as e:
            return await self._fallback(request, body, headers, e.reason)
        m.requests.labels("disaggregated", "ok").inc()
        return await self._decode(request, orjson.dumps(gen), headers, cached_tokens(ctx))

    # --------------------------------------------------------------------------------------------- vLLM
    async def _vllm(self, request: web.Request, doc: dict[str, Any], body: bytes, headers: CIMultiDict[str],
                    target: str) -> web.StreamResponse:
        rid = str(uuid.uuid4())
        headers["x-request-id"] = rid  # llm-d names both legs with one id
        try:
            pre = await self._prefill(target, request.path, vllm.prefill_request(doc), headers, rid)
        except PrefillFailed as e:
            return await self._fallback(request, body, headers, e.reason)
        if isinstance(pre, Passthrough):
            self.metrics.requests.labels("disaggregated", "prefill_client_error").inc()
            return web.Response(status=pre.status, body=pre.body, headers={"Content-Type": pre.content_type})
        self.metrics.requests.labels("disaggregated", "ok").inc()
        return await self._decode(request, orjson.dumps(vllm.decode_request(doc, pre)), headers, cached_tokens(pre))

    # ----------------------------------------------------------------------------------------------- legs
    async def _prefill(self, target: str, path: str, leg: dict[str, Any], headers: CIMultiDict[str],
                       rid: str) -> dict[str, Any] | Passthrough:
        """The prefill leg, non-streamed: one retry on 502/503/504 or an unreachable worker; a 4xx is the
        client's answer; anything else (a 500 included: TensorRT-LLM's capacity rejection is internal and not
        retryable) is a failure the caller answers with a local prefill."""
        assert self.session is not None
        m = self.metrics
        data = orjson.dumps(leg)
        headers = leg_headers(headers)
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s, sock_connect=self.config.connect_timeout_s)
        url = f"http://{target}{path}"
        outcome = "unreachable"
        for attempt in (1, 2):
            t0 = time.perf_counter()
            try:
                async with self.session.post(url, data=data, headers=headers, timeout=timeout) as r:
                    payload = await self._read_bounded(r)
                    status = r.status
                    ctype = r.headers.get("content-type", "application/json")
            except asyncio.CancelledError:
                m.legs.labels("prefill", "cancelled").inc()
                log.info("prefill leg %s to %s cancelled (client gone)", rid, target)
                raise
            except TimeoutError:
                m.legs.labels("prefill", "timeout").inc()
                log.warning("prefill leg %s to %s timed out", rid, target)
                raise PrefillFailed("prefill_timeout") from None
            except (aiohttp.ClientError, OSError) as e:
                m.legs.labels("prefill", "unreachable").inc()
                log.warning("prefill leg %s to %s failed: %s (attempt %d)", rid, target, e, attempt)
                outcome = "unreachable"
            else:
                elapsed = time.perf_counter() - t0
                m.leg_seconds.labels("prefill").observe(elapsed)
                if payload is None:
                    m.legs.labels("prefill", "too_large").inc()
                    raise PrefillFailed("prefill_answer_too_large")
                if 200 <= status < 300:
                    m.legs.labels("prefill", "ok").inc()
                    log.debug("prefill leg %s to %s: %d in %.1f ms", rid, target, status, elapsed * 1000)
                    try:
                        answer = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        answer = None
                    if not isinstance(answer, dict):
                        raise PrefillFailed("bad_prefill_answer")
                    return answer
                m.legs.labels("prefill", f"status_{status}").inc()
                log.warning("prefill leg %s to %s: status %d (attempt %d)", rid, target, status, attempt)
                if 400 <= status < 452:
                    return Passthrough(status, payload, ctype)
                if status not in RETRY_STATUSES:
                    raise PrefillFailed(f"prefill_status_{status}")
                outcome = f"prefill_status_{status}"
            if attempt == 1:
                m.prefill_retries.inc()
        raise PrefillFailed(outcome)

    async def _read_bounded(self, r: aiohttp.ClientResponse) -> bytes | None:
        """A prefill answer, or None past ``max_body_bytes`` (a hostile or broken worker cannot fill memory)."""
        limit = self.config.max_body_bytes
        if r.content_length is not None and r.content_length > limit:
            return None
        parts, size = [], 0
        async for chunk in r.content.iter_any():
            size += len(chunk)
            if size > limit:
                return None
            parts.append(chunk)
        return b"".join(parts)

    async def _fallback(self, request: web.Request, body: bytes, headers: CIMultiDict[str],
                        reason: str) -> web.StreamResponse:
        """The prefill leg failed: the decode worker prefills itself (counted)."""
        self.metrics.fallbacks.labels(reason).inc()
        self.metrics.requests.labels("fallback", reason).inc()
        log.warning("prefill leg failed (%s): prefilling locally", reason)
        return await self._local(request, body, headers, "fallback")

    async def _local(self, request: web.Request, body: bytes, headers: CIMultiDict[str],
                     leg: str) -> web.StreamResponse:
        """The request as it came, to the local worker; its answer streamed back byte for byte."""
        return await self._relay(request, request.method, body, headers, leg, None)

    async def _decode(self, request: web.Request, body: bytes, headers: CIMultiDict[str],
                      cached: int) -> web.StreamResponse:
        """The decode leg, streamed to the client, with ``cached_tokens`` set to the prefill leg's."""
        return await self._relay(request, "POST", body, leg_headers(headers), "decode", cached)

    async def _relay(self, request: web.Request, method: str, body: bytes, headers: CIMultiDict[str], leg: str,
                     cached: int | None) -> web.StreamResponse:
        assert self.session is not None
        m = self.metrics
        t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        resp: web.StreamResponse | None = None
        try:
            async with self.session.request(method, self.decode_url + request.path_qs, data=body,
                                            headers=headers, timeout=timeout) as up:
                out_headers = CIMultiDict((k, v) for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP)
                rewrite = cached is not None and up.status == 200
                sse = "text/event-stream" in up.headers.get("content-type", "")
                if rewrite and not sse:
                    payload = await up.read()
                    resp = web.Response(status=up.status, body=rewrite_json(payload, cached or 0),
                                        headers=out_headers)
                else:
                    resp = web.StreamResponse(status=up.status, headers=out_headers)
                    if not rewrite and up.content_length is not None:
                        resp.content_length = up.content_length
                    await resp.prepare(request)
                    rw = SseUsageRewriter(cached or 0) if rewrite else None
                    feed: Callable[[bytes], bytes] = rw.feed if rw else (lambda b: b)
                    async for chunk in up.content.iter_any():
                        out = feed(chunk)
                        if out:
                            await resp.write(out)
                    if rw is not None:
                        tail = rw.flush()
                        if tail:
                            await resp.write(tail)
                    await resp.write_eof()
                m.legs.labels(leg, "ok" if up.status < 400 else f"status_{up.status}").inc()
                log.debug("%s leg: %d in %.1f ms", leg, up.status, (time.perf_counter() - t0) * 1000)
        except asyncio.CancelledError:
            m.legs.labels(leg, "cancelled").inc()
            log.info("%s leg cancelled (client gone)", leg)
            raise
        except (aiohttp.ClientConnectionError, OSError) as e:
            if resp is not None:  # the stream broke after it started: nothing left to answer with
                m.legs.labels(leg, "broken").inc()
                raise
            m.legs.labels(leg, "unreachable").inc()
            log.warning("%s leg: local worker unreachable: %s", leg, e)
            return error_response(503, "decode_unavailable", DECODE_UNAVAILABLE)
        finally:
            m.leg_seconds.labels(leg).observe(time.perf_counter() - t0)
        return resp
