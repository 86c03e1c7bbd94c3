"""One pooled HTTP client for every renderer protocol (TensorRT-LLM, vLLM, SGLang).

The protocols differ only in the answer's field that carries the token ids (`token_ids` vs `input_ids`), so
one client serves all three. A vLLM answer's `features` (the multimodal items' hashes and placeholder ranges)
are read too, bounded and validated (core/media.spans_from_features). Failures are reported as facts (`core.render.RenderError`): the pipeline applies
its policy and the edge maps them to the reference statuses.

Redirects are never followed: a 3xx would re-POST the whole prompt to wherever the renderer (or whoever
answers in its place) points, so it is a failed render (upstream status 3xx) like any other unexpected
status. A circuit breaker (`breaker.py`) stops calling a renderer that keeps failing (timeouts, refused
connections, 401/403/404/429/5xx, redirects, answers that are not token ids): while open, `render` fails at
once with `circuit_open` instead of adding the timeout to every request. A 4xx the reference maps to
"rejected" (the request's fault) or a 200 answer over the size cap (the prompt's size) proves the renderer
alive, so a client cannot open the circuit with bad requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from typing import Any

import orjson
from prometheus_client import Counter, Gauge

from epp_extproc.adapters.breaker import STATE_VALUE, CircuitBreaker
from epp_extproc.adapters.http1 import BodyTooLarge, ConnectFailed, HttpError, Origin, Response
from epp_extproc.core.media import SpansInvalid, spans_from_features
from epp_extproc.core.render import Rendered, RenderError, RenderFailure
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)

TOKEN_FIELD = {"trtllm-render": "token_ids", "vllm-render": "token_ids", "sglang-renderer": "input_ids"}
CHAT_PATH = "/v1/chat/completions/render"
COMPLETIONS_PATH = "/v1/completions/render"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


class _OverCap(RenderError):
    """A 200 answer over the size cap: the prompt's size, not a failing renderer (the breaker ignores it)."""


class RenderClient:
    def __init__(self, protocol: str, base_url: str, *, timeout_ms: int, max_response_bytes: int,
                 metrics: PickerMetrics, breaker_failures: int = 5, breaker_open_ms: int = 5000,
                 breaker_max_open_ms: int = 60_000) -> None:
        if protocol not in TOKEN_FIELD:
            raise ValueError(f"unknown tokenizer protocol {protocol!r}")
        self.protocol = protocol
        self.field = TOKEN_FIELD[protocol]
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_ms / 1000
        self._origin = Origin(self.base_url, limit=256)
        self.max_bytes = max_response_bytes
        self.metrics = metrics
        self._circuit_state = Gauge("epp_render_circuit_state", "Renderer circuit breaker: 0 closed, "
                                    "1 half-open (probing), 2 open (not called, routing by load)",
                                    registry=metrics.registry)
        self._circuit_opens = Counter("epp_render_circuit_opens", "Times the renderer circuit opened "
                                      "(a failed half-open probe re-opens it)", registry=metrics.registry)
        self._outliers = Counter("epp_render_timeout_outliers", "Render calls that timed out while the renderer "
                                 "answered other calls: the request's own doing, not counted against the "
                                 "renderer's circuit", registry=metrics.registry)
        self.breaker = CircuitBreaker(f"renderer {self.base_url}", failures=breaker_failures,
                                      open_s=breaker_open_ms / 1000, max_open_s=breaker_max_open_ms / 1000,
                                      on_change=self._on_circuit)

    def _on_circuit(self, state: str) -> None:
        self._circuit_state.set(STATE_VALUE[state])
        if state == "open":
            self._circuit_opens.inc()

    async def close(self) -> None:
        await self._origin.close()

    async def unreachable(self, timeout_s: float = 2.0) -> str | None:
        """Why the renderer cannot be reached right now (None: it accepts connections). A start-up check
        only: a renderer that is down routes every request by load, which a newcomer should hear about."""
        from urllib.parse import urlsplit

        u = urlsplit(self.base_url)
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(u.hostname, port)
        except TimeoutError:
            return f"no connection within {timeout_s:g}s"
        except OSError as e:
            return e.strerror or str(e)
        writer.close()
        return None

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        started = time.perf_counter()
        outcome = "ok"
        ticket = self.breaker.admit()
        try:
            if ticket is None:
                raise RenderError(RenderFailure.CIRCUIT_OPEN, "renderer not called: its circuit is open after "
                                  f"repeated failures (next probe in {self.breaker.retry_in():.1f}s)")
            ids = await self._render(kind, body)
            ticket.success()
            return ids
        except RenderError as e:
            outcome = e.label
            if ticket is not None:
                if e.rejected or isinstance(e, _OverCap):
                    ticket.success()  # it answered: the request is at fault, not the renderer
                elif e.failure is RenderFailure.TIMEOUT:
                    if ticket.timed_out(str(e)):  # the renderer's fault only if it answered nobody meanwhile
                        self._outliers.inc()
                else:
                    ticket.failure(str(e))
            raise
        finally:
            if ticket is not None:
                ticket.release()  # cancelled mid-call: no verdict, free the half-open probe slot
            if count:  # a /debug/score call is not traffic
                self.metrics.render_requests.labels(self.protocol, outcome).inc()
                if ticket is not None:
                    self.metrics.render_seconds.observe(time.perf_counter() - started)

    async def _render(self, kind: str, body: bytes) -> Rendered:
        path = CHAT_PATH if kind == "chat" else COMPLETIONS_PATH
        try:
            async with asyncio.timeout(self.timeout_s):
                r = await self._origin.post(path, body, content_type="application/json", max_body=self.max_bytes)
        except TimeoutError:
            raise RenderError(RenderFailure.TIMEOUT, f"no answer from {self.base_url + path} within "
                              f"{self.timeout_s:g}s") from None
        except BodyTooLarge as e:
            if e.status == 200:
                raise _OverCap(RenderFailure.INVALID_ANSWER, f"render {e}") from None
            # an error page over the cap: its status decides, its text is not worth it
            r = Response(e.status, {}, b"")
        except ConnectFailed as e:
            raise RenderError(RenderFailure.UNAVAILABLE, f"cannot reach {self.base_url + path}: {_clip(str(e))}") \
                from None
        except HttpError as e:
            raise RenderError(RenderFailure.INVALID_ANSWER, f"{self.base_url + path}: {_clip(str(e))}") from None
        if 300 <= r.status < 400:
            raise RenderError(RenderFailure.UPSTREAM_STATUS, f"renderer answered HTTP {r.status} "
                              f"(redirect to {_clip(r.headers.get('location', '?'), 120)!r}); "
                              "redirects are not followed", r.status)
        if r.status != 200:
            raise RenderError(RenderFailure.UPSTREAM_STATUS, f"renderer answered HTTP {r.status}: "
                              f"{r.body[:200].decode(errors='replace')}", r.status)
        return self._token_ids(r.body, kind)

    def _token_ids(self, raw: bytes, kind: str) -> Rendered:
        try:
            doc: Any = orjson.loads(raw)  # 3x faster than json on a long token list plus the request echo
        except orjson.JSONDecodeError:
            raise RenderError(RenderFailure.INVALID_ANSWER, "render answer is not JSON") from None
        objects = doc if kind == "completion" and isinstance(doc, list) else [doc]
        if not objects:
            raise RenderError(RenderFailure.INVALID_ANSWER, "completions render answered an empty array")
        first = objects[0]  # a multi-prompt request is routed on its first prompt
        if not isinstance(first, dict):
            raise RenderError(RenderFailure.INVALID_ANSWER, "render answer has an unexpected shape")
        ids = first.get(self.field)
        if not isinstance(ids, list) or not _valid_ids(ids):
            raise RenderError(RenderFailure.INVALID_ANSWER, f"render answer has no valid `{self.field}` list "
                                                  f"(protocol {self.protocol})")
        out = _facts(first, ids)
        if self.protocol == "vllm-render" and "features" in first:
            try:  # a hostile renderer's spans are refused here, bounded; the pipeline routes by load then
                out.media = spans_from_features(first["features"], len(ids))
            except SpansInvalid as e:
                out.media_invalid = str(e)[:200]
        if kind == "completion":
            out.prompts = [ids]
            for obj in objects[1:]:
                more = obj.get(self.field) if isinstance(obj, dict) else None
                if not isinstance(more, list) or not _valid_ids(more):
                    out.prompts = None  # still routable on the first prompt, but not forwardable as ids
                    break
                out.prompts.append(more)
                _merge_facts(out, _facts(obj, more))
        return out


def _facts(obj: dict[str, Any], ids: list[int]) -> Rendered:
    """The passthrough-relevant fields of one render object, each defaulting to "do not forward ids"."""
    fp = obj.get("fingerprint")
    ctx = obj.get("context")
    thinking, excluded = None, 0
    if isinstance(ctx, dict):
        t = ctx.get("resolved_thinking")
        thinking = t if isinstance(t, bool) else None if t is None else True  # odd value = non-trivial
        e = ctx.get("prompt_tokens_excluded_from_usage", 0)
        excluded = e if type(e) is int and e >= 0 else 1 if e is not None else 0
    return Rendered(ids, fp if isinstance(fp, dict) else None, obj.get("tokens_trusted") is True, thinking,
                    excluded, isinstance(ctx, dict))


def _merge_facts(into: Rendered, other: Rendered) -> None:
    """Several completions prompts: every one must allow forwarding, and under the same fingerprint."""
    into.tokens_trusted = into.tokens_trusted and other.tokens_trusted
    into.has_context = into.has_context and other.has_context
    if into.resolved_thinking is None:
        into.resolved_thinking = other.resolved_thinking
    into.prompt_tokens_excluded_from_usage = max(into.prompt_tokens_excluded_from_usage,
                                                 other.prompt_tokens_excluded_from_usage)
    if into.fingerprint != other.fingerprint:
        into.fingerprint = None


def _valid_ids(ids: list[Any]) -> bool:
    """Every id a u32 int: array() checks that in C (a Python loop costs ~1 ms on a 32k prompt)."""
    try:
        array("I", ids)
    except (TypeError, OverflowError):
        return False
    return True
