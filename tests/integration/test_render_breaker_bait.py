"""Prompts built to time the renderer out are the sender's problem: they never open the renderer's circuit
for everyone else, while a renderer that really hangs still opens it. Over real HTTP, with the real client."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from epp_extproc.adapters.render_client import RenderClient
from epp_extproc.core.render import RenderError, RenderFailure
from epp_extproc.metrics import PickerMetrics

TIMEOUT_MS = 1000  # the product's default is 5 s; the ratios below are what the test keeps (1 s: a loaded CI loop can stall
# for half a second, and 20 baits that start together would all see that stall as the renderer's silence)
TOKENS = {"token_ids": list(range(64))}


class Renderer:
    """Answers at once, except a body carrying "bait" (takes 10 timeouts) or everything once it hangs."""

    def __init__(self) -> None:
        self.hung = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.read()
        if self.hung or b"bait" in body:
            await asyncio.sleep(10 * TIMEOUT_MS / 1000)
        return web.json_response(TOKENS)

    async def start(self) -> Renderer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self


async def test_timeout_bait_never_opens_the_circuit_but_a_hung_renderer_does() -> None:
    r = await Renderer().start()
    metrics = PickerMetrics()
    client = RenderClient("trtllm-render", r.url, timeout_ms=TIMEOUT_MS, max_response_bytes=1 << 20,
                          metrics=metrics, breaker_failures=5, breaker_open_ms=5000)
    outcomes: dict[str, int] = {}

    async def call(body: bytes) -> None:
        try:
            await client.render("chat", body)
            key = "ok"
        except RenderError as e:
            key = e.label
        outcomes[key] = outcomes.get(key, 0) + 1

    baits: list[asyncio.Task[None]] = []

    async def bait_client() -> None:  # 5 requests a second, each one timing out
        for _ in range(10):
            baits.append(asyncio.create_task(call(b'{"messages":[{"role":"user","content":"bait"}]}')))
            await asyncio.sleep(0.2)

    async def normal_client() -> None:
        # one render every 50 ms for as long as any bait call is still waiting: the renderer is seen answering
        # others during every bait's timeout (a fixed count could end before the last baits time out)
        while len(baits) < 20 * 10 or not all(t.done() for t in baits):
            await call(b'{"messages":[{"role":"user","content":"hi"}]}')
            await asyncio.sleep(0.05)

    await asyncio.gather(*(bait_client() for _ in range(20)), normal_client())
    assert client.breaker.opens == 0 and client.breaker.state == "closed"
    assert outcomes.get("circuit_open", 0) == 0 and outcomes["ok"] >= 40
    assert outcomes["timeout"] == 200 and client.breaker.outliers == 200
    assert metrics.registry.get_sample_value("epp_render_timeout_outliers_total") == 200

    r.hung = True  # a real outage: nobody gets an answer any more
    t0 = time.monotonic()
    while client.breaker.state != "open" and time.monotonic() - t0 < 30:
        await asyncio.gather(*(call(b'{"messages":[]}') for _ in range(2)))
    took = time.monotonic() - t0
    assert client.breaker.state == "open"
    assert took < 5 * TIMEOUT_MS / 1000 + 2.0, f"the outage took {took:.1f}s to open the circuit"
    with pytest.raises(RenderError) as e:
        await client.render("chat", b'{"messages":[]}')
    assert e.value.failure is RenderFailure.CIRCUIT_OPEN
    await client.close()
    assert r.runner is not None
    await r.runner.cleanup()
