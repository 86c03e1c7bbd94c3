"""Small fake upstreams for the sidecar's integration tests (no tests here): a vLLM prefill/decode pair shaped
from vLLM 0.32.0's NIXL connector and llm-d's sidecar, and a prefill worker that fails or hangs on demand."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# What vLLM's prefill answer carries after a do_remote_decode request (vllm/distributed/kv_transfer/kv_connector/
# v1/nixl/pull_scheduler.py, request_finished: do_remote_prefill, remote_block_ids, remote_engine_id,
# remote_request_id, remote_host, remote_port, tp_size).
VLLM_KV_TRANSFER_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0, 1, 2],
                           "remote_engine_id": "engine-p0", "remote_request_id": "cmpl-p-0",
                           "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
PREFILL_CACHED = 16


@dataclass
class FakeServer:
    """An aiohttp server on a free port whose handler is a method of a subclass; records bodies and headers."""

    seen: list[tuple[dict[str, Any], dict[str, str]]] = field(default_factory=list)
    port: int = 0
    cancelled: int = 0
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:  # pragma: no cover - overridden
        raise NotImplementedError

    async def _entry(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"_raw": body.decode(errors="replace")}
        self.seen.append((doc, {k.lower(): v for k, v in request.headers.items()}))
        try:
            return await self.handle(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._entry)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class VllmPrefill(FakeServer):
    """A vLLM prefill worker: one token, and the parameters the decode worker pulls the blocks with."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = self.seen[-1][0]
        return web.json_response({
            "id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": doc.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                      "prompt_tokens_details": {"cached_tokens": PREFILL_CACHED}},
            "kv_transfer_params": VLLM_KV_TRANSFER_PARAMS})


class VllmDecode(FakeServer):
    """A vLLM decode worker: streams or answers; reports the pulled prompt as its own cache hit (vLLM's
    decode counts the transferred blocks as computed), which the sidecar must rewrite. ``slow`` seconds
    between streamed tokens let a test disconnect mid-stream."""

    slow: float = 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = self.seen[-1][0]
        usage = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                 "prompt_tokens_details": {"cached_tokens": 32}}
        if not doc.get("stream"):
            return web.json_response({
                "id": "chatcmpl-d", "object": "chat.completion", "created": 1, "model": doc.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "A B C"},
                             "finish_reason": "length"}], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i, t in enumerate(("A", " B", " C")):
            chunk = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": t}, "finish_reason": "length" if i == 2 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.slow)
        await resp.write(f"data: {json.dumps({'id': 'chatcmpl-d', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FailingPrefill(FakeServer):
    """Answers ``status`` to every request, or hangs (``hang``) until cancelled."""

    status: int = 503
    hang: bool = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.hang:
            await asyncio.sleep(3600)
        return web.json_response({"object": "error", "message": "busy", "type": "ServiceUnavailable",
                                  "param": None, "code": self.status}, status=self.status)
