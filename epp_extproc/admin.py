"""The HTTP side ports: Prometheus /metrics (9090, all interfaces) and the /debug admin API (9091, loopback).

They are two listeners because they face different clients. Prometheus scrapes the pod IP, so /metrics must
listen there; /debug shows the pool, the KV index and runs scoring on request, and has no authentication,
so by default it listens on 127.0.0.1 only (reach it with `kubectl port-forward`). `build_admin_app` serves
/metrics too, so one listener can serve both when an operator binds them to the same address and port.

`/debug/score` shares the event loop with the request path, so its cost is bounded: a 4 MiB body, at most
`MAX_DEBUG_TOKENS` token ids, one call at a time (others wait), and its render call is not counted as traffic.

`/debug/page` is the same data for a browser (epp_extproc/debug_page.py), fed by `/debug/pool` and
`/debug/decisions`; every `/debug` path is behind the Host/Origin guard (epp_extproc/admin_guard.py), since a
loopback listener alone does not keep a web page in the operator's browser out.
"""

from __future__ import annotations

import asyncio
import inspect
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp_extproc import debug_page
from epp_extproc.admin_guard import guard
from epp_extproc.core.debug_view import DebugView
from epp_extproc.core.director import Director
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.errors import PickError
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.recent_decisions import RecentDecisions
from epp_extproc.core.request import RequestContext
from epp_extproc.debug_pool import pool_document
from epp_extproc.metrics import PickerMetrics

ScoreHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
MAX_ADMIN_BODY = 4 * 1024 * 1024
MAX_DEBUG_TOKENS = 262_144
_debug_lock = asyncio.Lock()


async def debug_score(director: Director, view: DebugView, payload: dict[str, Any]) -> dict[str, Any]:
    """What the picker would do with this request: `propose()` without `commit()`.

    The body is a chat/completions request, or `{"token_ids": [...]}` to score ids directly. Raises
    ValueError with the reason for a request the picker would refuse.
    """
    async with _debug_lock:
        tokens = payload.get("token_ids")
        if tokens is not None:
            if not isinstance(tokens, list) or len(tokens) > MAX_DEBUG_TOKENS:
                raise ValueError(f"token_ids must be a list of at most {MAX_DEBUG_TOKENS} u32 integers")
            try:
                array("I", tokens)  # every id a u32, checked in C
            except (TypeError, OverflowError):
                raise ValueError("token_ids must be a list of u32 integers") from None
            ctx = RequestContext("POST", "/v1/chat/completions", {}, None)
        else:
            body = orjson.dumps({k: v for k, v in payload.items() if k != "nvext"})
            path = "/v1/completions" if "prompt" in payload and "messages" not in payload else \
                "/v1/chat/completions"
            ctx = RequestContext("POST", path, {}, body)
        try:
            proposal = await director.propose(ctx, tokens=tokens, count=False, temperature=0.0)
        except PickError as e:
            if e.problem.value == "no_endpoint":
                return {"route": None, "prompt_tokens": len(tokens or []), "workers": [], "pick": None}
            raise ValueError(str(e)) from None
        return view.explain(proposal)


def _metrics_handler(metrics: PickerMetrics) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def get_metrics(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
    return get_metrics


def build_metrics_app(metrics: PickerMetrics) -> web.Application:
    """/metrics only: what the all-interfaces listener serves."""
    app = web.Application(client_max_size=1024)  # GET only: no request body worth buffering
    app.router.add_get("/metrics", _metrics_handler(metrics))
    return app


def build_admin_app(registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics, *,
                    kv_snapshot: Callable[[], Any] | None = None,
                    score: ScoreHandler | None = None,
                    flow_snapshot: Callable[[], dict[str, Any]] | None = None,
                    decisions: RecentDecisions | None = None, bind: str = "127.0.0.1") -> web.Application:
    """The admin API; `bind` is the address it listens on (`--admin-bind`), a Host the guard accepts."""
    app = web.Application(client_max_size=MAX_ADMIN_BODY, middlewares=[guard(bind)])

    async def kv_document() -> Any:
        if kv_snapshot is None:
            return None
        snap = kv_snapshot()
        return await snap if inspect.isawaitable(snap) else snap  # --kv-ingest apart: async

    async def get_endpoints(_: web.Request) -> web.Response:
        out = []
        for ep in registry.all():
            ld = load.load(ep.address)
            out.append({"name": ep.name, "address": ep.address, "role": ep.role.value, "kv_events": ep.kv_events,
                        "replay": ep.replay, "healthy": registry.healthy(ep.address), "inflight": ld.inflight,
                        "prefill_blocks": round(ld.prefill_blocks, 3),
                        "decode_blocks": round(ld.decode_blocks, 3),
                        **({"kv_storage_events": ep.kv_storage_events} if ep.kv_storage_events else {})})
        return web.json_response({"synced": registry.synced, "endpoints": out,
                                  "inflight_total": load.total_inflight()})

    async def get_kv(_: web.Request) -> web.Response:
        if kv_snapshot is None:
            return web.json_response({"error": "KV index disabled (no tokenizer protocol)"}, status=404)
        return web.json_response(await kv_document())

    async def post_score(req: web.Request) -> web.Response:
        if score is None:
            return web.json_response({"error": "scoring needs a tokenizer protocol"}, status=404)
        try:
            payload = await req.json(loads=orjson.loads)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response({"error": f"body larger than {MAX_ADMIN_BODY} bytes"}, status=413)
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(payload, dict):
            return web.json_response({"error": "body must be a JSON object"}, status=400)
        try:
            return web.json_response(await score(payload))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)

    async def get_flow(_: web.Request) -> web.Response:
        if flow_snapshot is None:
            return web.json_response({"error": "flow control not wired"}, status=404)
        return web.json_response(flow_snapshot())

    async def get_page(_: web.Request) -> web.Response:
        return web.Response(body=debug_page.PAGE, headers=debug_page.HEADERS)

    async def to_page(_: web.Request) -> web.Response:
        raise web.HTTPFound("/debug/page")

    async def get_pool(_: web.Request) -> web.Response:
        return web.json_response(pool_document(registry, load, await kv_document()))

    def name_of(address: str) -> str | None:
        ep = registry.get(address)
        return ep.name if ep is not None else None

    async def get_decisions(req: web.Request) -> web.Response:
        if decisions is None:
            return web.json_response({"size": 0, "watch_s": 0, "last_seq": 0, "decisions": []})
        try:
            since = max(0, int(req.query.get("since", "0")))
        except ValueError:
            return web.json_response({"error": "since must be an integer"}, status=400)
        return web.json_response(decisions.document(name_of, since))

    app.router.add_get("/metrics", _metrics_handler(metrics))
    app.router.add_get("/debug", to_page)
    app.router.add_get("/debug/", to_page)
    app.router.add_get("/debug/page", get_page)
    app.router.add_get("/debug/pool", get_pool)
    app.router.add_get("/debug/decisions", get_decisions)
    app.router.add_get("/debug/flow", get_flow)
    app.router.add_get("/debug/endpoints", get_endpoints)
    app.router.add_get("/debug/kv", get_kv)
    app.router.add_post("/debug/score", post_score)
    return app
