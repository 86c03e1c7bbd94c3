"""The HTTP side port (9090): Prometheus /metrics and the /debug API for operators."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.metrics import PickerMetrics

ScoreHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def build_admin_app(registry: EndpointRegistry, load: LoadTracker, metrics: PickerMetrics, *,
                    kv_snapshot: Callable[[], dict[str, Any]] | None = None,
                    score: ScoreHandler | None = None,
                    flow_snapshot: Callable[[], dict[str, Any]] | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def get_metrics(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_endpoints(_: web.Request) -> web.Response:
        out = []
        for ep in registry.all():
            ld = load.load(ep.address)
            out.append({"name": ep.name, "address": ep.address, "kv_events": ep.kv_events,
                        "replay": ep.replay, "healthy": registry.healthy(ep.address), "inflight": ld.inflight,
                        "prefill_blocks": round(ld.prefill_blocks, 3),
                        "decode_blocks": round(ld.decode_blocks, 3)})
        return web.json_response({"synced": registry.synced, "endpoints": out,
                                  "inflight_total": load.total_inflight()})

    async def get_kv(_: web.Request) -> web.Response:
        if kv_snapshot is None:
            return web.json_response({"error": "KV index disabled (no tokenizer protocol)"}, status=404)
        return web.json_response(kv_snapshot())

    async def post_score(req: web.Request) -> web.Response:
        if score is None:
            return web.json_response({"error": "scoring needs a tokenizer protocol"}, status=404)
        try:
            payload = await req.json()
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

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/debug/flow", get_flow)
    app.router.add_get("/debug/endpoints", get_endpoints)
    app.router.add_get("/debug/kv", get_kv)
    app.router.add_post("/debug/score", post_score)
    return app
